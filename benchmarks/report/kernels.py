"""Sections 1 to 7 of the summary (bench_linear, bench_softmax, bench_decode, bench_multihead):
the forward kernels against their GEMMs and against softmax, the decode step, working memory and
two threads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import fmt_bytes, fmt_n, fmt_ratio, fmt_time, table
from .results import DEFAULTS, TARGET, frac_of_gemm
from .roofline import decode_bw, decode_bw_note, fmt_bw_frac, fmt_frac_peak

if TYPE_CHECKING:
    from .results import Results


def vs_gemm_linear(res: Results) -> list[str]:
    """Section 1: non-causal linear attention against its GEMMs, N ≥ 4096."""
    L: list[str] = []
    T = TARGET
    rows = []
    for n in [n for n in res.sizes("mh_linear", **T) if n >= 4096]:
        r = res.find("mh_linear", n, **T)
        g = res.gemm_for(r)
        rows.append([fmt_n(n), fmt_time(r.wall), fmt_time(r.cpu), fmt_time(g.wall if g else None),
                     fmt_time(g.cpu if g else None), fmt_ratio(frac_of_gemm(res, r)),
                     fmt_ratio(frac_of_gemm(res, r, cpu=True)), fmt_frac_peak(res, r)])
    if rows:
        L += table(["N", "linear (wall)", "linear (cpu)", "GEMMs Kᵀ V, Q S (wall)", "GEMMs (cpu)",
                    "frac_of_gemm", "frac (cpu time)", "frac_of_peak"], rows)
    else:
        L.append("(no multi-head linear runs with N ≥ 4096 in these results)")
    return L


def vs_gemm_causal(res: Results) -> list[str]:
    """Section 2: causal linear attention (Auto) against the same GEMMs, and the chunk sizes."""
    L: list[str] = []
    T = TARGET
    rows = []
    for n in res.sizes("mh_causal", **T):
        if n < 2048:
            continue
        r = res.find("mh_causal", n, **T)
        g = res.gemm_for(r)
        rows.append([fmt_n(n), fmt_time(r.wall), fmt_time(r.cpu), fmt_time(g.wall if g else None),
                     fmt_time(g.cpu if g else None), fmt_ratio(frac_of_gemm(res, r)),
                     fmt_ratio(frac_of_gemm(res, r, cpu=True)), fmt_frac_peak(res, r)])
    if rows:
        L += table(["N", "causal (wall)", "causal (cpu)", "GEMMs (wall)", "GEMMs (cpu)",
                    "frac_of_gemm",
                    "frac (cpu time)", "frac_of_peak"], rows)
    L.append("")
    L.append("The paper's CPU algorithm, measured in the same run, is compared in table 8.")
    # Chunk sizes (single head) at the largest N.
    ns = res.sizes("causal", phi="elu", dtype="f32", D="64")
    if ns:
        n = ns[-1]
        cells = []
        for r in sorted((r for r in res.runs if r.kind == "causal" and r.size == n
                         and r.params.get("phi") == "elu"
                         and r.params.get("dtype") == "f32" and r.params.get("D") == "64"
                         and all(r.params.get(k) == v for k, v in DEFAULTS.items())),
                        key=lambda r: (r.params.get("alg"), int(r.params.get("chunk", 0)))):
            chunked = r.params.get("alg") == "chunked"
            label = f"chunk {r.params['chunk']}" if chunked else r.params.get("alg")
            cells.append(f"{label}: {fmt_time(r.wall)} (frac_of_gemm "
                         f"{fmt_ratio(frac_of_gemm(res, r))}, "
                         f"frac_of_peak {fmt_frac_peak(res, r)})")
        L.append("")
        L.append(f"Single head, EluPlusOne, D = M = 64, N = {fmt_n(n)}: " + "; ".join(cells) + ".")
    return L


def vs_gemm_softmax(res: Results) -> list[str]:
    """Section 3: tiled softmax against its GEMMs, N ≥ 2048."""
    L: list[str] = []
    T = TARGET
    rows = []
    for n in [n for n in res.sizes("mh_softmax", alg="tiled", **T) if n >= 2048]:
        r = res.find("mh_softmax", n, alg="tiled", **T)
        c = res.find("mh_causal_softmax", n, alg="tiled", **T)
        g = res.gemm_for(r)
        rows.append([fmt_n(n), fmt_time(g.wall if g else None), fmt_time(r.wall),
                     fmt_ratio(frac_of_gemm(res, r)),
                     fmt_ratio(frac_of_gemm(res, r, cpu=True)), fmt_frac_peak(res, r),
                     fmt_time(c.wall if c else None),
                     fmt_ratio(frac_of_gemm(res, c) if c else None),
                     fmt_ratio(frac_of_gemm(res, c, cpu=True) if c else None),
                     fmt_frac_peak(res, c)])
    if rows:
        L += table(["N", "GEMMs (wall)", "softmax (wall)", "frac_of_gemm", "frac (cpu time)",
                    "frac_of_peak",
                    "causal softmax "
                    "(wall)", "frac_of_gemm", "frac (cpu time)", "frac_of_peak"], rows)
    else:
        L.append("(no multi-head softmax runs with N ≥ 2048 in these results)")
    return L


def linear_vs_softmax(res: Results, warn: list[str]) -> list[str]:
    """Section 4: the speed-up of linear attention over tiled softmax."""
    L: list[str] = []
    T = TARGET
    common = sorted(set(res.sizes("mh_linear", **T)) & set(res.sizes("mh_softmax", alg="tiled",
                                                                     **T)))
    if common:
        n = 16384 if 16384 in common else common[-1]
        if n != 16384:
            warn.append(f"speed-up reported at N = {n}: N = 16384 was not measured")
        rows = []
        for lk, sk, label in (("mh_linear", "mh_softmax", "non-causal"),
                              ("mh_causal", "mh_causal_softmax", "causal")):
            a = res.find(lk, n, **T)
            b = res.find(sk, n, alg="tiled", **T)
            if a and b:
                rows.append([label, fmt_n(n), fmt_time(a.wall), fmt_time(b.wall),
                             f"{b.wall / a.wall:.0f}×",
                             f"{b.cpu / a.cpu:.0f}×"])
        L += table(["", "N", "linear", "tiled softmax", "speed-up (wall)", "speed-up (cpu)"], rows,
                   "llrrrr")
    else:
        L.append("(needs multi-head linear and softmax at a common N)")
    return L


def decode_steps(res: Results) -> list[str]:
    """Section 5: the decode step, recurrent state against a softmax step over a KV cache."""
    L: list[str] = []
    dp = dict(dtype="f32", H="8", D="64")
    pos = sorted(set(res.sizes("decode_recurrent", **dp)) | set(res.sizes("decode_softmax", **dp)))
    rows = []
    rec_t, sm_t = [], []
    for p in pos:
        a = res.find("decode_recurrent", p, **dp)
        b = res.find("decode_softmax", p, **dp)
        if a:
            rec_t.append(a.wall)
        if b:
            sm_t.append(b.wall)
        rows.append([fmt_n(p), fmt_time(a.wall if a else None), fmt_time(a.cpu if a else None),
                     fmt_time(b.wall if b else None),
                     fmt_ratio(b.wall / a.wall if a and b else None, 1),
                     fmt_bytes(a.get("state_bytes") if a else None),
                     fmt_bytes(b.get("state_bytes") if b else None),
                     fmt_bw_frac(decode_bw(res, a)), fmt_bw_frac(decode_bw(res, b, softmax=True))])
    if rows:
        L += table(["position", "recurrent step", "(cpu)", "softmax step", "softmax / recurrent",
                    "recurrent state", "KV cache", "recurrent frac_of_bw", "softmax frac_of_bw"],
                    rows)
        if len(rec_t) > 1:
            L.append("")
            L.append("Flatness: recurrent step max/min over positions "
                     f"{max(rec_t) / min(rec_t):.2f} "
                     f"(1.00 = flat; last/first {rec_t[-1] / rec_t[0]:.2f}); softmax step "
                     "last/first "
                     f"{(sm_t[-1] / sm_t[0]) if len(sm_t) > 1 else float('nan'):.1f} over a "
                     f"{pos[-1] // pos[0]}× longer cache.")
        L.append("")
        L.append(decode_bw_note(res))
    else:
        L.append("(no decode runs in these results)")
    return L


def working_memory(res: Results) -> list[str]:
    """Section 6: working memory against N."""
    L: list[str] = []
    T = TARGET
    ns = sorted(set(res.sizes("linear", phi="elu", dtype="f32", D="64")) |
                set(res.sizes("softmax", alg="tiled", dtype="f32", D="64")) |
                set(res.sizes("mh_linear", **T)))
    rows = []
    for n in ns:
        def ws(kind, **p):
            r = res.find(kind, n, **p)
            return fmt_bytes(r.get("ws_bytes")) if r else "–"
        rows.append([fmt_n(n), ws("linear", phi="elu", dtype="f32", D="64"),
                     ws("causal", phi="elu", alg="chunked", chunk="64", dtype="f32", D="64"),
                     ws("softmax", alg="tiled", dtype="f32", D="64"),
                     ws("softmax", alg="naive", dtype="f32", D="64"),
                     ws("mh_linear", **T), ws("mh_causal", **T),
                     ws("mh_softmax", alg="tiled", **T)])
    if rows:
        L += table(["N", "linear", "causal (C=64)", "tiled softmax", "naive softmax",
                    "linear ×8 heads", "causal ×8 heads", "tiled softmax ×8 heads"], rows)
        L.append("")
        L.append("Single head D = M = 64 unless marked ×8 heads (H = 8, one thread). Causal "
                 "kernels also "
                 "keep an F×M + F state per head (16.3 KiB per head at D = M = 64, float).")
    return L


def two_threads(res: Results, warn: list[str]) -> list[str]:
    """Section 7: the multi-head forms on two threads against one."""
    L: list[str] = []
    rows = []
    for kind, p in (("mh_linear", {}), ("mh_causal", {}), ("mh_softmax", {"alg": "tiled"}),
                    ("mh_causal_softmax", {"alg": "tiled"}), ("mh_gemm_linear", {}),
                    ("mh_gemm_softmax", {})):
        one = dict(dtype="f32", H="8", D="64", thr="1", **p)
        two = dict(one, thr="2")
        common = sorted(set(res.sizes(kind, **one)) & set(res.sizes(kind, **two)))
        if not common:
            continue
        n = common[-1]
        a, b = res.find(kind, n, **one), res.find(kind, n, **two)
        rows.append([kind, fmt_n(n), fmt_time(a.wall), fmt_time(b.wall), f"{a.wall / b.wall:.2f}×"])
    if rows:
        L += table(["kernel", "N", "1 thread", "2 threads", "speed-up"], rows, "llrrr")
        ctx = res.contexts.get("bench_multihead", {})
        load, cpus = ctx.get("load_avg", []), ctx.get("num_cpus", 0)
        # The 1-minute load average still counts the previous benchmark program's own thread
        # (about 1.0 in a sequential run): only more than that means another process was busy.
        if load and cpus and load[0] > cpus - 0.5:
            L.append("")
            L.append(f"Load average {load[0]:.2f} on {cpus} CPUs when bench_multihead started: the "
                     "second "
                     "thread competed with other processes for a core, so these speed-ups measure "
                     "the "
                     "machine's spare capacity rather than the kernels' scaling.")
            warn.append("2-thread results were measured with other processes running (load average "
                        f"{load[0]:.2f} on {cpus} CPUs)")
    return L
