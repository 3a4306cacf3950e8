"""The tables the layer benchmarks (bench_gdn_layer, bench_kda_layer: layer_bench_common.hpp) share:
prefill and decode tokens/s and the time split of a prefill, for the kinds <prefix>_prefill,
<prefix>_decode, <prefix>_part and <prefix>_split. gdn_layer.py and kda_layer.py give the words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .fmt import at_most_status, fmt_bytes, fmt_n, fmt_time, table, wrap

if TYPE_CHECKING:
    from .results import Results, Run


def runs(res: Results, kind: str, **params) -> list[Run]:
    return [r for r in res.runs if r.kind == kind
            and all(r.params.get(k) == v for k, v in params.items())]


def find(res: Results, kind: str, size: int, **params) -> Run | None:
    return next((r for r in runs(res, kind, **params) if r.size == size), None)


def threads(res: Results, kind: str) -> list[str]:
    return sorted({r.params["thr"] for r in runs(res, kind)}, key=int)


def pct(x: float | None) -> str:
    return f"{x * 100:.0f} %" if x is not None else "–"


def rate(x: float | None) -> str:
    if not x:
        return "–"
    return f"{x / 1e3:.1f} k" if x >= 1e4 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def prefill_table(res: Results, kind: str, intro: str) -> list[str]:
    """One row per N, the thread counts side by side, after the paragraph `intro`."""
    thrs = threads(res, kind)
    rows = []
    for n in sorted({r.size for r in runs(res, kind)}):
        row = [fmt_n(n)]
        base = None
        for thr in thrs:
            r = find(res, kind, n, thr=thr)
            if r is None:
                row += ["–"] * 4
                continue
            base = base or r
            row += [fmt_time(r.wall), rate(r.get("tokens_per_s")),
                    f"{r.gflops():.1f}" if r.gflops() else "–", pct(r.get("frac_of_peak"))]
        if len(thrs) > 1:
            last = find(res, kind, n, thr=thrs[-1])
            row.append(f"{base.wall / last.wall:.2f}×" if base and last and last.wall > 0
                       else "–")
        rows.append(row)
    L = wrap(intro)
    L.append("")
    head = ["N"]
    for thr in thrs:
        t = f"{thr} thread" + ("s" if thr != "1" else "")
        head += [f"{t}: time", "tokens/s", "GFLOP/s", "of FMA peak"]
    if len(thrs) > 1:
        head.append(f"speed-up, {thrs[-1]} ÷ {thrs[0]}")
    return L + table(head, rows, "r" * len(head))


def decode_table(res: Results, kind: str) -> list[str]:
    """One row per (threads, B), after the paragraph that says what is measured."""
    rows = []
    for thr in threads(res, kind):
        for b in sorted({r.size for r in runs(res, kind, thr=thr)}):
            r = find(res, kind, b, thr=thr)
            ns = r.get("ns_per_token")
            rows.append([str(b), thr, fmt_time(r.wall), fmt_time(ns * 1e-9) if ns else "–",
                         rate(r.get("tokens_per_s")), fmt_bytes(r.get("state_bytes")),
                         f"{r.get('GBs'):.1f}" if r.get("GBs") else "–",
                         pct(r.get("frac_of_peak"))])
    wb = next((r.get("weight_bytes") for r in runs(res, kind)), None)
    L = wrap("Decode: one `step(Xb, batch, Yb, ParallelOptions{threads})` of B sequences "
             "on `make_batched_state(B)` (B tokens a step; medians of the repetitions): "
             "time per step and per token, tokens/s, the sequences' states (convolution "
             "and delta rule), GB/s = (the parameters, " + fmt_bytes(wb) + ", read once a "
             "step, + each state read and written) ÷ time, and the fraction of the FMA "
             "peak (useful flops as the prefill's):") + [""]
    return L + table(["B", "threads", "step", "per token", "tokens/s", "states", "GB/s",
                      "of FMA peak"], rows, "rrrrrrrr")


@dataclass
class Split:
    """The words of a layer's split: its kinds' prefix, its parts and their labels, the layer's
    name in warnings, the target on (convolution + gates + norm) ÷ `base`, and how the base's
    parts are called in the text (`base`: "projections + recurrence", `minus`: the same
    subtracted, "projections − recurrence")."""
    prefix: str
    parts: tuple[str, ...]
    labels: dict[str, str]
    name: str
    target: float
    base: str = "projections + recurrence"
    minus: str = "projections − recurrence"
    beyond: str = "its projections and recurrence"
    flops_of: str = "the products and the recurrence"


def split_tables(res: Results, sp_words: Split, warn: list[str]) -> list[str]:
    """For every N and thread count of <prefix>_split: the parts alone and with the layer."""
    part_kind, split_kind = f"{sp_words.prefix}_part", f"{sp_words.prefix}_split"
    target = sp_words.target
    L: list[str] = []
    for n in sorted({r.size for r in runs(res, split_kind)}):
        for thr in threads(res, split_kind):
            sp = find(res, split_kind, n, thr=thr)
            if sp is None:
                continue
            parts = {p: find(res, part_kind, n, part=p, thr=thr) for p in sp_words.parts}
            layer = sp.get("layer_ms", 0) * 1e-3
            rows = []
            for p in sp_words.parts:
                r = parts[p]
                in_split = sp.get(f"{p}_ms")
                g = r.gflops() if r else None
                rows.append([sp_words.labels[p], fmt_time(r.wall) if r else "–",
                             f"{g:.1f} GFLOP/s, {pct(r.get('frac_of_peak'))}" if g else "",
                             fmt_time(in_split * 1e-3) if in_split is not None else "–",
                             pct(in_split * 1e-3 / layer) if in_split is not None and layer
                             else "–"])
            # What the parts leave of the layer, from the median of the per-iteration ratios (a
            # difference of medians can come out negative).
            other = 1.0 - sp.get("parts_vs_layer", 1.0)
            rows.append(["the layer, `forward(X)`", "", "", fmt_time(layer), "100 %"])
            rows.append(["the rest of the layer (checks, allocations, copies)", "", "",
                         fmt_time(other * layer) if other >= 0 else "–", pct(other)])
            x = sp.get("cgn_vs_proj_rec")
            xs = f"{x:.3f}" if x is not None else "–"
            status, note = at_most_status(x, None, target)
            if note:
                warn.append(f"{sp_words.name} prefill: convolution + gates + norm = {xs} × "
                            f"({sp_words.base}) at N = {n}, {thr} thread(s): {note} "
                            f"(target ≤ {target:.2f})")
            t = f"{thr} thread" + ("s" if thr != "1" else "")
            L += [""] + wrap(
                f"The split of a prefill, N = {fmt_n(n)}, {t}: each part alone (`{part_kind}`, a "
                "benchmark of its own on the layer's parameters and the rows of one untimed pass "
                "of the same X; medians of the repetitions; useful GFLOP/s and fraction of the FMA "
                f"peak of {sp_words.flops_of}), and all of them with `forward(X)` in "
                f"every one of {sp.iterations} iterations (`{split_kind}`, back to back, rotating "
                "which goes first; medians of the per-iteration times, and their share of the "
                "layer's):") + [""]
            L += table(["part", "alone", "", "with the layer", "of the layer"], rows, "lrrrr")
            L += [""] + wrap(
                f"Target, (convolution + gates + norm) ÷ ({sp_words.base}) ≤ "
                f"{target:.2f}: **{xs}**, {status} (median of the per-iteration ratios). "
                f"All that the layer adds beyond {sp_words.beyond}, (layer − "
                f"{sp_words.minus}) ÷ ({sp_words.base}): "
                f"{sp.get('rest_vs_proj_rec', 0):.3f}; the parts account for "
                f"{sp.get('parts_vs_layer', 0) * 100:.0f} % of the layer's time.")
    return L
