"""Decay and gates (bench_gated)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import at_most_status, fmt_bytes, fmt_n, fmt_ratio, fmt_time, speed_ratio, table, wall_cpu
from .results import SHORT_LAYOUT, frac_of_gemm, gt_find, large_sizes
from .roofline import fmt_frac_peak

if TYPE_CHECKING:
    from .results import Results


TARGET_GATED_SCALAR = 1.3
TARGET_GATED_FEATURE = 2.0
TARGET_GATED_DECODE = 1.2
GATE_LABEL = {"scalar": "scalar (N×H)", "feature": "per-feature "
                                                   "(N×H·F)", "none": "none (plain causal, "
                                                                      "EluPlusOne)"}


def gt_dims(res: Results) -> list[str]:
    return sorted({r.params["D"] for r in res.runs if r.kind.startswith("gt_") and "D" in r.params},
                  key=int)


def gated_section(res: Results, warn: list[str]) -> list[str]:
    """Section 14 (bench_gated): the targets call by call, the decode step, the prefill sweep
    against plain causal and the GEMM reference, Chunked vs Recurrent vs Auto, the chunk size, and
    the gradients."""
    L: list[str] = []
    if not any(r.kind.startswith("gt_") for r in res.runs):
        return ["(no bench_gated runs in these results)"]
    if not any(r.kind in ("gt_gated", "gt_pair") for r in res.runs):
        return ["(bench_gated ran without the gated kernels: linattn/gated_attention.hpp was not "
                "in the build)"]
    base = dict(dtype="f32", H="8", thr="1")
    dims = gt_dims(res)

    # Targets, call by call.
    rows = []
    for d in dims:
        for lay in ("row", "col"):
            q = dict(base, D=d, layout=lay, phi="identity", alg="auto")
            for n in res.sizes("gt_pair", **q):
                r = res.find("gt_pair", n, **q)
                cells = [d, SHORT_LAYOUT.get(lay, lay), fmt_n(n),
                         fmt_time(r.get("plain_ms", 0) * 1e-3)]
                for g, what, t in (("scalar", "scalar decay", TARGET_GATED_SCALAR),
                                   ("feature", "per-feature gates", TARGET_GATED_FEATURE)):
                    x, xc = r.get(f"{g}_vs_plain"), r.get(f"{g}_vs_plain_cpu")
                    status, note = at_most_status(x, xc, t)
                    cells += [fmt_time(r.get(f"{g}_ms", 0) * 1e-3), wall_cpu(x, xc), status]
                    if note:
                        warn.append(f"gated prefill, {what}: {wall_cpu(x, xc)}× plain causal (wall "
                                    f"(cpu)) at D = {d}, "
                                    f"N = {n}, {SHORT_LAYOUT.get(lay, lay)}: {note} (target ≤ "
                                    f"{t:.1f}×)")
                rows.append(cells + [str(r.iterations)])
    L.append("Targets, call by call (`gt_pair`: every iteration makes the plain causal call "
             "(`multihead_causal_linear_attention`, EluPlusOne, CausalOptions{}) and both gated "
             "calls "
             "(`multihead_gated_linear_attention`, Auto) back to back, rotating which goes first; "
             "medians of the "
             "per-iteration times and ratios), H = 8:")
    L.append("")
    if rows:
        L += table(["D = M", "layout", "N", "plain causal", "scalar decay", "÷ plain, wall (cpu)",
                    f"≤ {TARGET_GATED_SCALAR:.1f}", "per-feature", "÷ plain, wall "
                                                                   "(cpu)",
                                                                   f"≤ {TARGET_GATED_FEATURE:.1f}",
                    "iterations"], rows, "rlrrrrlrrlr")
    else:
        L.append("(no gt_pair runs in these results)")

    # Decode step.
    L += ["", "Decode step, one head (`gt_decode_pair`: blocks of steps of "
              "`RecurrentLinearAttention<EluPlusOne, "
          "float>::step` and `RecurrentGatedAttention<Identity, float>::step` with a scalar and an "
          "F-vector gate, "
          "timed block by block in rotating order; medians per step):", ""]
    rows = []
    for d in dims:
        q = dict(dtype="f32", H="1", thr="1", D=d, phi="identity")
        for n in res.sizes("gt_decode_pair", **q):
            r = res.find("gt_decode_pair", n, **q)
            cells = [d, f"{r.get('plain_ns', 0):.0f} ns ({1e9 / r.get('plain_ns', 1) / 1e6:.2f} M "
                        "tok/s)"]
            for g in ("scalar", "feature"):
                t, x, xc = r.get(f"{g}_ns"), r.get(f"{g}_vs_plain"), r.get(f"{g}_vs_plain_cpu")
                status, note = at_most_status(x, xc, TARGET_GATED_DECODE)
                cells += [f"{t:.0f} ns ({1e9 / t / 1e6:.2f} M "
                          "tok/s)" if t else "–", wall_cpu(x, xc), status]
                if note:
                    warn.append(f"gated decode step, {g} gate: {wall_cpu(x, xc)}× the plain "
                                "recurrent step (wall (cpu)) "
                                f"at D = {d}: {note} (target ≤ {TARGET_GATED_DECODE:.1f}×)")
            cells.append(f"{int(r.iterations)} × {int(r.get('steps', 0))}")
            rows.append(cells)
    if rows:
        L += table(["D = M", "plain step", "scalar gate", "÷ plain, wall "
                                                          "(cpu)", f"≤ {TARGET_GATED_DECODE:.1f}",
                    "per-feature "
                    "gate", "÷ plain, wall "
                            "(cpu)", f"≤ {TARGET_GATED_DECODE:.1f}", "blocks × steps"], rows,
                   "rrrrlrrlr")
    else:
        L.append("(no gt_decode_pair runs in these results: RecurrentGatedAttention was not in the "
                 "build)")

    # Prefill sweep (separate benchmarks, Auto).
    L += ["", "Prefill sweep, H = 8, `GatedOptions::algorithm = Auto` (separate benchmarks of the "
              "same run; the "
          "call-by-call table above is the one checked against the targets). % of GEMM = useful "
          "GFLOP/s (4·N·F·M "
          "per head for all three) ÷ those of the Eigen products Kᵀ V and Q S of the same shapes "
          "(`gt_gemm_linear`):",
          ""]
    rows = []
    for d in dims:
        for lay in ("row", "col"):
            q = dict(base, D=d, layout=lay)
            ns = large_sizes(res.sizes("gt_causal", **q, phi="elu", alg="auto"))
            for n in ns:
                c = gt_find(res, "gt_causal", n, **q, phi="elu", alg="auto")
                s_ = gt_find(res, "gt_gated", n, **q, gate="scalar", alg="auto")
                f_ = gt_find(res, "gt_gated", n, **q, gate="feature", alg="auto")
                if not c:
                    continue

                def pct(r):
                    x = frac_of_gemm(res, r) if r else None
                    return f"{x * 100:.0f} %" if x else "–"

                rows.append([d, SHORT_LAYOUT.get(lay, lay), fmt_n(n), fmt_time(c.wall),
                             fmt_time(s_.wall if s_ else None), speed_ratio(s_, c),
                             fmt_time(f_.wall if f_ else None), speed_ratio(f_, c),
                             f"{pct(c)} / {pct(s_)} / {pct(f_)}",
                             " / ".join(fmt_frac_peak(res, x, pct=True) for x in (c, s_, f_))])
    if rows:
        L += table(["D = M", "layout", "N", "plain causal", "scalar decay", "÷ plain, wall "
                                                                            "(cpu)", "per-feature",
                    "÷ plain, wall (cpu)", "% of GEMM: plain / scalar / per-feature",
                    "% of peak (frac_of_peak): plain / scalar / per-feature"], rows, "rlrrrrrrrr")
    else:
        L.append("(no gt_causal runs in these results)")

    # Chunked vs Recurrent vs Auto.
    L += ["", "`GatedOptions::algorithm`: Chunked (default chunk) vs Recurrent vs Auto, H = 8 (the "
              "numbers to set "
          "Auto's dispatch from; times are wall times; faster = the explicit algorithm of the "
          "smaller cpu time, "
          "Auto ÷ faster ≈ 1.00 when Auto picks it):", ""]
    rows = []
    for d in dims:
        for lay in ("row", "col"):
            for g in ("scalar", "feature"):
                q = dict(base, D=d, layout=lay, gate=g)
                for n in res.sizes("gt_gated", **q, alg="recurrent"):
                    ch = gt_find(res, "gt_gated", n, **q, alg="chunked")
                    rc = gt_find(res, "gt_gated", n, **q, alg="recurrent")
                    au = gt_find(res, "gt_gated", n, **q, alg="auto")
                    if not (ch and rc):
                        continue
                    # Judged on cpu time, which other processes disturb less than wall time.
                    best = "chunked" if ch.cpu <= rc.cpu else "recurrent"
                    bt = min(ch.cpu, rc.cpu)
                    rows.append([d, SHORT_LAYOUT.get(lay, lay), g, fmt_n(n), fmt_time(ch.wall),
                                 fmt_time(rc.wall),
                                 speed_ratio(rc, ch), fmt_time(au.wall if au else None), best,
                                 fmt_ratio(au.cpu / bt if au else None)])
    if rows:
        L += table(["D = M", "layout", "gate", "N", "chunked", "recurrent", "recurrent ÷ chunked, "
                                                                            "wall (cpu)", "auto",
                    "faster (cpu)", "auto ÷ faster (cpu)"], rows, "rllrrrrrlr")
    else:
        L.append("(no explicit-algorithm runs in these results)")

    # Chunk size.
    rows, chunks = [], sorted({int(r.params["chunk"]) for r in res.runs if r.kind == "gt_gated"
                               and "chunk" in r.params})
    for d in dims:
        for g in ("scalar", "feature"):
            q = dict(base, D=d, layout="row", gate=g, alg="chunked")
            ns = sorted({r.size for r in res.runs if r.kind == "gt_gated" and "chunk" in r.params
                         and all(r.params.get(k) == v for k, v in q.items())})
            for n in ns:
                runs = {c: gt_find(res, "gt_gated", n, chunk=str(c), **q) for c in chunks}
                dflt = gt_find(res, "gt_gated", n, **q)
                have = {c: r for c, r in runs.items() if r}
                if not have:
                    continue
                best = min(have, key=lambda c: have[c].wall)
                cells = [(("**" + fmt_time(have[c].wall) + "**") if c == best
                          else fmt_time(have[c].wall))
                         if c in have else "–" for c in chunks]
                rows.append([d, g, fmt_n(n)] + cells + [fmt_time(dflt.wall) if dflt else "–",
                                                        fmt_ratio(dflt.wall / have[best].wall
                                                                  if dflt else None)])
    if rows:
        L += ["", "Chunk size of the chunked algorithm (`GatedOptions::chunk_size`, row-major "
                  "inputs, H = 8; fastest "
              "in bold; default = chunk_size 0, measured by the sweep above when it reaches that "
              "N):", ""]
        L += table(["D = M", "gate", "N"] + [f"C = {c}" for c in chunks] + ["default",
                                                                            "default ÷ fastest"],
                                                                            rows,
                   "rlr" + "r" * (len(chunks) + 2))

    # Gradients.
    rows = []
    q0 = dict(base, D="64")
    for lay in ("row", "col"):
        for g, phi in (("scalar", "identity"), ("feature", "identity")):
            q = dict(q0, layout=lay, gate=g, phi=phi)
            for n in res.sizes("gt_train", **q, **{"pass": "bwd"}):
                f = res.find("gt_train", n, **q, **{"pass": "fwd"})
                b = res.find("gt_train", n, **q, **{"pass": "bwd"})
                cq = dict(q0, layout=lay, gate="none", phi="elu")
                cf = res.find("gt_train", n, **cq, **{"pass": "fwd"})
                cb = res.find("gt_train", n, **cq, **{"pass": "bwd"})
                rows.append([SHORT_LAYOUT.get(lay, lay), g, fmt_n(n),
                             fmt_time(f.wall if f else None), fmt_time(b.wall),
                             speed_ratio(b, f), fmt_time(cb.wall if cb else None),
                             speed_ratio(b, cb),
                             speed_ratio(f, cf), fmt_ratio(b.gflops(), 1),
                             fmt_frac_peak(res, b, pct=True),
                             fmt_bytes(b.get("ws_bytes"))])
    L += ["", "Gradients, H = 8, D = M = 64 (`multihead_gated_linear_attention_backward` and "
          "`multihead_causal_linear_attention_backward` with a reused `MultiHeadWorkspace`, "
          "gradients in the inputs' "
          "layout; forwards likewise; useful flops of a backward 8·N·F·M per head):", ""]
    if rows:
        L += table(["layout", "gate", "N", "gated forward", "gated backward", "backward ÷ own "
                                                                              "forward, wall (cpu)",
                    "plain causal "
                    "backward", "gated ÷ plain backward, wall "
                                "(cpu)", "gated ÷ plain forward, wall (cpu)",
                    "backward GFLOP/s", "backward % of "
                                        "peak", "backward working memory"], rows, "llrrrrrrrrrr")
    else:
        L.append("(not measured: this build has no multihead_gated_linear_attention_backward)")
    return L
