"""Layouts and call forms (bench_multihead): row-major vs column-major, returning vs
out-parameter forms, and the paper's CPU algorithm on the same memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import fmt_n, fmt_time, speedup, table
from .results import LAYOUT_LABEL, TARGET, large_sizes
from .roofline import fmt_frac_peak

if TYPE_CHECKING:
    from .results import Results


# Targets of the ratios of tables 8 and 9 (reported, never enforced here).
TARGET_ROW_VS_COL = 1.10
TARGET_RET_VS_OUT = 1.25
PAIR_KINDS = (("mh_layout_pair_linear", {"phi": "elu"}, "multi-head non-causal"),
              ("mh_layout_pair_causal", {"phi": "elu", "alg": "auto"}, "multi-head causal"))


def pair_table(res: Results, warn: list[str]) -> list[str]:
    """Row-major ÷ column-major from the paired benchmarks (counter row_vs_col), per N; a ratio
    above
    TARGET_ROW_VS_COL at the largest N makes a warning."""
    rows = []
    for kind, p, label in PAIR_KINDS:
        q = dict(TARGET, **p)
        ns = res.sizes(kind, **q)
        if not ns:
            continue
        cells = []
        for n in ns:
            r = res.find(kind, n, **q)
            cells.append(f"N = {fmt_n(n)}: {r.get('row_vs_col', float('nan')):.2f} "
                         f"({fmt_time(r.get('row_ms', 0) * 1e-3)} vs "
                         f"{fmt_time(r.get('col_ms', 0) * 1e-3)}, "
                         f"{r.iterations} pairs)")
        last = res.find(kind, ns[-1], **q)
        x = last.get("row_vs_col", float("nan"))
        rows.append([label, "; ".join(cells)])
        if not x <= TARGET_ROW_VS_COL:
            warn.append(f"{label}, row-major call by call: {x:.2f} at N = {ns[-1]}, above the "
                        "target "
                        f"{TARGET_ROW_VS_COL:.2f}")
    if not rows:
        return ["(no mh_layout_pair_* runs in these results)"]
    return table(["", "row-major ÷ column-major, median of the pairs (median times)"], rows, "ll")


def pair_ratio(res: Results, kind: str, n: int) -> float | None:
    """row_vs_col of the paired benchmark `kind` at N = n, if it ran."""
    for k, p, _ in PAIR_KINDS:
        if k == kind:
            r = res.find(kind, n, **dict(TARGET, **p))
            return r.get("row_vs_col") if r else None
    return None


def ratio_table(res: Results, specs: list[tuple], target: float, warn: list[str]) -> list[str]:
    """Rows (label, kind, params of the variant, params of the reference): time ratios per
    N ≥ 1024, wall (cpu). A ratio above `target` at the largest N in both wall and cpu time makes
    a warning."""
    ns = large_sizes(sorted({n for _, kind, a, _ in specs for n in res.sizes(kind, **a)}))
    rows = []
    for label, kind, a, b in specs:
        cells, last = [], None
        for n in ns:
            x, y = res.find(kind, n, **a), res.find(kind, n, **b)
            if x and y and y.wall > 0 and y.cpu > 0:
                w, c = x.wall / y.wall, x.cpu / y.cpu
                cells.append(f"{w:.2f} ({c:.2f})")
                last = (n, w, c, x, y)
            else:
                cells.append("–")
        if last is None:
            continue
        n, w, c, x, y = last
        rows.append([label] + cells + [f"{fmt_time(x.wall)} vs {fmt_time(y.wall)}",
                                       f"{fmt_frac_peak(res, x)} / {fmt_frac_peak(res, y)}"])
        if w > target and c > target:
            warn.append(f"{label}: {w:.2f} (cpu {c:.2f}) at N = {n}, above the target {target:.2f}")
    if not rows:
        return ["(not measured in these results)"]
    return table(["", *[f"N = {fmt_n(n)}" for n in ns], "largest N (wall)",
                  "frac_of_peak, largest N: variant / reference"], rows, "l" + "r" * (len(ns) + 2))


def vs_paper(res: Results) -> list[str]:
    """Section 8: linattn against the paper's CPU algorithm, same run."""
    L: list[str] = []
    T = TARGET
    L.append("The baseline is described under *What is measured*; linattn is timed on the same [H, "
             "N, D] memory "
             "(one call per head) and on its column-major packed layout.")
    L.append("")
    rows = []
    for label, pk, lk in (("causal", "mh_paper_causal", "mh_causal"),
                          ("non-causal", "mh_paper_linear", "mh_linear")):
        for n in large_sizes(res.sizes(pk, layout="hnd", **T)):
            b = res.find(pk, n, layout="hnd", **T)
            same = res.find(lk, n, **dict(T, layout="hnd"))
            col = res.find(lk, n, **T)
            rows.append([label, fmt_n(n), fmt_time(b.wall), fmt_time(b.cpu),
                         fmt_time(same.wall if same else None), speedup(b, same),
                         fmt_time(col.wall if col else None), speedup(b, col),
                         " / ".join(fmt_frac_peak(res, x) for x in (b, same, col))])
    if rows:
        L += table(["", "N", "paper (wall)", "paper (cpu)", "linattn, same [H, N, D] memory (wall)",
                    "speed-up wall "
                    "(cpu)", "linattn, column-major packed (wall)", "speed-up wall (cpu)",
                    "frac_of_peak: paper / same memory / packed"], rows, "llrrrrrrr")
    else:
        L.append("(no mh_paper_* runs in these results)")
    return L


def row_vs_col(res: Results, warn: list[str]) -> list[str]:
    """Section 9: row-major against column-major inputs."""
    L: list[str] = []
    T = TARGET
    specs = []
    for kind, p, name in (("mh_linear", {}, "multi-head "
                                            "non-causal"), ("mh_causal", {}, "multi-head causal")):
        for lay in ("row", "hnd", "hnd_batched"):
            specs.append((f"{name}, {LAYOUT_LABEL[lay]}", kind, dict(T, **p, layout=lay),
                          dict(T, **p)))
    sh = dict(phi="elu", dtype="f32", D="64")
    specs.append(("single head non-causal, row-major N×D "
                  "(Map)", "linear", dict(sh, layout="row"), sh))
    specs.append(("single head causal (Auto), row-major N×D "
                  "(Map)", "causal", dict(sh, alg="auto", layout="row"),
                  dict(sh, alg="auto")))
    L += ratio_table(res, specs, TARGET_ROW_VS_COL, warn)
    L += ["", "The same comparison call by call (`mh_layout_pair_*`: every iteration makes both "
              "calls back to "
          "back, alternating which goes first, so that the drift of the machine during the run "
          "falls on both; "
          "median of the per-iteration ratios). This is the figure checked against the target; the "
          "table above "
          "divides the times of two benchmarks run minutes apart.", ""]
    L += pair_table(res, warn)
    return L


def returning_vs_out(res: Results, warn: list[str]) -> list[str]:
    """Section 10: the returning form against the out-parameter form."""
    L: list[str] = []
    T = TARGET
    sh = dict(phi="elu", dtype="f32", D="64")
    specs = []
    for kind, p, name in (("mh_linear", {}, "multihead_linear_attention"),
                          ("mh_causal", {}, "multihead_causal_linear_attention"),
                          ("mh_softmax", {"alg": "tiled"}, "multihead_softmax_attention"),
                          ("mh_causal_softmax", {"alg": "tiled"},
                           "multihead_causal_softmax_attention")):
        specs.append((f"{name} (8 heads)", kind, dict(T, **p, form="ret"), dict(T, **p)))
    specs.append(("linear_attention (single head)", "linear", dict(sh, form="ret"), sh))
    specs.append(("causal_linear_attention (single "
                  "head)", "causal", dict(sh, alg="auto", form="ret"),
                  dict(sh, alg="auto")))
    L += ratio_table(res, specs, TARGET_RET_VS_OUT, warn)
    return L
