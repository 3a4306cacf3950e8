"""The headline figures of README.md's Performance section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import escape_md, fmt_n, fmt_time, table
from .generation import PAPER_GEN_SPEEDUP, seconds_per_image
from .layouts import pair_ratio, vs_paper
from .machine import cpu_model
from .results import TARGET, contention, frac_of_gemm
from .roofline import frac_of_peak

if TYPE_CHECKING:
    from .results import Results


def headline(res: Results, load_before: str, link: str) -> list[str]:
    """The short table of README.md's Performance section: every figure from these results.
    `link` is how the text refers to the full report (a Markdown link from README.md)."""
    T = TARGET
    ctx = res.context()
    common = sorted(set(res.sizes("mh_linear", **T)) & set(res.sizes("mh_causal", **T)))
    if not common:
        return ["(no multi-head linear results in this run)"]
    n = 16384 if 16384 in common else common[-1]
    lin, cau = res.find("mh_linear", n, **T), res.find("mh_causal", n, **T)
    sm = res.find("mh_softmax", n, alg="tiled", **T)
    csm = res.find("mh_causal_softmax", n, alg="tiled", **T)
    pl = res.find("mh_paper_linear", n, **dict(T, layout="hnd"))
    pc = res.find("mh_paper_causal", n, **dict(T, layout="hnd"))
    rl = res.find("mh_linear", n, **dict(T, layout="row"))
    rc = res.find("mh_causal", n, **dict(T, layout="row"))
    hl = res.find("mh_linear", n, **dict(T, layout="hnd"))
    hc = res.find("mh_causal", n, **dict(T, layout="hnd"))
    fl = res.find("mh_linear", n, **dict(T, form="ret"))
    fc = res.find("mh_causal", n, **dict(T, form="ret"))
    med, _ = contention(res)
    busy = med is not None and med < 0.9

    def t(r):  # wall time, and the cpu time too when other processes held the cores
        return f"{fmt_time(r.wall)} (cpu {fmt_time(r.cpu)})" if busy else fmt_time(r.wall)

    def ratio(a, b):
        plain = f"{a.wall / b.wall:.2f}×"
        return f"{plain} (cpu {a.cpu / b.cpu:.2f}×)" if busy else plain

    def frac(r):
        f, c = frac_of_gemm(res, r), frac_of_gemm(res, r, cpu=True)
        if not f:
            return "–"
        return f"{f:.2f} (cpu {c:.2f})" if busy and c else f"{f:.2f}"

    def of_peak(r):  # nothing without bench_roofline's runs
        x = frac_of_peak(res, r)
        return f", {x:.2f} of this core's measured FMA peak" if x else ""

    def vs_paper(r, b, same, what):
        if not (r and b):
            return f"{what}: not measured in this run"
        txt = (f"{what} on [H, N, D] memory, same run: {t(b)}; paper time ÷ linattn time "
               f"{ratio(b, r)}")
        if same:
            txt += f", or {ratio(b, same)} with linattn on the same [H, N, D] memory: {t(same)}"
        return txt

    def vs_softmax(r, s, what):
        return (f"{s.wall / r.wall:.0f}×" + (f" (cpu {s.cpu / r.cpu:.0f}×)" if busy else "")
                + f" faster than {what}: {t(s)}") if r and s else f"{what} not measured"

    paper = "the paper's"
    rows = [
        ["non-causal linear attention",
         f"{t(lin)}, {frac(lin)} of the throughput of its own GEMMs{of_peak(lin)}; "
         f"{vs_softmax(lin, sm, 'tiled softmax')}; "
         f"{vs_paper(lin, pl, hl, paper + ' non-causal module')}"],
        ["causal linear attention",
         f"{t(cau)}, {frac(cau)} of GEMM throughput (useful flops){of_peak(cau)}; "
         f"{vs_softmax(cau, csm, 'causal tiled softmax')}; "
         f"{vs_paper(cau, pc, hc, paper + ' causal CPU algorithm')}"],
    ]
    if rl and rc:
        pair_l = pair_ratio(res, "mh_layout_pair_linear", n)
        pair_c = pair_ratio(res, "mh_layout_pair_causal", n)
        paired = (f"; call by call (both layouts in each iteration): non-causal {pair_l:.2f}×, "
                  f"causal {pair_c:.2f}×"
                  if pair_l is not None and pair_c is not None else "")
        rows.append(["row-major inputs (N×(H·D) `Map`)",
                     f"non-causal {t(rl)}: {ratio(rl, lin)} the column-major time; "
                     f"causal {t(rc)}: {ratio(rc, cau)}{paired}"])
    if fl and fc:
        rows.append(["returning form (`MatrixXf out = multihead_…(Q, K, V, 8)`)",
                     f"non-causal {t(fl)}: {ratio(fl, lin)} the out-parameter form with a reused "
                     "workspace; "
                     f"causal {t(fc)}: {ratio(fc, cau)}"])
    if sm:
        rows.append(["tiled softmax (the "
                     "baseline)", f"{t(sm)}, {frac(sm)} of the throughput of its GEMMs"])
    dp = dict(dtype="f32", H="8", D="64")
    rec = [res.find("decode_recurrent", p, **dp) for p in res.sizes("decode_recurrent", **dp)]
    rec = [r for r in rec if r]
    smp = [res.find("decode_softmax", p, **dp) for p in res.sizes("decode_softmax", **dp)]
    smp = [r for r in smp if r]
    if rec:
        lo, hi = min(r.wall for r in rec), max(r.wall for r in rec)
        txt = (f"{fmt_time(lo)}–{fmt_time(hi)} per token at every position from "
               f"{fmt_n(rec[0].size)} to "
               f"{fmt_n(rec[-1].size)}" if len(rec) > 1 else f"{fmt_time(lo)} per token at "
                                                             f"position {fmt_n(rec[0].size)}")
        if len(smp) > 1:
            txt += (f" (a softmax KV-cache step: {fmt_time(smp[0].wall)} at {fmt_n(smp[0].size)}, "
                    f"{fmt_time(smp[-1].wall)} at {fmt_n(smp[-1].size)})")
        rows.append(["decode step, 8 heads", txt])
    gen = []
    for m, label in (("img784", "784"), ("img3072", "3072")):
        t = seconds_per_image(res, m, 1)
        if t.get("linear") and t.get("softmax") and t.get("kv"):
            gen.append(f"{label} tokens: {1 / t['linear']:.3g} images/s, "
                       f"{t['softmax'] / t['linear']:.0f}× "
                       f"softmax recomputing its prefix (paper, GPU: {PAPER_GEN_SPEEDUP[m]:.0f}×), "
                       f"{t['kv'] / t['linear']:.1f}× softmax with a KV cache")
    if gen:
        rows.append(["image generation (the paper's §4.2; batch 1, whole decoder)", "; ".join(gen)])
    model = cpu_model()
    isa = ctx.get("linattn_isa", "?")
    intro = (f"One {ctx.get('linattn_profile', '?')} run (`bash .ci/bench`) on {model} ({isa}; "
             f"{ctx.get('num_cpus', '?')} CPUs, load average {load_before} before the run), "
             f"{ctx.get('linattn_compiler', '?')}, `{ctx.get('linattn_cxx_flags', '?')}`; float, "
             "one thread, "
             "8 heads, D = M = 64; linattn on column-major packed N×(H·D) matrices unless stated. "
             "Every figure and ratio below was measured in that run "
             f"(generated by `benchmarks/report.py`; all tables in {link})" +
             (f"; the machine was busy (median cpu/wall time of the single-thread runs {med:.2f}), "
              "so wall "
              "times are inflated and cpu times are given too" if busy else "") + ":")
    return [intro, ""] + table(["", f"N = {n}"], [[a, escape_md(b)] for a, b in rows], "ll")
