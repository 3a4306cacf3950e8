"""The kernels' place under the roofline: fractions of the peak and of the bandwidth, the
roofline tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import escape_md, fmt_bytes, fmt_n, fmt_ratio, table
from .results import TARGET, gt_find
from .roof import CACHE_LEVELS, LEVEL_LABEL, ROOF_LEVELS

if TYPE_CHECKING:
    from .results import Results, Run
    from .roof import Roofline


# The roofline table and plot: the configuration of the targets, one thread.
ROOF_N = 16384
ROOF_BATCHES = (1, 64)


def frac_of_peak(res: Results, r: Run | None, cpu: bool = False) -> float | None:
    """Useful GFLOP/s of `r` ÷ the FMA peak of its scalar type (× its threads), same results
    directory; None without a roofline or flops."""
    if r is None:
        return None
    p = res.roof.gflops(r.params.get("dtype", "f32"), cpu)
    g = r.gflops(cpu)
    thr = int(r.params.get("thr", "1") or 1)
    return g / (p * thr) if g and p else None


def fmt_frac_peak(res: Results, r: Run | None, pct: bool = False) -> str:
    x = frac_of_peak(res, r)
    if x is None:
        return "–"
    return f"{x * 100:.0f} %" if pct else f"{x:.2f}"


# Bytes a recurrent decode step moves, per byte of its state (state_bytes: S and z with their low
# parts, the compensated sums): detail::recurrent_update_and_read reads S, S_lo, z and z_lo and
# writes S_lo and z_lo back (the fold into S every kFoldTokens = 128 steps is not counted), so
# 3·(F·M + F) floats a head against 2·(F·M + F) kept. The token's q, k, v and output
# (4·(D + M) floats a head, 1.5 % at D = M = 64) are not counted either.
DECODE_TRAFFIC = 1.5


def decode_bw(res: Results, r: Run | None, softmax: bool = False) -> tuple[float | None, str]:
    """(frac_of_bw, level) of a decode step (one iteration of `r`): bytes moved ÷ wall time ÷ the
    bandwidth of the level its state lives in. Recurrent: DECODE_TRAFFIC × state_bytes at the
    read + write bandwidth; softmax: its KV cache (state_bytes) read once. The level is decided
    by the state's bytes per thread for L1 and L2, by all of them for the shared L3 (level_of); a
    cache level's bandwidth counts once per thread (L1 and L2 are private, and each core reads the
    L3 at its own rate: one core's measurement), memory's once (the bus is shared)."""
    if r is None or not r.get("state_bytes"):
        return None, ""
    thr = int(r.params.get("thr", "1") or 1)
    state = float(r.get("state_bytes"))
    level = res.roof.level_of(state, thr)
    bw = res.roof.bandwidth(level, rw=not softmax)
    if not bw or r.wall <= 0:
        return None, level
    if level != "mem":
        bw *= thr
    moved = state if softmax else DECODE_TRAFFIC * state
    return moved / r.wall / bw, level


def cache_levels_text(roof: "Roofline") -> str:
    """'L1 48.0 KiB, L2 1.0 MiB and L3 32.0 MiB (assumed …)': the sizes that place a working set."""
    c = roof.cache_bytes
    parts = [f"{lv} {fmt_bytes(c[lv])}" for lv in CACHE_LEVELS if c.get(lv)]
    return (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)) + \
        f" ({roof.cache_source})"


def rw_fallback_text(roof: "Roofline") -> str:
    """' (L3, memory: the read bandwidth, no read + write measured there)', or ''."""
    fb = roof.rw_fallback()
    return (f" ({', '.join(LEVEL_LABEL[lv] for lv in fb)}: the read bandwidth, no read + write "
            "measured there)"
            if fb else "")


def decode_bw_note(res: Results) -> str:
    """What the frac_of_bw columns of the decode-step tables assume."""
    roof = res.roof
    no_l3 = " (no L3 bandwidth in these results: a step whose states live in L3 shows –)" \
        if roof and roof.cache_bytes.get("L3") and "L3" not in roof.read else ""
    return ("frac_of_bw = bytes a step moves ÷ its wall time ÷ the bandwidth (`bench_roofline`) of "
            "the level the "
            "states live in, named in parentheses. The recurrent step reads S, z and their "
            "compensated low parts and "
            f"writes the low parts back ({DECODE_TRAFFIC:g} × the state kept; the token's q, k, v "
            "and output are not "
            "counted), against the read + write bandwidth of that "
            "level" + rw_fallback_text(roof) + "; the softmax "
            "step reads its KV cache once, against the read bandwidth. The level: the first cache "
            "the states fit, "
            f"{cache_levels_text(roof)}, else memory; the states' bytes per thread against the "
            "private L1 and L2, "
            "all threads' states against the shared "
            "L3" + no_l3 + ". With several threads a cache level's bandwidth "
            "counts once per thread (L1 and L2 are private; each core reads the L3 at its own "
            "rate, though the "
            "cores of a CCD share its capacity and other processes' data competes for it), "
            "memory's once (the bus "
            "is shared)." + ("" if roof else " No bench_roofline runs in these results: the "
                                             "columns show –."))


def fmt_bw_frac(x: tuple[float | None, str]) -> str:
    f, level = x
    return "–" if f is None else f"{f:.2f} ({LEVEL_LABEL.get(level, level)})"


# The kernels of the roofline table: label, cost (kernel_cost) and how the measured run is found.
ROOF_KERNELS = (
    ("non-causal forward", "fwd", "mh_linear"),
    ("causal forward (Auto)", "fwd", "mh_causal"),
    ("non-causal backward", "bwd", "mh_train_linear"),
    ("causal backward", "bwd", "mh_train_causal"),
    ("decode step, B = 1", "decode", "serve_batched"),
    ("decode step, B = 64", "decode", "serve_batched"),
)


def kernel_cost(cost: str, D: int, M: int, scalar_bytes: int = 4) -> tuple[float, float]:
    """(useful flops, bytes) per token and head, F = D (EluPlusOne). Flops as the benchmarks count
    them: 4·F·M for a forward (2 for the key's update of S, 2 for the query's read), 8·F·M for a
    backward (bench_backward: R = φ(Q)ᵀ Ĝ, Ĝ Sᵀ, φ(K) R, V Rᵀ), 4·F·M for a decode step. Bytes: the
    compulsory traffic of a sequence (the F×M state stays in cache): a forward reads q, k, v and
    writes its output; a backward reads q, k, v, dOut and writes dQ, dK, dV; a decode step moves
    its state (DECODE_TRAFFIC × S and z with their low parts)."""
    F = D
    if cost == "fwd":
        return 4.0 * F * M, scalar_bytes * (2.0 * D + 2.0 * M)
    if cost == "bwd":
        return 8.0 * F * M, scalar_bytes * (4.0 * D + 3.0 * M)
    return 4.0 * F * M, DECODE_TRAFFIC * scalar_bytes * 2.0 * (F * M + F)


def roof_working_set(cost: str, D: int, M: int, n: int, heads: int = 8) -> tuple[float, bool]:
    """(bytes, read + write?) of the data a kernel streams: n tokens × heads for a sequence (its
    inputs and outputs, read-dominated: the read bandwidth), the n = B sequences' states for a
    decode
    step (updated in place: the read + write bandwidth)."""
    if cost == "decode":
        return n * heads * 4.0 * 2.0 * (D * M + D), True
    return n * heads * kernel_cost(cost, D, M)[1], False


def roof_run(res: Results, label: str, kind: str, D: int, layout: str = "col") -> Run | None:
    """The measured run of a roofline kernel: H = 8, float, 1 thread, N = ROOF_N (or the largest N
    measured) and, for the decode step, B from its label."""
    q = dict(TARGET, D=str(D), layout=layout)
    if kind == "serve_batched":
        b = int(label.rsplit("= ", 1)[1])
        return res.find(kind, b, **dict(q, phi="elu"))
    if kind.startswith("mh_train"):
        q = dict(q, **{"pass": "bwd"})
    ns = res.sizes(kind, **q)
    if not ns and kind == "mh_causal":  # D = M = 128: bench_gated's plain causal reference
        ns = res.sizes("gt_causal", **q, phi="elu", alg="auto")
        n = ROOF_N if ROOF_N in ns else (ns[-1] if ns else None)
        return gt_find(res, "gt_causal", n, **q, phi="elu", alg="auto") if n else None
    if not ns:
        return None
    return res.find(kind, ROOF_N if ROOF_N in ns else ns[-1], **q)


DTYPE_LABEL = {"f32": "float", "f64": "double"}


def roofline_limits(res: Results) -> list[str]:
    """The table of bench_roofline's measurements and the ridge points."""
    roof = res.roof
    used = {id(roof.peak_run(dt)) for dt in ("f32", "f64") if roof.peak_run(dt)}
    fma = [(f"FMA peak, {DTYPE_LABEL[dt]} "
            f"(`roofline_fma_peak_{dt}`)", roof.peak[dt]) for dt in ("f32", "f64")
           if dt in roof.peak]
    fma += [(f"FMA, {DTYPE_LABEL.get(dt, dt)}, {isa}", r) for (dt, isa), r in
            sorted(roof.isa.items(),
                   key=lambda kv: (kv[0][0], -float(kv[1].get("vector_bits", 0))))]
    rows = []
    for what, r in fma:
        g = f"{fmt_ratio(r.gflops(), 1)} GFLOP/s"
        rows.append([f"**{what}**" if id(r) in used else what, f"**{g}**" if id(r) in used else g,
                     f"{fmt_ratio(r.gflops(cpu=True), 1)} GFLOP/s", escape_md(r.label)])
    for what, src, rw in (("read", roof.read, False), ("read + write", roof.rw, True)):
        for lv in ROOF_LEVELS:
            r = src.get(lv)
            if r:
                bw, bw_cpu = roof.bandwidth(lv, rw), roof.bandwidth(lv, rw, cpu=True)
                rows.append([f"{what} bandwidth, {LEVEL_LABEL[lv]} "
                             f"({fmt_bytes(r.get('buffer_bytes'))} buffer)",
                             f"{fmt_ratio(bw / 1e9 if bw else None, 1)} GB/s",
                             f"{fmt_ratio(bw_cpu / 1e9 if bw_cpu else None, 1)} "
                             "GB/s", escape_md(r.label)])
    L = table(["limit (one core)", "wall time", "cpu time", "ISA, kernel"], rows, "lrrl")
    peaks = [f"{DTYPE_LABEL[dt]} {roof.gflops(dt):.1f} GFLOP/s "
             f"({roof.isa_of(dt)})" for dt in ("f32", "f64")
             if roof.gflops(dt)]
    if peaks:
        L += ["", "The peak of a scalar type (in bold) is its fastest FMA run, wall time: "
                  "" + "; ".join(peaks) +
              ". It divides the GFLOP/s of the frac_of_peak columns and caps the roofs below."]
    ridges = [f"{LEVEL_LABEL[lv]} {roof.ridge(lv):.2f}" for lv in ROOF_LEVELS if roof.ridge(lv)]
    ridges += [f"{LEVEL_LABEL[lv]} read + write {roof.ridge(lv, rw=True):.2f}" for lv in ROOF_LEVELS
               if lv in roof.rw and roof.ridge(lv, rw=True)]
    if ridges:
        L += ["", "Ridge points, float (flop/byte; peak ÷ bandwidth: a kernel of higher arithmetic "
                  "intensity whose "
              "data lives at that level is compute-bound, of lower intensity bandwidth-bound): "
              "" + "; ".join(ridges) +
              "."]
    return L


def roofline_kernels(res: Results) -> list[str]:
    """Flops, bytes and intensity per token and head of the library's kernels, where each sits
    under the
    roof, and the GFLOP/s measured (H = 8, float, one thread)."""
    roof = res.roof
    peak = roof.gflops("f32")
    rows = []
    for d in (64, 128):
        for label, cost, kind in ROOF_KERNELS:
            flops, nbytes = kernel_cost(cost, d, d)
            inten = flops / nbytes
            n = int(label.rsplit("= ", 1)[1]) if cost == "decode" else ROOF_N
            ws, rw = roof_working_set(cost, d, d, n)
            level = roof.level_of(ws)
            ridge, bw = roof.ridge(level, rw), roof.bandwidth(level, rw)
            roof_g = min(peak, inten * bw * 1e-9) if peak and bw else None
            bound = ("compute" if inten > ridge else f"{LEVEL_LABEL[level]} "
                                                     "bandwidth") if ridge else "–"
            r = roof_run(res, label, kind, d)
            g = r.gflops() if r else None
            at = f" (N = {fmt_n(r.size)})" if r and cost != "decode" and r.size != ROOF_N else ""
            rows.append([label, str(d), f"{flops:,.0f}", f"{nbytes:,.0f}", f"{inten:.2f}",
                         fmt_bytes(ws)
                         + (f" (B = {n})" if cost == "decode" else f" (N = {fmt_n(n)})"),
                         LEVEL_LABEL[level] + (" (r + w)" if rw else ""), fmt_ratio(ridge), bound,
                         fmt_ratio(roof_g, 1), (fmt_ratio(g, 1) + at) if g else "–",
                         fmt_ratio(g / roof_g if g and roof_g else None)])
    return table(["kernel", "D = M", "flop / token / "
                                     "head", "bytes / token / head", "flop / byte", "data (H = 8)",
                  "lives in", "ridge", "bound", "roof GFLOP/s", "measured GFLOP/s", "measured ÷ "
                                                                                    "roof"], rows,
                 "lrrrrrlrlrrr")


def roofline_section(res: Results, svg_name: str | None = None) -> list[str]:
    """The section 'Roofline: this core's limits' of the summary: bench_roofline's figures, the
    kernels' flops, bytes and place under the roof, and the plot."""
    roof = res.roof
    L: list[str] = []
    if roof:
        L.append("`bench_roofline`, one thread, same build as the kernels (how it measures: *What "
                 "is measured*). "
                 "Wall time is the figure used below; cpu time is given beside it.")
        L.append("")
        L += roofline_limits(res)
    else:
        L.append("(no bench_roofline runs in these results: the frac_of_peak and frac_of_bw "
                 "columns below show –, "
                 "and the table below gives the kernels' flops and bytes only)")
    L += ["", f"The library's kernels{' under that roof' if roof else ''} (float, EluPlusOne so F "
              "= D, H = 8, one "
          f"thread; sequences of N = {fmt_n(ROOF_N)} tokens, decode steps of B sequences; measured "
          "= useful GFLOP/s "
          "of the run of that configuration in these results):", ""]
    L += roofline_kernels(res)
    L += ["", "Flops per token and head are those the benchmarks count (useful flops): 4·F·M for a "
              "forward, "
          "non-causal or causal (2·F·M for the key's update of the state, 2·F·M for the query's "
          "read; the causal "
          "kernel's in-chunk triangle is extra work, not counted), 8·F·M for a backward "
          "(`bench_backward`: the "
          "four products R = φ(Q)ᵀ Ĝ, Ĝ Sᵀ, φ(K) R, V Rᵀ; its recomputations are not counted), "
          "4·F·M for a "
          "decode step. Bytes are the compulsory traffic: a forward reads q, k, v and writes its "
          "output "
          "(4·(2·D + 2·M) bytes), a backward reads q, k, v, dOut and writes dQ, dK, dV (4·(4·D + "
          "3·M)); the F×M "
          "state stays in cache. A decode step moves its state: it reads S, z and their "
          "compensated low parts and "
          f"writes the low parts back, {DECODE_TRAFFIC:g} × the state kept (`state_bytes` of "
          "bench_decode and "
          "bench_serving: 2·(F·M + F) floats a head), 3·4·(F·M + F) bytes a head; its q, k, v and "
          "output are not "
          "counted. *Lives in*: the first cache its data fits, from its size against "
          f"{cache_levels_text(roof)}; "
          "larger is memory. The ridge is peak ÷ the bandwidth of that level, read bandwidth for a "
          "sequence's "
          "read-dominated streams, read + write for the decode step's in-place "
          "update" + rw_fallback_text(roof) +
          "; a kernel is compute-bound when its intensity exceeds the ridge, and its roof is "
          "min(peak, intensity × "
          "bandwidth)."]
    if svg_name:
        L += ["", f"![roofline: GFLOP/s vs arithmetic intensity, log-log]({svg_name})"]
    return L
