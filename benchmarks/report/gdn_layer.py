"""The Gated DeltaNet layer of Qwen3-Next (bench_gdn_layer): prefill and decode tokens/s and the
time split of a prefill. A generated block of its own in docs/benchmarks.md (bench:gdn_layer),
with the run it came from named in it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import at_most_status, fmt_bytes, fmt_n, fmt_time, table, wrap
from .kda import run_line

if TYPE_CHECKING:
    from .results import Results, Run


# The target: the convolution, gates and norm together add at most this fraction of the
# projections' and recurrence's time to the layer's prefill.
TARGET_CGN = 0.15

PARTS = ("proj", "gather", "conv", "gates", "rec", "norm")
PART_LABEL = {
    "proj": "projections (X·in_proj_qkvzᵀ, X·in_proj_baᵀ, o·out_projᵀ)",
    "gather": "gather (interleaved projections → packed q, k, v, z, b, a)",
    "conv": "short convolution (`batched_short_convolution`, SiLU)",
    "gates": "gates (`beta_activation`, `gate_activation`)",
    "rec": "recurrence (`batched_delta_rule_attention`)",
    "norm": "gated norm (`gated_rms_norm`)",
}


def _runs(res: Results, kind: str, **params) -> list[Run]:
    return [r for r in res.runs if r.kind == kind
            and all(r.params.get(k) == v for k, v in params.items())]


def _find(res: Results, kind: str, size: int, **params) -> Run | None:
    return next((r for r in _runs(res, kind, **params) if r.size == size), None)


def _threads(res: Results, kind: str) -> list[str]:
    return sorted({r.params["thr"] for r in _runs(res, kind)}, key=int)


def _pct(x: float | None) -> str:
    return f"{x * 100:.0f} %" if x is not None else "–"


def _rate(x: float | None) -> str:
    if not x:
        return "–"
    return f"{x / 1e3:.1f} k" if x >= 1e4 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _shape(res: Results) -> str:
    r = next((r for r in res.runs if r.kind.startswith("gdn_")), None)
    if r is None:
        return "?"
    p = r.params
    return (f"hidden {p.get('hidden', '?')}, {p.get('Hk', '?')} query/key heads and "
            f"{p.get('Hv', '?')} value heads of {p.get('D', '?')}")


def gdn_layer_section(res: Results, warn: list[str],
                      command: str = "bench_gdn_layer --full") -> list[str]:
    if not any(r.kind.startswith("gdn_") for r in res.runs):
        return ["(no bench_gdn_layer runs in these results)"]
    L = run_line(res, "bench_gdn_layer", command) + [""]
    thrs = _threads(res, "gdn_prefill")

    # Prefill: one row per N, the thread counts side by side.
    rows = []
    for n in sorted({r.size for r in _runs(res, "gdn_prefill")}):
        row = [fmt_n(n)]
        base = None
        for thr in thrs:
            r = _find(res, "gdn_prefill", n, thr=thr)
            if r is None:
                row += ["–"] * 4
                continue
            base = base or r
            row += [fmt_time(r.wall), _rate(r.get("tokens_per_s")),
                    f"{r.gflops():.1f}" if r.gflops() else "–", _pct(r.get("frac_of_peak"))]
        if len(thrs) > 1:
            last = _find(res, "gdn_prefill", n, thr=thrs[-1])
            row.append(f"{base.wall / last.wall:.2f}×" if base and last and last.wall > 0
                       else "–")
        rows.append(row)
    L += wrap(f"Prefill: `forward(X)` of one new sequence of N tokens ({_shape(res)}; medians of "
              "the repetitions): time per call, tokens/s, useful GFLOP/s (the three products and "
              "the recurrence's 4·Dk·Dv per value head and token) and their fraction of the FMA "
              "peak of the same threads, measured in the same process. forward() takes no "
              "ParallelOptions: its threads are OpenMP's (the recurrence) and Eigen's (the "
              "products), both set to the count given.")
    L.append("")
    head = ["N"]
    for thr in thrs:
        t = f"{thr} thread" + ("s" if thr != "1" else "")
        head += [f"{t}: time", "tokens/s", "GFLOP/s", "of FMA peak"]
    if len(thrs) > 1:
        head.append(f"speed-up, {thrs[-1]} ÷ {thrs[0]}")
    L += table(head, rows, "r" * len(head))

    # Decode.
    rows = []
    for thr in _threads(res, "gdn_decode"):
        for b in sorted({r.size for r in _runs(res, "gdn_decode", thr=thr)}):
            r = _find(res, "gdn_decode", b, thr=thr)
            ns = r.get("ns_per_token")
            rows.append([str(b), thr, fmt_time(r.wall), fmt_time(ns * 1e-9) if ns else "–",
                         _rate(r.get("tokens_per_s")), fmt_bytes(r.get("state_bytes")),
                         f"{r.get('GBs'):.1f}" if r.get("GBs") else "–",
                         _pct(r.get("frac_of_peak"))])
    wb = next((r.get("weight_bytes") for r in _runs(res, "gdn_decode")), None)
    L += [""] + wrap("Decode: one `step(Xb, batch, Yb, ParallelOptions{threads})` of B sequences "
                     "on `make_batched_state(B)` (B tokens a step; medians of the repetitions): "
                     "time per step and per token, tokens/s, the sequences' states (convolution "
                     "and delta rule), GB/s = (the parameters, " + fmt_bytes(wb) + ", read once a "
                     "step, + each state read and written) ÷ time, and the fraction of the FMA "
                     "peak (useful flops as the prefill's):") + [""]
    L += table(["B", "threads", "step", "per token", "tokens/s", "states", "GB/s",
                "of FMA peak"], rows, "rrrrrrrr")

    # The split of a prefill.
    for n in sorted({r.size for r in _runs(res, "gdn_split")}):
        for thr in _threads(res, "gdn_split"):
            sp = _find(res, "gdn_split", n, thr=thr)
            if sp is None:
                continue
            parts = {p: _find(res, "gdn_part", n, part=p, thr=thr) for p in PARTS}
            layer = sp.get("layer_ms", 0) * 1e-3
            rows = []
            for p in PARTS:
                r = parts[p]
                in_split = sp.get(f"{p}_ms")
                g = r.gflops() if r else None
                rows.append([PART_LABEL[p], fmt_time(r.wall) if r else "–",
                             f"{g:.1f} GFLOP/s, {_pct(r.get('frac_of_peak'))}" if g else "",
                             fmt_time(in_split * 1e-3) if in_split is not None else "–",
                             _pct(in_split * 1e-3 / layer) if in_split is not None and layer
                             else "–"])
            # What the parts leave of the layer, from the median of the per-iteration ratios (a
            # difference of medians can come out negative).
            other = 1.0 - sp.get("parts_vs_layer", 1.0)
            rows.append(["the layer, `forward(X)`", "", "", fmt_time(layer), "100 %"])
            rows.append(["the rest of the layer (checks, allocations, copies)", "", "",
                         fmt_time(other * layer) if other >= 0 else "–", _pct(other)])
            x = sp.get("cgn_vs_proj_rec")
            xs = f"{x:.3f}" if x is not None else "–"
            status, note = at_most_status(x, None, TARGET_CGN)
            if note:
                warn.append(f"Gated DeltaNet prefill: convolution + gates + norm = {xs} × "
                            f"(projections + recurrence) at N = {n}, {thr} thread(s): {note} "
                            f"(target ≤ {TARGET_CGN:.2f})")
            t = f"{thr} thread" + ("s" if thr != "1" else "")
            L += [""] + wrap(
                f"The split of a prefill, N = {fmt_n(n)}, {t}: each part alone (`gdn_part`, a "
                "benchmark of its own on the layer's parameters and the rows of one untimed pass "
                "of the same X; medians of the repetitions; useful GFLOP/s and fraction of the FMA "
                "peak of the products and the recurrence), and all of them with `forward(X)` in "
                f"every one of {sp.iterations} iterations (`gdn_split`, back to back, rotating "
                "which goes first; medians of the per-iteration times, and their share of the "
                "layer's):") + [""]
            L += table(["part", "alone", "", "with the layer", "of the layer"], rows, "lrrrr")
            L += [""] + wrap(
                f"Target, (convolution + gates + norm) ÷ (projections + recurrence) ≤ "
                f"{TARGET_CGN:.2f}: **{xs}**, {status} (median of the per-iteration ratios). "
                f"All that the layer adds beyond its projections and recurrence, (layer − "
                f"projections − recurrence) ÷ (projections + recurrence): "
                f"{sp.get('rest_vs_proj_rec', 0):.3f}; the parts account for "
                f"{sp.get('parts_vs_layer', 0) * 100:.0f} % of the layer's time.")
    return L
