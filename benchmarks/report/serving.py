"""Serving (bench_serving), one sequence on two threads (split_pair_*) and bf16 / half storage
(bench_low_precision)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import fmt_bytes, fmt_n, fmt_ratio, fmt_time, table
from .roofline import decode_bw, decode_bw_note, fmt_bw_frac

if TYPE_CHECKING:
    from .results import Results


def serving_table(res: Results) -> list[str]:
    """Tokens per second of the batched decode step and of B separate multi-head steps, per
    thread count."""
    q = dict(phi="elu", dtype="f32", H="8", D="64")
    threads = sorted({r.params["thr"] for r in res.runs if r.kind == "serve_batched"}, key=int)
    rows = []
    for t in threads:
        for b in res.sizes("serve_batched", thr=t, **q):
            a, s = res.find("serve_batched", b, thr=t, **q), res.find("serve_separate", b, thr=t,
                                                                      **q)
            ta, ts = (a.get("tokens_per_s") if a else None), (s.get("tokens_per_s") if s else None)
            rows.append([t, str(b), f"{ta / 1e3:.1f} "
                                    "k" if ta else "–", f"{ts / 1e3:.1f} k" if ts else "–",
                         fmt_ratio(ta / ts if ta and ts else None),
                         fmt_bytes(a.get("state_bytes") if a else None),
                         fmt_bw_frac(decode_bw(res, a)), fmt_bw_frac(decode_bw(res, s))])
    if not rows:
        return ["(no serve_* runs in these results)"]
    return table(["threads", "B", "batched step", "B separate "
                                                  "steps", "batched ÷ separate", "states",
                  "batched frac_of_bw", "separate frac_of_bw"], rows, "rrrrrrrr") + [
        "", "Separate steps on several threads: an OpenMP loop over the sequences (each sequence's "
            "heads stay on one "
        "thread). Both compute the same values bit for bit "
        "(tests/serving/test_serving.cpp).", "", decode_bw_note(res)]


TARGET_SPLIT_SPEEDUP = 1.7
SPLIT_KINDS = (("split_pair_causal", {"alg": "auto"}, "causal_linear_attention (Auto)"),
               ("split_pair_linear", {}, "linear_attention"),
               ("split_pair_causal", {"alg": "auto", "layout": "row", "form": "ret"},
                "causal_linear_attention (Auto), returning form, row-major"),
               ("split_pair_linear", {"layout": "row", "form": "ret"},
                "linear_attention, returning form, row-major"))


def split_table(res: Results, warn: list[str]) -> list[str]:
    """One thread ÷ two threads from the paired benchmarks (median per-iteration ratios), with the
    ceiling
    two threads reach on this machine when each runs the one-thread kernel on its own half."""
    rows = []
    for kind, p, label in SPLIT_KINDS:
        q = dict(phi="elu", dtype="f32", D="64", **p)
        for n in res.sizes(kind, **q):
            r = res.find(kind, n, **q)
            x = r.get("speedup", float("nan"))
            rows.append([label, fmt_n(n), fmt_time(r.get("t1_ms", 0) * 1e-3),
                         fmt_time(r.get("t2_ms", 0) * 1e-3),
                         f"{x:.2f}×", fmt_time(r.get("halves_ms", 0) * 1e-3),
                         f"{r.get('ceiling', float('nan')):.2f}×",
                         f"{r.get('rel_diff', float('nan')):.1e}", str(r.iterations)])
            target_run = kind == "split_pair_causal" and not p.get("form") and n >= 65536
            if target_run and not x >= TARGET_SPLIT_SPEEDUP:
                warn.append(f"{label} on two threads: {x:.2f}× one thread at N = {n}, below the "
                            f"target {TARGET_SPLIT_SPEEDUP:.1f}× (two independent halves on this "
                            "machine: "
                            f"{r.get('ceiling', float('nan')):.2f}×)")
    if not rows:
        return ["(no split_pair_* runs in these results)"]
    return table(["", "N", "1 thread", "2 threads (split)", "speedup", "two independent halves",
                  "ceiling (1 thread ÷ "
                  "halves)", "max rel. diff", "iterations"], rows, "lrrrrrrrr") + [
        "", "Each iteration times the three calls back to back, rotating their order; the figures "
            "are medians "
        "of the per-iteration times and ratios. *Two independent halves*: two threads each running "
        "the "
        "one-thread kernel on its own half of the rows at once, with no summaries and no scan. Its "
        "ratio is "
        "the most two threads can give here; below 2, the threads slow each other down (shared "
        "caches or "
        "memory bandwidth, or virtual CPUs sharing a physical core). The split adds summaries of "
        "the first "
        "half's keys (2·F·M flops a key in GEMMs, against 4·F·M for a causal row): its ideal "
        "speedup is "
        "2 / (1 + r/2), with r the cost of a summarised key over a causal row (≈ 0.4 here, so "
        "1.67). "
        "The returning form on row-major memory is what a framework caller writes "
        "(`out = causal_linear_attention(Q, K, V, phi, {}, par)`): a new output, workspace and "
        "state per call."]


TARGET_LOW_DECODE = 1.6


def low_precision_section(res: Results, warn: list[str]) -> list[str]:
    """Prefill times and decode tokens/s of bf16 and half storage against float, from one run."""
    rows = []
    for form in ("out", "ret"):
        for n in res.sizes("prefill", dtype="f32", form=form):
            f = res.find("prefill", n, dtype="f32", form=form)
            cells = [f"prefill, N = {fmt_n(n)}" + (", returning form" if form == "ret" else ""),
                     fmt_time(f.wall) if f else "–"]
            for t in ("bf16", "f16"):
                r = res.find("prefill", n, dtype=t, form=form)
                cells.append(f"{fmt_time(r.wall)} "
                             f"({fmt_ratio(f.wall / r.wall)}×)" if r and f else "–")
            rows.append(cells)
    for b in res.sizes("decode", dtype="f32", state="f32"):
        f = res.find("decode", b, dtype="f32", state="f32")
        for state in ("f32", "low"):
            cells = [f"decode step, B = {b}, "
                     "" + ("float states" if state == "f32" else "states in the storage type"),
                     fmt_time(f.wall) if f and state == "f32" else "–"]
            for t in ("bf16", "f16"):
                r = res.find("decode", b, dtype=t, state=t if state == "low" else "f32")
                ratio = f.wall / r.wall if r and f else None
                cells.append(f"{fmt_time(r.wall)} ({fmt_ratio(ratio)}×)" if ratio else "–")
                target_run = state == "low" and t == "bf16" and b == 64
                if target_run and ratio and ratio < TARGET_LOW_DECODE:
                    warn.append(f"bf16 decode states at B = 64: {ratio:.2f}× the float step "
                                f"(target ≥ {TARGET_LOW_DECODE}×)")
            rows.append(cells)
    if not rows:
        return ["(no bench_low_precision runs in these results)"]
    return table(["", "float", "bf16 (float ÷ bf16)", "half (float ÷ half)"], rows, "lrrr") + [
        "", "A ratio above 1 is faster than float. bf16 / half outputs are the float kernel's on "
            "the rounded inputs, "
        "rounded (tests/core/test_low_precision.cpp); states kept in bf16 / half drift (docs/SPEC.md "
        "§8)."]
