"""The delta rule (bench_delta)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import at_most_status, fmt_n, fmt_ratio, fmt_time, speed_ratio, table, wall_cpu
from .results import SHORT_LAYOUT, frac_of_gemm, gt_find, large_sizes
from .roofline import fmt_frac_peak

if TYPE_CHECKING:
    from .results import Results


TARGET_DELTA_CHUNKED_VS_PLAIN = 3.0
# linattn's prefill (the faster of Chunked and Auto) against the token-by-token recurrence as a
# user writes it with Eigen (dl_naive_pair). linattn's own Recurrent is a fused pass, not that
# loop: when it beats Chunked on a CPU, that is good news, not a miss of this target.
TARGET_DELTA_VS_TOKEN_LOOP = 5.0
TARGET_DELTA_DECODE = 1.5


def dl_dims(res: Results) -> list[str]:
    return sorted({r.params["D"] for r in res.runs if r.kind.startswith("dl_") and "D" in r.params},
                  key=int)


def delta_section(res: Results, warn: list[str]) -> list[str]:
    """Section 15 (bench_delta): the targets call by call, the decode step, the prefill sweep
    against plain causal and the GEMM reference, Chunked vs Recurrent vs Auto, and the chunk
    size."""
    L: list[str] = []
    if not any(r.kind.startswith("dl_") for r in res.runs):
        return ["(no bench_delta runs in these results)"]
    if not any(r.kind in ("dl_delta", "dl_pair", "dl_decode_pair") for r in res.runs):
        return ["(bench_delta ran without the delta-rule kernels: linattn/delta_rule.hpp was not "
                "in the build)"]
    base = dict(dtype="f32", H="8", thr="1")
    dims = dl_dims(res)

    # Targets, call by call.
    rows = []
    for d in dims:
        for lay in ("row", "col"):
            q = dict(base, D=d, layout=lay, phi="l2silu", decay="on")
            for n in res.sizes("dl_pair", **q):
                r = res.find("dl_pair", n, **q)
                x, xc = r.get("chunked_vs_plain"), r.get("chunked_vs_plain_cpu")
                y, yc = r.get("recurrent_vs_chunked"), r.get("recurrent_vs_chunked_cpu")
                s1, n1 = at_most_status(x, xc, TARGET_DELTA_CHUNKED_VS_PLAIN)
                # No target: which of linattn's two prefill forms is faster, on cpu time as below.
                faster = "–" if y is None else ("chunked" if (yc if yc is not None else y) >= 1 else
                                                "**recurrent**")
                where = f"at D = {d}, N = {n}, {SHORT_LAYOUT.get(lay, lay)}"
                if n1:
                    warn.append(f"delta rule prefill, Chunked: {wall_cpu(x, xc)}× plain causal "
                                f"(wall (cpu)) {where}: "
                                f"{n1} (target ≤ {TARGET_DELTA_CHUNKED_VS_PLAIN:.1f}×)")
                rows.append([d, SHORT_LAYOUT.get(lay, lay), fmt_n(n),
                             fmt_time(r.get("plain_ms", 0) * 1e-3),
                             fmt_time(r.get("chunked_ms", 0) * 1e-3), wall_cpu(x, xc), s1,
                             fmt_time(r.get("recurrent_ms", 0) * 1e-3), wall_cpu(y, yc), faster,
                             str(r.iterations)])
    L.append("Targets, call by call (`dl_pair`: every iteration makes the plain causal call "
             "(`multihead_causal_linear_attention`, EluPlusOne, CausalOptions{}) and the delta "
             "rule with decay "
             "(`multihead_delta_rule_attention`, L2Normalize<Silu>) Chunked and Recurrent (token "
             "by token) back to "
             "back, rotating which goes first; medians of the per-iteration times and ratios), H = "
             "8. linattn's Recurrent is "
             "a fused pass over the state per token: *faster* says which form wins, with no target "
             "(the target against "
             "a token loop is judged in the next table):")
    L.append("")
    if rows:
        L += table(["D = M", "layout", "N", "plain causal", "delta, chunked", "÷ plain, wall (cpu)",
                    f"≤ {TARGET_DELTA_CHUNKED_VS_PLAIN:.1f}", "delta, recurrent", "÷ chunked, wall "
                                                                                  "(cpu)",
                    "faster (cpu)", "iterations"], rows, "rlrrrrlrrlr")
    else:
        L.append("(no dl_pair runs in these results)")

    # The token-by-token recurrence as written with Eigen.
    rows = []
    for d in dims:
        q = dict(dtype="f32", H="1", thr="1", D=d, layout="col", phi="l2silu", decay="on")
        for n in res.sizes("dl_naive_pair", **q):
            r = res.find("dl_naive_pair", n, **q)
            x, y = r.get("naive_vs_chunked"), r.get("naive_vs_auto")
            best = max([v for v in (x, y) if v] or [0.0])
            status = "not measured" if not best else ("met" if best >= TARGET_DELTA_VS_TOKEN_LOOP
                                                      else "**missed**")
            if best and best < TARGET_DELTA_VS_TOKEN_LOOP:
                warn.append(f"delta rule prefill against the token loop in Eigen: {best:.1f}× at D "
                            f"= {d}, "
                            f"N = {n}: missed (target ≥ {TARGET_DELTA_VS_TOKEN_LOOP:.1f}×)")
            rows.append([d, fmt_n(n), fmt_time(r.get("naive_ms", 0) * 1e-3),
                         fmt_time(r.get("chunked_ms", 0) * 1e-3),
                         fmt_time(r.get("auto_ms", 0) * 1e-3), f"{x:.1f}" if x else "–",
                         f"{y:.1f}" if y else "–",
                         status, str(r.iterations)])
    if rows:
        L += ["", "The token-by-token recurrence as a user writes it with Eigen (`dl_naive_pair`, "
                  "one head: the maps over "
              "the sequence, then per token S ← a·S, u = Sᵀk̂, δ = β(v − u), S += k̂δᵀ, out = "
              "s·Sᵀq̂), against "
              "`delta_rule_attention` Chunked and Auto (linattn's fused recurrence) on the same "
              "head, back to back; "
              "medians:", ""]
        L += table(["D = M", "N", "naive loop", "Chunked", "Auto", "naive ÷ Chunked",
                    "naive ÷ Auto",
                    "faster form ≥ "
                    f"{TARGET_DELTA_VS_TOKEN_LOOP:.1f}×", "iterations"], rows, "rrrrrrrlr")

    # Decode step.
    L += ["", "Decode step, one head (`dl_decode_pair`: blocks of steps of "
              "`RecurrentLinearAttention<EluPlusOne, "
          "float>::step` and `RecurrentDeltaRule<L2Normalize<Silu>, float>::step` with a "
          "log-decay, timed block by "
          "block in rotating order; medians per step):", ""]
    rows = []
    for d in dims:
        q = dict(dtype="f32", H="1", thr="1", D=d, phi="l2silu", decay="on")
        for n in res.sizes("dl_decode_pair", **q):
            r = res.find("dl_decode_pair", n, **q)
            p, t = r.get("plain_ns"), r.get("delta_ns")
            x, xc = r.get("delta_vs_plain"), r.get("delta_vs_plain_cpu")
            status, note = at_most_status(x, xc, TARGET_DELTA_DECODE)
            if note:
                warn.append(f"delta rule decode step: {wall_cpu(x, xc)}× the plain recurrent step "
                            "(wall (cpu)) at "
                            f"D = {d}: {note} (target ≤ {TARGET_DELTA_DECODE:.1f}×)")
            rows.append([d, f"{p:.0f} ns ({1e9 / p / 1e6:.2f} M tok/s)" if p else "–",
                         f"{t:.0f} ns ({1e9 / t / 1e6:.2f} M "
                         "tok/s)" if t else "–", wall_cpu(x, xc), status,
                         f"{int(r.iterations)} × {int(r.get('steps', 0))}"])
    if rows:
        L += table(["D = M", "plain step", "delta-rule "
                                           "step", "÷ plain, wall "
                                                   "(cpu)", f"≤ {TARGET_DELTA_DECODE:.1f}",
                    "blocks × steps"], rows, "rrrrlr")
    else:
        L.append("(no dl_decode_pair runs in these results)")

    def pct(r):
        x = frac_of_gemm(res, r) if r else None
        return f"{x * 100:.0f} %" if x else "–"

    # Prefill sweep (separate benchmarks, Auto).
    L += ["", "Prefill sweep, H = 8, `DeltaOptions::algorithm = Auto` (separate benchmarks of the "
              "same run; the "
          "call-by-call table above is the one checked against the targets). % of GEMM = useful "
          "GFLOP/s (4·N·F·M "
          "per head for all three) ÷ those of the Eigen products Kᵀ V and Q S of the same shapes "
          "(`dl_gemm_linear`):",
          ""]
    rows = []
    for d in dims:
        for lay in ("row", "col"):
            q = dict(base, D=d, layout=lay)
            for n in large_sizes(res.sizes("dl_causal", **q, phi="elu", alg="auto")):
                c = gt_find(res, "dl_causal", n, **q, phi="elu", alg="auto")
                on = gt_find(res, "dl_delta", n, **q, phi="l2silu", decay="on", alg="auto")
                off = gt_find(res, "dl_delta", n, **q, phi="l2silu", decay="off", alg="auto")
                if not c or not (on or off):
                    continue
                rows.append([d, SHORT_LAYOUT.get(lay, lay), fmt_n(n), fmt_time(c.wall),
                             fmt_time(on.wall if on else None), speed_ratio(on, c),
                             fmt_time(off.wall if off else None), speed_ratio(off, c),
                             f"{pct(c)} / {pct(on)} / {pct(off)}",
                             " / ".join(fmt_frac_peak(res, x, pct=True) for x in (c, on, off))])
    if rows:
        L += table(["D = M", "layout", "N", "plain causal", "delta, decay", "÷ plain, wall "
                                                                            "(cpu)",
                                                                            "delta, no decay",
                    "÷ plain, wall (cpu)", "% of GEMM: plain / decay / no decay",
                    "% of peak (frac_of_peak): plain / decay / no decay"], rows, "rlrrrrrrrr")
    else:
        L.append("(no Auto prefill runs with a plain causal reference in these results)")

    # Chunked vs Recurrent vs Auto.
    L += ["", "`DeltaOptions::algorithm`: Chunked (default chunk) vs Recurrent vs Auto, H = 8 (the "
              "numbers to set "
          "Auto's dispatch from; times are wall times; faster = the explicit algorithm of the "
          "smaller cpu time, "
          "Auto ÷ faster ≈ 1.00 when Auto picks it):", ""]
    rows = []
    for d in dims:
        for lay in ("row", "col"):
            for decay in ("on", "off"):
                q = dict(base, D=d, layout=lay, phi="l2silu", decay=decay)
                for n in res.sizes("dl_delta", **q, alg="recurrent"):
                    ch = gt_find(res, "dl_delta", n, **q, alg="chunked")
                    rc = gt_find(res, "dl_delta", n, **q, alg="recurrent")
                    au = gt_find(res, "dl_delta", n, **q, alg="auto")
                    c = gt_find(res, "dl_causal", n, **dict(base, D=d, layout=lay), phi="elu",
                                alg="auto")
                    if not (ch and rc):
                        continue
                    best = "chunked" if ch.cpu <= rc.cpu else "recurrent"
                    bt = min(ch.cpu, rc.cpu)
                    rows.append([d, SHORT_LAYOUT.get(lay, lay), decay, fmt_n(n),
                                 fmt_time(c.wall if c else None),
                                 fmt_time(ch.wall), speed_ratio(ch, c), fmt_time(rc.wall),
                                 speed_ratio(rc, ch),
                                 fmt_time(au.wall if au else None), best,
                                 fmt_ratio(au.cpu / bt if au else None)])
    if rows:
        L += table(["D = M", "layout", "decay", "N", "plain causal", "chunked", "chunked ÷ plain, "
                                                                                "wall (cpu)",
                    "recurrent", "recurrent ÷ chunked, wall "
                                 "(cpu)", "auto", "faster (cpu)", "auto ÷ faster (cpu)"],
                   rows, "rllrrrrrrrlr")
    else:
        L.append("(no explicit-algorithm runs in these results)")

    # Chunk size.
    rows, chunks = [], sorted({int(r.params["chunk"]) for r in res.runs if r.kind == "dl_delta"
                               and "chunk" in r.params})
    for d in dims:
        q = dict(base, D=d, layout="row", phi="l2silu", decay="on", alg="chunked")
        ns = sorted({r.size for r in res.runs if r.kind == "dl_delta" and "chunk" in r.params
                     and all(r.params.get(k) == v for k, v in q.items())})
        for n in ns:
            runs = {c: gt_find(res, "dl_delta", n, chunk=str(c), **q) for c in chunks}
            dflt = gt_find(res, "dl_delta", n, **q)
            have = {c: r for c, r in runs.items() if r}
            if not have:
                continue
            best = min(have, key=lambda c: have[c].wall)
            cells = [(("**" + fmt_time(have[c].wall) + "**") if c == best
                      else fmt_time(have[c].wall))
                     if c in have else "–" for c in chunks]
            rows.append([d, fmt_n(n)] + cells + [fmt_time(dflt.wall) if dflt else "–",
                                                 fmt_ratio(dflt.wall / have[best].wall if dflt
                                                           else None)])
    if rows:
        L += ["", "Chunk size of the chunked algorithm (`DeltaOptions::chunk_size`, with decay, "
                  "row-major inputs, "
              "H = 8; fastest in bold; default = chunk_size 0, measured by the sweep above when it "
              "reaches that N):",
              ""]
        L += table(["D = M", "N"] + [f"C = {c}" for c in chunks] + ["default", "default ÷ fastest"],
                   rows,
                   "rr" + "r" * (len(chunks) + 2))
    return L
