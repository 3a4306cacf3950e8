"""The headline figures of README.md's Performance section.

headline_figures reads them from the results and render_headline writes them, so that the
wording and layout of the block depend on nothing but the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .fmt import fmt_n, fmt_time, table, wrap
from .generation import PAPER_GEN_SPEEDUP, seconds_per_image
from .layouts import pair_ratio
from .machine import cpu_model
from .results import TARGET, contention, frac_of_gemm
from .roofline import frac_of_peak

if TYPE_CHECKING:
    from .results import Results, Run


@dataclass
class Val:
    """One figure: from wall time, and from cpu time (None when the machine was idle)."""
    wall: float | None = None
    cpu: float | None = None


@dataclass
class Form:
    """The figures of one causality of multi-head linear attention at the headline's N."""
    time: Val = field(default_factory=Val)
    of_gemm: Val = field(default_factory=Val)  # throughput ÷ that of its own GEMMs
    of_peak: Val = field(default_factory=Val)  # useful GFLOP/s ÷ this core's FMA peak
    softmax: Val = field(default_factory=Val)  # the tiled softmax of the same causality
    vs_softmax: Val = field(default_factory=Val)  # its time ÷ linattn's
    paper: Val = field(default_factory=Val)  # the paper's code on [H, N, D] memory
    vs_paper: Val = field(default_factory=Val)  # its time ÷ linattn's
    hnd: Val = field(default_factory=Val)  # linattn on the paper's [H, N, D] memory
    vs_paper_hnd: Val = field(default_factory=Val)  # the paper's time ÷ that
    row: Val = field(default_factory=Val)  # row-major N×(H·D) inputs
    row_vs_col: Val = field(default_factory=Val)
    row_vs_col_paired: float | None = None  # both layouts in each iteration
    ret: Val = field(default_factory=Val)  # the returning form
    ret_vs_out: Val = field(default_factory=Val)


@dataclass
class Headline:
    n: int = 0
    # profile, cpu, isa, cpus, load, compiler, flags: the run, for the lead paragraph.
    run: dict[str, str] = field(default_factory=dict)
    busy: float | None = None  # median cpu/wall of the single-thread runs when below 0.9
    forms: dict[str, Form] = field(default_factory=dict)  # "non-causal", "causal"
    softmax_of_gemm: Val = field(default_factory=Val)  # the non-causal tiled softmax
    decode: list[tuple[int, float]] = field(default_factory=list)  # (position, s per token)
    decode_softmax: list[tuple[int, float]] = field(default_factory=list)  # KV-cache steps
    # (label, images/s, recompute ÷ linear, the paper's figure, KV cache ÷ linear), batch 1.
    gen: list[tuple[str, float, float, float, float]] = field(default_factory=list)


def headline_figures(res: Results, load_before: str) -> Headline | None:
    """Every figure of the headline block from these results; None without multi-head runs."""
    T = TARGET
    common = sorted(set(res.sizes("mh_linear", **T)) & set(res.sizes("mh_causal", **T)))
    if not common:
        return None
    n = 16384 if 16384 in common else common[-1]
    med, _ = contention(res)
    busy = med is not None and med < 0.9
    ctx = res.context()
    h = Headline(n=n, busy=med if busy else None)
    h.run = dict(profile=ctx.get("linattn_profile", "?"), cpu=cpu_model(),
                 isa=ctx.get("linattn_isa", "?"), cpus=str(ctx.get("num_cpus", "?")),
                 load=load_before, compiler=ctx.get("linattn_compiler", "?"),
                 flags=ctx.get("linattn_cxx_flags", "?"))

    def find(kind, **p):
        return res.find(kind, n, **dict(T, **p))

    def time(r: Run | None) -> Val:
        return Val(r.wall, r.cpu if busy else None) if r else Val()

    def ratio(a: Run | None, b: Run | None) -> Val:
        if not (a and b):
            return Val()
        return Val(a.wall / b.wall, a.cpu / b.cpu if busy else None)

    def of(fn, r: Run | None) -> Val:
        return Val(fn(res, r), fn(res, r, cpu=True) if busy else None) if r else Val()

    for name, kind, sm_kind, paper_kind, pair_kind in (
            ("non-causal", "mh_linear", "mh_softmax", "mh_paper_linear", "mh_layout_pair_linear"),
            ("causal", "mh_causal", "mh_causal_softmax", "mh_paper_causal",
             "mh_layout_pair_causal")):
        r = find(kind)
        sm, paper = find(sm_kind, alg="tiled"), find(paper_kind, layout="hnd")
        hnd, row, ret = find(kind, layout="hnd"), find(kind, layout="row"), find(kind, form="ret")
        f = Form(time=time(r), of_gemm=of(frac_of_gemm, r), of_peak=of(frac_of_peak, r),
                 softmax=time(sm), vs_softmax=ratio(sm, r), paper=time(paper),
                 vs_paper=ratio(paper, r))
        if hnd and paper:
            f.hnd, f.vs_paper_hnd = time(hnd), ratio(paper, hnd)
        f.row, f.row_vs_col = time(row), ratio(row, r)
        f.row_vs_col_paired = pair_ratio(res, pair_kind, n) if row else None
        f.ret, f.ret_vs_out = time(ret), ratio(ret, r)
        h.forms[name] = f
    sm = find("mh_softmax", alg="tiled")
    h.softmax_of_gemm = of(frac_of_gemm, sm)
    dp = dict(dtype="f32", H="8", D="64")
    for kind, out in (("decode_recurrent", h.decode), ("decode_softmax", h.decode_softmax)):
        runs = [res.find(kind, p, **dp) for p in res.sizes(kind, **dp)]
        out += [(r.size, r.wall) for r in runs if r]
    for m, label in (("img784", "784 tokens"), ("img3072", "3072 tokens")):
        t = seconds_per_image(res, m, 1)
        if t.get("linear") and t.get("softmax") and t.get("kv"):
            h.gen.append((label, 1 / t["linear"], t["softmax"] / t["linear"],
                          PAPER_GEN_SPEEDUP[m], t["kv"] / t["linear"]))
    return h


def render_headline(h: Headline | None, link: str) -> list[str]:
    """The block of README.md's Performance section (and of docs/benchmarks.md). `link` is how
    the text refers to the full report (a Markdown link from README.md)."""
    if h is None:
        return ["(no multi-head linear results in this run)"]
    busy = h.busy is not None

    def cell(v: Val, fmt, cpu: bool = False) -> str:
        x = v.cpu if cpu else v.wall
        return fmt(x) if x is not None else "–"

    def t(x):
        return fmt_time(x)

    def x2(x):
        return f"{x:.2f}×"

    def x0(x):
        return f"{x:.0f}×"

    def f2(x):
        return f"{x:.2f}" if x else "–"

    def both(v: Val, fmt) -> str:  # the wall figure, and the cpu one beside it on a busy machine
        s = cell(v, fmt)
        return f"{s} (cpu {cell(v, fmt, True)})" if busy and v.cpu is not None else s

    r = h.run
    intro = (f"One {r['profile']} run (`bash .ci/bench`) on {r['cpu']} ({r['isa']}; {r['cpus']} "
             f"CPUs, load average {r['load']} before the run), {r['compiler']}, `{r['flags']}`; "
             "float, one thread, 8 heads, D = M = 64; linattn on column-major packed N×(H·D) "
             "matrices unless stated. Every figure and ratio below was measured in that run "
             f"(generated by `benchmarks/report.py`; all tables in {link})" +
             (f"; the machine was busy (median cpu/wall time of the single-thread runs "
              f"{h.busy:.2f}), so wall times are inflated and cpu times are given too (rows "
              "marked cpu, or in brackets)"
              if busy else "") + ":")
    L = wrap(intro) + [""]

    # The kernels: one row per causality (a second one from cpu times on a busy machine).
    rows = []
    for name, f in h.forms.items():
        for cpu in ((False, True) if busy else (False,)):
            rows.append([f"{name} linear" + (", cpu" if cpu else ""), cell(f.time, t, cpu),
                         cell(f.of_gemm, f2, cpu), cell(f.of_peak, f2, cpu),
                         cell(f.softmax, t, cpu), cell(f.vs_softmax, x0, cpu),
                         cell(f.paper, t, cpu), cell(f.vs_paper, x2, cpu)])
    sm = h.forms["non-causal"].softmax
    if sm.wall is not None:
        for cpu in ((False, True) if busy else (False,)):
            rows.append(["tiled softmax" + (", cpu" if cpu else ""), cell(sm, t, cpu),
                         cell(h.softmax_of_gemm, f2, cpu)] + ["–"] * 5)
    L += table([f"N = {h.n}", "time", "× own GEMMs", "× FMA peak", "tiled softmax",
                "vs softmax", "paper's code", "vs paper"], rows, "lrrrrrrr")
    L += [""] + wrap(
        "× own GEMMs: throughput against the Eigen GEMMs of the same shapes (causal: useful "
        "flops); × FMA peak: against this core's measured FMA peak. Tiled softmax is linattn's "
        "baseline of the same causality, the paper's code its non-causal module and causal CPU "
        "algorithm on [H, N, D] memory, same run; vs: their time ÷ linattn's.")

    # The same kernels on other inputs and in the returning form.
    nc, c = h.forms["non-causal"], h.forms["causal"]
    rows = []
    if nc.hnd.wall is not None or c.hnd.wall is not None:
        rows += [["linattn on [H, N, D] memory", both(nc.hnd, t), both(c.hnd, t)],
                 ["paper's code ÷ that", both(nc.vs_paper_hnd, x2), both(c.vs_paper_hnd, x2)]]
    if nc.row.wall is not None and c.row.wall is not None:
        rows += [["row-major N×(H·D) `Map`", both(nc.row, t), both(c.row, t)],
                 ["÷ column-major", both(nc.row_vs_col, x2), both(c.row_vs_col, x2)]]
        if nc.row_vs_col_paired is not None and c.row_vs_col_paired is not None:
            rows.append(["÷ column-major, call by call", x2(nc.row_vs_col_paired),
                         x2(c.row_vs_col_paired)])
    if nc.ret.wall is not None and c.ret.wall is not None:
        rows += [["returning form", both(nc.ret, t), both(c.ret, t)],
                 ["÷ out-parameter form", both(nc.ret_vs_out, x2), both(c.ret_vs_out, x2)]]
    if rows:
        L += [""] + table([f"N = {h.n}", "non-causal", "causal"], rows, "lrr")
        L += [""] + wrap(
            "Call by call: both layouts timed in each iteration. The returning form is "
            "`MatrixXf out = multihead_…(Q, K, V, 8)`, against the out-parameter form with a "
            "reused workspace.")

    if h.decode:
        (p0, _), (p1, _) = h.decode[0], h.decode[-1]
        lo, hi = min(s for _, s in h.decode), max(s for _, s in h.decode)
        txt = (f"A decode step of 8 heads takes {fmt_time(lo)}–{fmt_time(hi)} per token at every "
               f"position from {fmt_n(p0)} to {fmt_n(p1)}" if len(h.decode) > 1 else
               f"A decode step of 8 heads takes {fmt_time(lo)} per token at position {fmt_n(p0)}")
        if len(h.decode_softmax) > 1:
            (q0, s0), (q1, s1) = h.decode_softmax[0], h.decode_softmax[-1]
            txt += (f"; a softmax KV-cache step takes {fmt_time(s0)} at {fmt_n(q0)} and "
                    f"{fmt_time(s1)} at {fmt_n(q1)}")
        L += [""] + wrap(txt + ".")
    if h.gen:
        L += [""] + wrap(
            "Image generation (the paper's §4.2; batch 1, the whole decoder): images per second "
            "with linear attention, and how many times faster that is than softmax recomputing "
            "its prefix (the paper's figure, on a GPU, beside it) and than softmax with a KV "
            "cache:") + [""]
        L += table(["model", "images/s", "vs recompute", "paper (GPU)", "vs KV cache"],
                   [[label, f"{ips:.3g}", f"{vs_sm:.0f}×", f"{paper:.0f}×", f"{vs_kv:.1f}×"]
                    for label, ips, vs_sm, paper, vs_kv in h.gen], "lrrrr")
    return L


def headline(res: Results, load_before: str, link: str) -> list[str]:
    """The short tables of README.md's Performance section: every figure from these results."""
    return render_headline(headline_figures(res, load_before), link)
