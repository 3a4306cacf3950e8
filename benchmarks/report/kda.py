"""KDA (per-channel decays) and shared key heads (bench_kda); the batched delta-rule and gated
decoders, step and extend (bench_batched_decode). Each is a generated block of its own in
docs/benchmarks.md (bench:kda, bench:batched_decode), with the run it came from named in it."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from .fmt import at_most_status, fmt_bytes, fmt_n, fmt_time, table, wall_cpu, wrap
from .machine import cpu_model

if TYPE_CHECKING:
    from .results import Results, Run


TARGET_KDA_VS_DELTA = 1.5
TARGET_EXTEND_VS_STEPS = 1.2


def run_line(res: Results, program: str, command: str) -> list[str]:
    """Where the block's figures come from: the program's context (CPU, ISA, compiler, date, load,
    the FMA peak it measured) and how busy the machine was (cpu/wall of its single-thread runs)."""
    ctx = res.contexts.get(program, {})
    # A command naming several programs ("a; b"): the part that ran this one.
    command = next((c.strip() for c in command.split(";") if program in c), command)
    runs = [r for r in res.runs if r.program == program and r.params.get("thr", "1") == "1"
            and r.wall > 0]
    busy = statistics.median(r.cpu / r.wall for r in runs) if runs else None
    load = " ".join(f"{x:.2f}" for x in ctx.get("load_avg", [])) or "unknown"
    peak = ctx.get("linattn_fma_peak_f32_gflops")
    text = (f"One run, `{command}`, on {cpu_model()} ({ctx.get('num_cpus', '?')} CPUs, "
            f"{ctx.get('linattn_isa', '?')}), {ctx.get('linattn_compiler', '?')} "
            f"`{ctx.get('linattn_cxx_flags', '?')}`, profile {ctx.get('linattn_profile', '?')}, "
            f"{ctx.get('date', '?')}; the machine is shared with other engineers, whose compiles "
            f"come and go: load average {load} when `{program}` started")
    if busy is not None:
        text += f" (median cpu/wall of its one-thread runs {busy:.2f})"
    text += "."
    peaks = [r.get("peak_GFLOPs") for r in runs if r.get("peak_GFLOPs")]
    if peaks:
        text += (f" The FMA peak of one thread, measured in the same process right after each "
                 f"benchmark's timed loop: {min(peaks):.0f}–{max(peaks):.0f} GFLOP/s (float; "
                 f"{float(peak):.0f} at the program's start); each fraction of the peak below is "
                 "taken against the measurement next to it.")
    elif peak:
        text += f" FMA peak at the program's start: {float(peak):.1f} GFLOP/s (float, one thread)."
    return wrap(text)


def _find(res: Results, bench: str, size: int, /, **params) -> Run | None:
    for r in res.runs:
        if r.kind == bench and r.size == size and all(r.params.get(k) == v
                                                     for k, v in params.items()):
            return r
    return None


def _shapes(res: Results, kind: str) -> list[tuple[str, str]]:
    return sorted({(r.params.get("H", "?"), r.params.get("D", "?")) for r in res.runs
                   if r.kind == kind}, key=lambda hd: (int(hd[0]), int(hd[1])))


def _perf(r: Run | None) -> str:
    """'12.3 ms, 45.6 GFLOP/s, 40 %' (time, useful GFLOP/s, fraction of the measured peak)."""
    if r is None:
        return "–"
    g = r.gflops()
    f = r.get("frac_of_peak")
    return f"{fmt_time(r.wall)}, {g:.1f} GFLOP/s, {f * 100:.0f} %" if g and f is not None \
        else fmt_time(r.wall)


def _ratio(a: Run | None, b: Run | None) -> str:
    if not a or not b or b.wall <= 0 or b.cpu <= 0:
        return "–"
    return f"{a.wall / b.wall:.2f} ({a.cpu / b.cpu:.2f})"


def kda_section(res: Results, warn: list[str], command: str = "bench_kda --quick") -> list[str]:
    # (bench_kda_layer's kinds, kda_layer_*, have a section of their own: kda_layer.py.)
    if not any(r.kind.startswith("kda_") and not r.kind.startswith("kda_layer_")
               for r in res.runs):
        return ["(no bench_kda runs in these results)"]
    L = run_line(res, "bench_kda", command) + [""]

    # Targets, call by call.
    rows = []
    for h, d in _shapes(res, "kda_pair"):
        for n in sorted({r.size for r in res.runs if r.kind == "kda_pair"
                         and r.params.get("H") == h and r.params.get("D") == d}):
            r = _find(res, "kda_pair", n, H=h, D=d)
            x, xc = r.get("kda_vs_delta"), r.get("kda_vs_delta_cpu")
            status, note = at_most_status(x, xc, TARGET_KDA_VS_DELTA)
            if note:
                warn.append(f"KDA prefill: {wall_cpu(x, xc)}× the scalar-decay delta rule (wall "
                            f"(cpu)) at H = {h}, D = M = {d}, N = {n}: {note} (target ≤ "
                            f"{TARGET_KDA_VS_DELTA:.1f}×)")
            ms = lambda k: fmt_time(r.get(k, 0) * 1e-3)  # noqa: E731
            rows.append([h, d, fmt_n(n), ms("delta_ms"), ms("kda_ms"), wall_cpu(x, xc), status,
                         ms("causal_ms"),
                         wall_cpu(r.get("delta_vs_causal"), r.get("delta_vs_causal_cpu")),
                         wall_cpu(r.get("kda_vs_causal"), r.get("kda_vs_causal_cpu")),
                         ms("gva_ms"), ms("repeat_ms"),
                         wall_cpu(r.get("gva_vs_repeat"), r.get("gva_vs_repeat_cpu")),
                         str(r.iterations)])
    L += wrap("Call by call (`kda_pair`: every iteration makes the scalar-decay delta rule, KDA, "
              "the scalar-decay delta rule over H/2 shared key heads (GVA), the same with the keys "
              "repeated to H heads first (copy timed) and plain causal linear attention (Identity) "
              "back to back, rotating which goes first; medians of the per-iteration times and "
              "ratios, wall (cpu)):")
    L.append("")
    if rows:
        L += table(["H", "D = M", "N", "delta, scalar decay", "KDA", "KDA ÷ delta",
                    f"≤ {TARGET_KDA_VS_DELTA:.1f}", "plain causal", "delta ÷ causal",
                    "KDA ÷ causal", "GVA (H/2 key heads)", "repeat + call", "GVA ÷ repeat",
                    "iterations"], rows, "rrrrrrlrrrrrrr")
    else:
        L.append("(no kda_pair runs in these results)")

    # Separate benchmarks: time, GFLOP/s, fraction of the peak.
    rows, rows_gva = [], []
    for h, d in _shapes(res, "kda_prefill"):
        for n in sorted({r.size for r in res.runs if r.kind == "kda_prefill"
                         and r.params.get("H") == h and r.params.get("D") == d}):
            v = {var: _find(res, "kda_prefill", n, H=h, D=d, var=var) for var in
                 ("causal", "delta", "kda", "delta_gva", "delta_repeat", "kda_gva", "kda_repeat")}
            rows.append([h, d, fmt_n(n), _perf(v["causal"]), _perf(v["delta"]), _perf(v["kda"]),
                         _ratio(v["kda"], v["delta"])])
            rows_gva.append([h, d, fmt_n(n), _perf(v["delta_gva"]), _perf(v["delta_repeat"]),
                             _ratio(v["delta_gva"], v["delta_repeat"]), _perf(v["kda_gva"]),
                             _perf(v["kda_repeat"]), _ratio(v["kda_gva"], v["kda_repeat"])])
    if rows:
        L += [""] + wrap("Each call as a benchmark of its own (`kda_prefill`, medians of the "
                         "repetitions): time, useful GFLOP/s (4·N·F·M per head, for all three) and "
                         "the fraction of the FMA peak measured in the same process:") + [""]
        L += table(["H", "D = M", "N", "plain causal (Identity)", "delta, scalar decay",
                    "KDA (per-channel decay)", "KDA ÷ delta, wall (cpu)"], rows, "rrrrrrr")
        L += [""] + wrap("Shared key heads: `DeltaOptions::key_heads = H/2` against the same call "
                         "after `repeat_interleave` of the query and key heads into kept H-head "
                         "buffers (the copy timed):") + [""]
        L += table(["H", "D = M", "N", "delta, GVA", "delta, repeat + call",
                    "GVA ÷ repeat, wall (cpu)", "KDA, GVA", "KDA, repeat + call",
                    "GVA ÷ repeat, wall (cpu)"], rows_gva, "rrrrrrrrr")
    return L


def _bw(r: Run) -> str:
    f, bw = r.get("frac_of_bw"), r.get("bw_rw_GBs")
    return f"{f:.2f} ({bw:.0f} GB/s)" if f is not None and bw else "–"


KIND_LABEL = {("delta", "scalar"): "delta rule, scalar decay",
              ("delta", "channel"): "delta rule, KDA (per channel)",
              ("gated", "scalar"): "gated, scalar decay"}
KINDS = (("delta", "scalar"), ("delta", "channel"), ("gated", "scalar"))


def batched_decode_section(res: Results, warn: list[str],
                           command: str = "bench_batched_decode --quick") -> list[str]:
    if not any(r.kind.startswith("bdec_") for r in res.runs):
        return ["(no bench_batched_decode runs in these results)"]
    L = run_line(res, "bench_batched_decode", command) + [""]

    rows = []
    heads = sorted({r.params["H"] for r in res.runs if r.kind == "bdec_step"}, key=int)
    thrs = sorted({r.params["thr"] for r in res.runs if r.kind == "bdec_step"}, key=int)
    for kind, decay in KINDS:
        for h in heads:
            for thr in thrs:
                for b in sorted({r.size for r in res.runs if r.kind == "bdec_step"}):
                    r = _find(res, "bdec_step", b, kind=kind, decay=decay, H=h, thr=thr)
                    if r is None:
                        continue
                    ns = r.get("ns_per_token")
                    f = r.get("frac_of_peak")
                    rows.append([KIND_LABEL[(kind, decay)], h, thr, str(b), fmt_time(r.wall),
                                 fmt_time(ns * 1e-9) if ns else "–",
                                 f"{1e9 / ns / 1e3:.0f} k" if ns else "–",
                                 fmt_bytes(r.get("state_bytes")), _bw(r),
                                 f"{f * 100:.1f} %" if f is not None else "–"])
    L += wrap("One `step()` of B sequences × H heads, D = M = 128 (medians of the repetitions): "
              "time per step and per token (÷ B), tokens/s, the states' bytes, frac_of_bw = bytes "
              "a step moves (each state read and written once, plus the tokens) ÷ time ÷ the read "
              "+ write bandwidth of a buffer of the states' size on the same threads, measured in "
              "the same process (in parentheses), and the fraction of the FMA peak (useful 4·F·M "
              "flops per head; × the threads):")
    L.append("")
    L += table(["decoder", "H", "threads", "B", "step", "per token", "tokens/s", "states",
                "frac_of_bw (bandwidth)", "of FMA peak"], rows, "lrrrrrrrrr")

    rows = []
    pairs = [r for r in res.runs if r.kind == "bdec_extend_pair"]
    keyf = lambda r: (KINDS.index((r.params["kind"], r.params["decay"])),  # noqa: E731
                      int(r.params["H"]), int(r.params["S"]), int(r.params["T"]),
                      int(r.params["thr"]))
    for r in sorted(pairs, key=keyf):
        p = r.params
        x, xc = r.get("extend_vs_steps"), r.get("extend_vs_steps_cpu")
        status, note = at_most_status(x, xc, TARGET_EXTEND_VS_STEPS)
        if note:
            warn.append(f"batched decode extend: {wall_cpu(x, xc)}× T steps (wall (cpu)) for "
                        f"{KIND_LABEL[(p['kind'], p['decay'])]}, S = {p['S']}, T = {p['T']}, "
                        f"{p['thr']} thread(s): {note} (target ≤ {TARGET_EXTEND_VS_STEPS:.1f}×)")
        us = lambda k: fmt_time(r.get(k, 0) * 1e-6)  # noqa: E731
        pt = r.get("ns_per_token_extend")
        rows.append([KIND_LABEL[(p["kind"], p["decay"])], p["H"], p["S"], p["T"], p["thr"],
                     us("steps_us"), us("extend_us"), wall_cpu(x, xc), status, us("snap_us"),
                     wall_cpu(r.get("snap_vs_extend"), r.get("snap_vs_extend_cpu")),
                     fmt_time(pt * 1e-9) if pt else "–",
                     f"{r.iterations} × {int(r.get('reps', 1))}"])
    if rows:
        L += [""] + wrap("`extend()` of T tokens for each of S sequences (D = M = 128) against T "
                         "`step()` calls of the same tokens, and `extend()` on a decoder with "
                         "`keep_snapshots(8)` against one without (`bdec_extend_pair`: the three "
                         "timed back to back in rotating order, each call repeated reps = max(1, 256 ÷ (S·T)) "
                         "times per measurement (quick profile); medians of the per-iteration times and ratios, wall (cpu)):")
        L.append("")
        L += table(["decoder", "H", "S", "T", "threads", "T steps", "extend",
                    "extend ÷ steps", f"≤ {TARGET_EXTEND_VS_STEPS:.1f}", "extend, 8 snapshots",
                    "snapshots ÷ extend", "extend per token", "iterations × reps"], rows,
                   "lrrrrrrrlrrrr")
    return L
