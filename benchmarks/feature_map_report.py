#!/usr/bin/env python3
"""Write docs/feature_maps.md and docs/feature_maps_plot.svg from a run of feature_map_quality.

    python3 benchmarks/feature_map_report.py --run build/bench/benchmarks/feature_map_quality \\
        --md docs/feature_maps.md --svg docs/feature_maps_plot.svg

runs the program (quick profile; --profile full for more seeds) and writes both files. From the
files of an earlier run (benchmarks/run.sh passes them):

    feature_map_quality --quality_out=ERRORS.json --benchmark_out=TIMINGS.json \\
        --benchmark_out_format=json
    python3 benchmarks/feature_map_report.py --errors ERRORS.json --timings TIMINGS.json \\
        [--md docs/feature_maps.md] [--svg docs/feature_maps_plot.svg] [--command "..."]

ERRORS.json is the program's study (relative errors against
softmax attention, per map and input family); TIMINGS.json its Google Benchmark output (time per
call of each map's attention at the study's shape). Every figure of the two files comes from
these; the words that judge the figures are chosen from them too (which map is closest, where a
map falls behind equal weights, the fitted slope of FAVOR+). Standard library only.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from xml.sax.saxutils import escape

DEFAULT_COMMAND = "bash benchmarks/run.sh"
UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
# Lines of the plot: colour and marker per map family.
STYLE = {
    "elu": ("#1f77b4", "circle"),
    "relu": ("#ff7f0e", "square"),
    "softmax_split": ("#2ca02c", "diamond"),
    "cosine": ("#9467bd", "triangle"),
    "dpfp": ("#8c564b", "square"),
    "taylor2": ("#e377c2", "diamond"),
    "favor": ("#d62728", "circle"),
    "linformer": ("#17becf", "triangle"),
}
FAMILY_LABEL = {
    "elu": "EluPlusOne",
    "relu": "Relu",
    "softmax_split": "SoftmaxSplit",
    "cosine": "NormalizedCosine",
    "dpfp": "DPFP (ν = 1, 2, 3)",
    "taylor2": "Taylor-2",
    "favor": "FAVOR+ (mean ± sd over seeds)",
    "linformer": "Linformer (F = k projected keys)",
}


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


class Data:
    def __init__(self, errors_path: str, timings_path: str | None):
        with open(errors_path, encoding="utf-8") as f:
            e = json.load(f)
        self.N, self.D, self.M, self.draws = e["N"], e["D"], e["M"], e["draws"]
        self.profile = e["profile"]
        self.has_favor = bool(e["favor"])
        self.families = e["families"]
        self.methods = e["methods"]
        self.method = {m["key"]: m for m in self.methods}
        self.err = {(x["method"], x["input"], x["causal"]): x for x in e["errors"]}
        self.time: dict[tuple[str, bool], tuple[float, float]] = {}  # per token: (wall, cpu)
        self.context: dict = {}
        if timings_path:
            with open(timings_path, encoding="utf-8") as f:
                t = json.load(f)
            self.context = t.get("context", {})
            for b in t.get("benchmarks", []):
                if b.get("run_type") == "aggregate" or b.get("error_occurred"):
                    continue
                parts = b["name"].split("/")
                if parts[0] not in ("fm_linear", "fm_causal"):
                    continue
                params = dict(p.partition(":")[::2] for p in parts[1:] if ":" in p)
                n = int(params.get("N", "0"))
                if n != self.N:
                    continue
                u = UNIT_S[b.get("time_unit", "ns")]
                self.time[(params["phi"], parts[0] == "fm_causal")] = (
                    float(b["real_time"]) * u / n, float(b["cpu_time"]) * u / n)

    def e(self, method: str, family: str, causal: bool) -> dict | None:
        return self.err.get((method, family, causal))

    def mean(self, method: str, family: str, causal: bool) -> float | None:
        x = self.e(method, family, causal)
        return None if x is None or x["mean"] is None else float(x["mean"])

    def fam(self, key: str) -> dict:
        return next(f for f in self.families if f["key"] == key)

    def uniform(self, family: str, causal: bool) -> float:
        return float(self.fam(family)["uniform_error_causal" if causal else "uniform_error"])

    def keys_of(self, family: str) -> list[str]:
        return [m["key"] for m in self.methods if m["family"] == family]


# ------------------------------------------------------------------------------------------------
# Formatting
# ------------------------------------------------------------------------------------------------


def fmt_err(x: dict | None, random: bool) -> str:
    if x is None:
        return "–"
    if x["mean"] is None:
        return "non-finite"
    if random and x["draws"] > 1:
        return f"{x['mean']:.3g} ± {x['sd']:.2g}"
    return f"{x['mean']:.3g}"


def fmt_us(t: float | None) -> str:
    if t is None:
        return "–"
    us = t * 1e6
    return f"{us:.3g}" if us < 100 else f"{us:.0f}"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or ("l" + "r" * (len(header) - 1))
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def fit_slope(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares line through (log x, log y): (slope, intercept)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    return slope, my - slope * mx


def cpu_description() -> str:
    model, family, model_no, flags = "unknown CPU", None, None, ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                k, _, v = line.partition(":")
                k, v = k.strip(), v.strip()
                if k == "model name" and model == "unknown CPU":
                    model = v
                elif k == "cpu family" and family is None:
                    family = int(v)
                elif k == "model" and model_no is None:
                    model_no = int(v)
                elif k == "flags" and not flags:
                    flags = v
    except OSError:
        model = platform.processor() or model
    arch = ""
    if "AMD" in model and family == 25 and model_no is not None:
        # Family 19h: Zen 3 is models 00h-0Fh, 20h-2Fh, 40h-5Fh; the others are Zen 4.
        zen3 = model_no < 0x10 or 0x20 <= model_no < 0x30 or 0x40 <= model_no < 0x60
        arch = " (Zen 3)" if zen3 else " (Zen 4)"
    isa = "AVX-512" if " avx512f" in f" {flags}" else ("AVX2" if " avx2" in f" {flags}"
                                                       else "no AVX2")
    return f"{os.cpu_count()}-core {model}{arch}, {isa}"


# ------------------------------------------------------------------------------------------------
# Findings (chosen from the data)
# ------------------------------------------------------------------------------------------------


def best(d: Data, family: str, causal: bool, keys: list[str]) -> tuple[str, float] | None:
    c = [(d.mean(k, family, causal), k) for k in keys if d.mean(k, family, causal) is not None]
    if not c:
        return None
    e, k = min(c)
    return k, e


def label(d: Data, key: str) -> str:
    m = d.method[key]
    return m["label"] + ("" if m["family"] in ("softmax", "favor",
                                               "linformer") else f" (F = {m['F']})")


def pareto(d: Data, family: str, causal: bool) -> list[str]:
    """Methods better than equal weights that no other such method beats on both time per token and
    error (softmax itself excluded)."""
    pts = []
    for m in d.methods:
        if m["family"] == "softmax":
            continue
        t = d.time.get((m["key"], causal))
        e = d.mean(m["key"], family, causal)
        if t is not None and e is not None and e < d.uniform(family, causal):
            pts.append((t[1], e, m["key"]))
    pts.sort()
    front, best_e = [], math.inf
    for t, e, k in pts:
        if e < best_e:
            front.append(k)
            best_e = e
    return front


def favor_fit(d: Data, family: str, causal: bool) -> tuple[float, float] | None:
    ks = d.keys_of("favor")
    return fit_slope([d.method[k]["F"] for k in ks], [d.mean(k, family, causal) for k in ks])


# ------------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------------


def error_table(d: Data, causal: bool) -> list[str]:
    fams = d.families
    header = ["map", "F", "cpu µs/token"] + [f["key"] for f in fams]
    rows = []
    for m in d.methods:
        if causal and not m["causal"]:
            continue
        t = d.time.get((m["key"], causal))
        rows.append([m["label"], str(m["F"]) if m["family"] != "softmax" else "(N)",
                     fmt_us(t[1] if t else None)]
                    + [fmt_err(d.e(m["key"], f["key"], causal), m["random"]) for f in fams])
    rows.append(["equal weights (mean of "
                 "V)", "–", "–"] + [f"{d.uniform(f['key'], causal):.3g}" for f in fams])
    return table(header, rows)


def ratio_range(d: Data, keys: list[str], fams: list[str],
                causal: bool = False) -> tuple[float, float] | None:
    r = [d.mean(k, f, causal) / d.uniform(f, causal) for k in keys for f in fams
         if d.mean(k, f, causal) is not None and d.uniform(f, causal) > 0]
    return (min(r), max(r)) if r else None


def cost_ratio(d: Data, key: str, ref: str, causal: bool = False) -> float | None:
    a, b = d.time.get((key, causal)), d.time.get((ref, causal))
    return a[1] / b[1] if a and b and b[1] > 0 else None


def findings(d: Data) -> list[str]:
    L: list[str] = []
    fams = [f["key"] for f in d.families]
    # Flat inputs: attention so even that the mean of V is already within 50 % of softmax's
    # output; a map's ratio to that error says little there, so the ratios are given apart.
    flat = [f for f in fams if d.uniform(f, False) < 0.5] or fams[:1]
    sharp = [f for f in fams if f not in flat]
    maps = [m for m in d.methods if m["family"] != "softmax"]
    nonest = [m["key"] for m in maps if not m["estimator"] and m["family"] != "linformer"]
    small = [m["key"] for m in maps if d.D <= m["F"] <= d.D + 1]
    # Closest overall, and at F ≈ D.
    cells = []
    for f in fams:
        b = best(d, f, False, [m["key"] for m in maps])
        if b:
            cells.append(f"{f}: {label(d, b[0])}, {b[1]:.3g} (equal weights: "
                         f"{d.uniform(f, False):.3g})")
    L.append("- **Closest to softmax, any F (non-causal)**: " + "; ".join(cells) + ".")
    for causal in (False, True):
        cells = []
        for f in fams:
            b = best(d, f, causal, [k for k in small if d.method[k]["causal"] or not causal])
            if b:
                cells.append(f"{f}: {d.method[b[0]]['label']} {b[1]:.3g}")
        L.append(f"- **At equal F ≈ D ({d.D}–{d.D + 1} features), "
                 f"{'causal' if causal else 'non-causal'}**: "
                 + "; ".join(cells) + ".")
    # The maps that are not estimators: how much better than ignoring q and k.
    rr = ratio_range(d, nonest, sharp)
    r0 = ratio_range(d, nonest, flat)
    dp = d.keys_of("dpfp")
    if rr and r0:
        L.append("- **EluPlusOne, Relu, SoftmaxSplit, NormalizedCosine and DPFP stay close to "
                 "equal weights**: "
                 f"their error is {rr[0]:.2f}–{rr[1]:.2f}× that of outputting the mean of V on "
                 "every input but "
                 f"the flat ones, where equal weights' error is below 0.5 ({', '.join(flat)}: "
                 f"{r0[0]:.2f}–{r0[1]:.2f}×).")
    if len(dp) > 1:
        r3 = ratio_range(d, dp[-1:], sharp)
        L.append("- **More features do not bring DPFP to softmax**: from "
                 f"{d.method[dp[0]]['label']} to "
                 f"{d.method[dp[-1]]['label']} (F = {d.method[dp[0]]['F']} → "
                 f"{d.method[dp[-1]]['F']}) the error goes "
                 + ", ".join(f"{f} {d.mean(dp[0], f, False):.3g} → "
                             f"{d.mean(dp[-1], f, False):.3g}" for f in fams)
                 + (f"; at ν = 3 it is still {r3[0]:.2f}–{r3[1]:.2f}× equal weights' on all but "
                    "the flat inputs "
                    f"({', '.join(flat)})." if r3 else "."))
    if "taylor2" in d.method:
        t = {f: d.mean("taylor2", f, False) for f in fams}
        c = cost_ratio(d, "taylor2", "elu")
        cs = cost_ratio(d, "taylor2", "softmax")
        L.append("- **Taylor-2 is the best map where attention is flat and breaks down where it "
                 "is sharp**: "
                 + ", ".join(f"{f} {x:.3g}" for f, x in t.items() if x is not None)
                 + " (non-causal; "
                   "" + ", ".join(f"{f} {t[f] / d.uniform(f, False):.2f}× equal weights"
                                                for f in fams[-3:] if t.get(f) is not None) + ")"
                 + (f". It costs {c:.0f}× EluPlusOne per token" if c else "")
                 + (f" and {cs:.1f}× softmax itself at N = {d.N}" if cs else "") + ".")
    if d.has_favor and d.keys_of("favor"):
        ks = d.keys_of("favor")
        cells = []
        for f in fams:
            fit = favor_fit(d, f, False)
            if fit:
                cells.append(f"{f} {minus(fit[0])}")
        last = ks[-1]
        falling = [f for f in fams if (favor_fit(d, f, False) or (0.0, 0.0))[0] < -0.2]
        worse = [f for f in fams if (d.mean(last, f, False) or 0) >= d.uniform(f, False)]
        L.append("- **FAVOR+ estimates exp(q·k/√D) without bias, but its variance decides**: the "
                 "fitted slope of "
                 "log(error) against log(m) (m = " + ", ".join(str(d.method[k]["F"]) for k in ks) +
                 ", non-causal) is " + ", ".join(cells) + ", against −0.5 for an error ∝ 1/√m. " +
                 (f"The error falls with m only on {', '.join(falling)}; elsewhere it hardly moves "
                  "up to m = "
                  f"{d.method[last]['F']}. "
                  "" if falling else f"It hardly moves up to m = {d.method[last]['F']}. ") +
                 f"At m = {d.method[last]['F']} it is above equal weights' on " +
                 (", ".join(worse) if worse else "no input") + ".")
    elif not d.has_favor:
        L.append("- **FAVOR+** is not in this run: the program was built without "
                 "`<linattn/favor.hpp>`; "
                 "rebuild and rerun once it exists.")
    lk = d.keys_of("linformer")
    if lk:
        e = [d.mean(k, f, False) for k in lk for f in fams if d.mean(k, f, False) is not None]
        slopes = [fit_slope([d.method[k]["F"] for k in lk],
                            [d.mean(k, f, False) for k in lk]) for f in fams]
        slopes = [x[0] for x in slopes if x]
        L.append("- **Linformer with random projections is far from softmax**: errors "
                 f"{min(e):.3g} to "
                 f"{max(e):.3g} (k = {d.method[lk[0]]['F']} … {d.method[lk[-1]]['F']}), above "
                 "equal weights "
                 "everywhere. Each row of F·V mixes all N values with N(0, 1/k) weights (about "
                 "√(N/k) times a "
                 "value's norm), so the output is no longer an average of values" +
                 (f"; the error falls as k^{minus(min(slopes))} to k^{minus(max(slopes))} (fitted "
                  "slopes)"
                  if slopes else "") +
                 ". The paper learns E and F; drawn at random, they do not approximate softmax "
                 "attention.")
    # Where every map falls to (or below) equal weights.
    worse, seen = [], set()
    for m in maps:
        if m["family"] == "linformer" or m["family"] in seen:
            continue

        def bad(key: str) -> list[str]:
            return [f for f in fams if (d.mean(key, f, False) or 0) >= d.uniform(f, False)]

        members = d.keys_of(m["family"])
        if len(members) > 1 and all(bad(k) == bad(m["key"]) for k in members) and bad(m["key"]):
            seen.add(m["family"])
            b = bad(m["key"])
            worse.append(f"{FAMILY_LABEL.get(m['family'], m['family']).split(' (')[0]}, every "
                         f"{'m' if m['family'] == 'favor' else 'ν'} "
                         f"({'every input' if b == fams else ', '.join(b)})")
        elif bad(m["key"]):
            worse.append(f"{m['label']} ({', '.join(bad(m['key']))})")
    if worse:
        L.append("- **Where a map is no better than equal weights** (non-causal error ≥ that of "
                 "the mean of V): "
                 + "; ".join(worse) + ".")
    if d.time:
        for f in fams[:2]:
            front = pareto(d, f, False)
            L.append(f"- **For its cost, {f}, non-causal** (of the maps better than equal weights, "
                     "each one listed "
                     "is cheaper than every map with a smaller error; cpu µs/token, error): " +
                     " → ".join(f"{label(d, k)} {fmt_us(d.time[(k, False)][1])}, "
                                f"{d.mean(k, f, False):.3g}"
                                for k in front) + ".")
    if d.time and ("softmax", False) in d.time:
        cells = []
        for m in maps:
            c = cost_ratio(d, m["key"], "softmax")
            if c is not None:
                cells.append(f"{label(d, m['key'])} {c:.2g}")
        L.append(f"- **Cost per token relative to softmax** (N = {d.N}, non-causal, cpu time; "
                 "softmax's cost grows "
                 "with N, the others' does not): " + ", ".join(cells) + ".")
    return L


def write_markdown(d: Data, path: str, svg_name: str | None, command: str,
                   panels: list[str]) -> None:
    ctx = d.context
    date = ctx.get("date") or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    L = ["# Feature maps against softmax attention", "",
         "<!-- Generated by benchmarks/feature_map_report.py from a run of feature_map_quality; "
         "do not edit by hand. -->", "",
         "Which feature map's linear attention comes closest to softmax attention "
         "softmax(QKᵀ/√D)V, "
         "and at what cost? `benchmarks/feature_map_quality.cpp` feeds the library's maps for "
         "normalised "
         "attention (EluPlusOne, Relu, SoftmaxSplit, NormalizedCosine, DPFP, Taylor-2, FAVOR+) and "
         "Linformer "
         f"the same float inputs (N = {d.N} tokens, D = M = {d.D}, one head) and compares each "
         "output with softmax "
         "attention computed exactly in double: the relative Frobenius error "
         "‖out − out_softmax‖_F / ‖out_softmax‖_F, non-causal (`linear_attention`) and causal "
         "(`causal_linear_attention` against causal softmax). The same program times each map's "
         "attention with Google Benchmark on one thread.", "",
         f"Regenerate: `{command}`", "",
         f"Machine: {cpu_description()}; {ctx.get('linattn_compiler', 'compiler unknown')}, "
         f"`{ctx.get('linattn_cxx_flags', '?')}`; Eigen {ctx.get('linattn_eigen', '?')}. "
         f"Profile `{d.profile}`, random maps over {d.draws} seeds each, run of {date}.", ""]
    L += ["## Findings", ""] + findings(d) + [""]
    L += ["Two kinds of map are compared here, and they should not be confused:", "",
          "- **FAVOR+ and Taylor-2 approximate the softmax kernel exp(q·k/√D)**. FAVOR+ is an "
          "unbiased "
          "random-feature estimate: with independent features its relative variance per score is "
          "(exp(‖q + k‖²/√D) − 1)/m, so its error falls as 1/√m once that is small, and the factor "
          "exp(‖q + k‖²/√D) decides when. For q, k entries N(0, σ²) in D dimensions ‖q + k‖²/√D ≈ "
          "2σ²√D: "
          f"{2 * d.D ** 0.5 * 0.0625:.0f} at σ = 0.25, {2 * d.D ** 0.5 * 0.25:.0f} at σ = 0.5 and "
          f"{2 * d.D ** 0.5:.0f} at σ = 1 for D = {d.D} "
          f"(e^{2 * d.D ** 0.5:.0f} ≈ {sci(math.exp(2 * d.D ** 0.5))}), and more with outlier "
          "channels: no "
          "practical m reaches the 1/√m regime from σ = 1 on. Taylor-2 is the exact second-order "
          "polynomial "
          "1 + t + t²/2 of t = q·k/√D: accurate while |t| is small and wrong when scores are large "
          "(sharp attention, outlier channels).",
          "- **EluPlusOne, Relu, NormalizedCosine, SoftmaxSplit and DPFP are not estimators of the "
          "softmax kernel**: φ(q)·φ(k) is another similarity, which a model trained with it learns "
          "to use. Their error "
          "against softmax is a property of the inputs, not a sampling error, and it does not fall "
          "to "
          "0 as F grows (DPFP's ν = 1, 2, 3 show it). They apply no 1/√D scaling (the library's, "
          "and "
          "the paper's, choice), so they are given the same Q and K as softmax.",
          "- **Linformer** (random projections E, F of N(0, 1/k) along the sequence, as "
          "`make_linformer_projections` draws them; the paper learns them) is exact softmax "
          "against k "
          "mixed keys; non-causal only.",
          "- Identity, Silu and L2Normalize, the maps of the gated and delta-rule kernels, are "
          "left out: their "
          "features take both signs, and normalised attention with them can divide by a "
          "denominator near 0.", ""]
    L += ["## The inputs", "",
          "q and k entries are N(0, σ²) (V: N(0, 1)); a score q·k/√D then has standard deviation "
          "σ², "
          "so σ runs from flat to sharp attention. The outlier families add ±s to 3 of the 64 "
          "channels "
          "of every q and k (the same sign for every token, as the massive activations of LLMs): "
          "softmax "
          "ignores the shared s² in every score, but not the s·k_c/√D it adds per key, and the "
          "inputs move "
          "far from the origin. Sharpness of the exact attention, non-causal (mean over "
          "queries):", ""]
    rows = []
    for f in d.families:
        rows.append([f["label"], f"{f['entropy']:.2f}", f"{math.exp(f['entropy']):.0f} of {d.N}",
                     f"{f['max_weight']:.3f}", f"{f['max_weight_causal']:.3f}",
                     f"{f['uniform_error']:.3g}"])
    L += table(["input (key)", "entropy (nats)", "e^entropy (keys)", "largest weight",
                "largest weight, causal", "error of equal weights"], rows)
    L += ["", "(keys in the tables below: "
              "" + ", ".join(f"`{f['key']}` = {f['label']}" for f in d.families) + ")", ""]
    L += ["## Error against softmax, non-causal", "",
          "Relative Frobenius error (random maps: mean ± standard deviation over the seeds); cpu "
          "µs/token is "
          f"the cpu time of one call (one thread) divided by N = {d.N}. \"Equal weights\" is the "
          "error of outputting "
          "the mean of V for every query: a map at or above it has lost the attention pattern.", ""]
    L += error_table(d, False) + [""]
    L += ["## Error against softmax, causal", "",
          "Query i attends to keys j ≤ i; `causal_linear_attention` (library default algorithm) "
          "against "
          "causal softmax. Equal weights: the mean of v_1 … v_i.", ""]
    L += error_table(d, True) + [""]
    if d.has_favor and d.keys_of("favor"):
        ks = d.keys_of("favor")
        L += ["## FAVOR+: error against m", "",
              "Mean ± standard deviation over the seeds, non-causal; the last row is the "
              "least-squares slope "
              "of log(error) against log(m) (−0.5 for an error that falls as 1/√m).", ""]
        rows = []
        for k in ks:
            rows.append([str(d.method[k]["F"])] + [fmt_err(d.e(k, f["key"], False),
                                                           True) for f in d.families])
        sl = []
        for f in d.families:
            fit = favor_fit(d, f["key"], False)
            sl.append(minus(fit[0]) if fit else "–")
        rows.append(["slope"] + sl)
        L += table(["m"] + [f["key"] for f in d.families], rows) + [""]
    if svg_name:
        L += ["## Error against F", "",
              f"![relative error against the number of features F, log-log]({svg_name})", "",
              "Non-causal, one panel per input "
              "(" + ", ".join(panels) + "), one line per map family. FAVOR+ has "
              "error bars of ± one "
              "standard deviation and a dashed reference line ∝ 1/√m through its points; the grey "
              "dashed line "
              "is the error of equal weights.", ""]
    L += ["## How it is measured", "",
          "- Inputs: Gaussian numbers from `std::mt19937_64` through the program's own polar "
          "Box–Muller "
          "(so the same inputs on every platform), drawn in double and rounded to float; the maps "
          "run in "
          f"float through the library's kernels (out-parameter forms with a `Workspace`, "
          f"`ParallelOptions::num_threads = 1`).",
          "- Reference: softmax attention in double from the double inputs (scores, softmax, "
          "product "
          "written out in the program), so the float rounding of the inputs is part of every map's "
          "error; "
          "the softmax (tiled, float) row shows how small that part is.",
          f"- Random maps: seeds 1000 … {1000 + d.draws - 1}, the same for every input family.",
          "- Timings: one call of each map's attention on uniform inputs of the same shape (the "
          "cost does "
          "not depend on the values), Google Benchmark, cpu time of the one thread (the machine's "
          "other core "
          "may be busy; wall times are in the JSON); compare maps within this run.", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(L))


# ------------------------------------------------------------------------------------------------
# SVG
# ------------------------------------------------------------------------------------------------


def marker(kind: str, x: float, y: float, color: str, r: float = 4.5) -> str:
    if kind == "square":
        return (f'<rect x="{x - r:.1f}" y="{y - r:.1f}" width="{2 * r:.1f}" height="{2 * r:.1f}" '
                f'fill="{color}"/>')
    if kind == "diamond":
        return (f'<path d="M{x:.1f},{y - r - 1:.1f} L{x + r + 1:.1f},{y:.1f} '
                f'L{x:.1f},{y + r + 1:.1f} '
                f'L{x - r - 1:.1f},{y:.1f} Z" fill="{color}"/>')
    if kind == "triangle":
        return (f'<path d="M{x:.1f},{y - r - 1:.1f} L{x + r + 1:.1f},{y + r:.1f} '
                f'L{x - r - 1:.1f},{y + r:.1f} Z" '
                f'fill="{color}"/>')
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="{color}"/>'


def sci(x: float) -> str:
    e = math.floor(math.log10(x))
    return f"{x / 10 ** e:.0f}·10^{e}"


def minus(x: float) -> str:
    return f"{x:+.2f}".replace("-", "−")


def decade(e: int) -> str:
    return f"{10.0 ** e:g}" if -3 <= e <= 3 else f"1e{e}"


def dodge(points: list[tuple[str, float, float, float]], near: float = 10.0,
          step: float = 12.0) -> dict[tuple[str, float], float]:
    """Horizontal offsets (pixels) for markers (family, F, x pixel, y pixel) at about the same x
    (F = 64, and NormalizedCosine's 65) within `near` pixels of each other vertically: spread `step`
    apart side by side, so that none hides another (several maps have F ≈ D and close errors)."""
    out: dict[tuple[str, float], float] = {}
    columns: list[list[tuple[str, float, float, float]]] = []
    for p in sorted(points, key=lambda p: p[2]):
        if columns and p[2] - columns[-1][-1][2] < 3.0:
            columns[-1].append(p)
        else:
            columns.append([p])
    for col in columns:
        col.sort(key=lambda p: p[3])
        group = [col[0]]
        for item in col[1:] + [None]:
            if item is not None and item[3] - group[-1][3] < near:
                group.append(item)
                continue
            x0 = sum(p[2] for p in group) / len(group)
            for i, (k, F, x, _) in enumerate(group):
                out[(k, F)] = x0 - x + (i - (len(group) - 1) / 2) * step
            if item is not None:
                group = [item]
    return out


def write_svg(d: Data, path: str, panels: list[str]) -> None:
    pw, ph, left, top, gap = 360, 340, 80, 70, 60
    width = left + len(panels) * pw + (len(panels) - 1) * gap + 30
    legend_h = 24 * ((len(STYLE) + 2) // 3)
    height = top + ph + 60 + legend_h
    maps = [m for m in d.methods if m["family"] in STYLE]
    ys = [d.mean(m["key"], f, False) for m in maps for f in panels]
    ys += [d.uniform(f, False) for f in panels]
    ys = [y for y in ys if y and y > 0]
    # A little room beyond the extreme points, so that no marker sits on the frame.
    lo, hi = math.log10(min(ys)), math.log10(max(ys))
    e0, e1 = math.floor(lo - 0.02), math.ceil(hi + 0.02)
    if e1 == e0:
        e1 += 1
    xs = [m["F"] for m in maps]
    x0, x1 = math.floor(math.log2(min(xs))), math.ceil(math.log2(max(xs)))
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" '
         'font-size="13">',
         f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
         f'<text x="{width / 2:.0f}" y="26" text-anchor="middle" font-size="17" font-weight="bold">'
         'Feature maps against softmax attention: error vs number of features</text>',
         f'<text x="{width / 2:.0f}" y="46" text-anchor="middle" fill="#444">N = {d.N}, D = M = '
         f'{d.D}, float, '
         'non-causal; relative Frobenius error against exact softmax (double) — log-log</text>']
    for pi, fam in enumerate(panels):
        px = left + pi * (pw + gap)

        def X(F: float) -> float:
            return px + (math.log2(F) - x0) / (x1 - x0) * pw

        def Y(e: float) -> float:
            return top + ph - (math.log10(e) - e0) / (e1 - e0) * ph

        for e in range(e0, e1 + 1):
            y = Y(10.0 ** e)
            o.append(f'<line x1="{px}" y1="{y:.1f}" x2="{px + pw}" y2="{y:.1f}" stroke="#cccccc"/>')
            o.append(f'<text x="{px - 6}" y="{y + 4:.1f}" text-anchor="end">{decade(e)}</text>')
        for k in range(x0, x1 + 1):
            x = X(2.0 ** k)
            o.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" '
                     'stroke="#eeeeee"/>')
            if (k - x0) % 2 == 0 or x1 - x0 <= 7:
                o.append(f'<text x="{x:.1f}" y="{top + ph + 18}" '
                         f'text-anchor="middle">{2 ** k}</text>')
        o.append(f'<rect x="{px}" y="{top}" width="{pw}" height="{ph}" fill="none" '
                 'stroke="black"/>')
        o.append(f'<text x="{px + pw / 2:.0f}" y="{top - 8}" text-anchor="middle" '
                 'font-weight="bold">'
                 f'{escape(d.fam(fam)["label"])}</text>')
        o.append(f'<text x="{px + pw / 2:.0f}" y="{top + ph + 40}" text-anchor="middle" '
                 'font-size="14">'
                 'features F (Linformer: projected keys k)</text>')
        u = d.uniform(fam, False)
        o.append(f'<line x1="{px}" y1="{Y(u):.1f}" x2="{px + pw}" y2="{Y(u):.1f}" stroke="#888888" '
                 'stroke-dasharray="6,4"/>')
        o.append(f'<text x="{px + pw - 4}" y="{Y(u) - 5:.1f}" text-anchor="end" fill="#666">equal '
                 'weights</text>')
        points = {}
        for fam_key in STYLE:
            pts = [(m["F"], d.e(m["key"], fam, False)) for m in maps if m["family"] == fam_key]
            points[fam_key] = [(F, e) for F, e in pts if e and e["mean"] and e["mean"] > 0]
        dx = dodge([(k, F, X(F), Y(e["mean"])) for k, pts in points.items() for F, e in pts])

        def XD(k: str, F: float) -> float:
            return X(F) + dx.get((k, F), 0.0)

        for fam_key, (color, mk) in STYLE.items():
            pts = points[fam_key]
            if not pts:
                continue
            if len(pts) > 1:
                o.append('<path d="' + " ".join(f'{"M" if i == 0 else "L"}{XD(fam_key, F):.1f},'
                                                f'{Y(e["mean"]):.1f}'
                                                for i, (F, e) in enumerate(pts)) +
                         f'" fill="none" stroke="{color}" stroke-width="2"/>')
            for F, e in pts:
                if e["draws"] > 1 and e["sd"]:
                    lo, hi = max(e["mean"] - e["sd"], e["mean"] / 10), e["mean"] + e["sd"]
                    x = XD(fam_key, F)
                    o.append(f'<line x1="{x:.1f}" y1="{Y(lo):.1f}" x2="{x:.1f}" y2="{Y(hi):.1f}" '
                             f'stroke="{color}" stroke-width="1.5"/>')
                o.append(marker(mk, XD(fam_key, F), Y(e["mean"]), color))
            if fam_key == "favor" and len(pts) > 1:
                # The 1/√m line through the points' geometric centre.
                c = sum(math.log(e["mean"]) + 0.5 * math.log(F) for F, e in pts) / len(pts)
                fa, fb = pts[0][0] / 1.5, pts[-1][0] * 1.5
                o.append(f'<line x1="{X(fa):.1f}" y1="{Y(math.exp(c) / math.sqrt(fa)):.1f}" '
                         f'x2="{X(fb):.1f}" '
                         f'y2="{Y(math.exp(c) / math.sqrt(fb)):.1f}" stroke="{color}" '
                         'stroke-dasharray="3,3"/>')
                fit = favor_fit(d, fam, False)
                if fit:
                    o.append(f'<text x="{px + 8}" y="{top + ph - 10}" fill="{color}">'
                             f'FAVOR+ fitted slope {minus(fit[0])}; dashed ∝ 1/√m</text>')
    o.append(f'<text transform="translate(20,{top + ph / 2:.0f}) rotate(-90)" text-anchor="middle" '
             'font-size="14">relative error (log scale)</text>')
    ly = top + ph + 70
    present = [k for k in STYLE if any(m["family"] == k for m in maps)]
    for i, k in enumerate(present):
        color, mk = STYLE[k]
        lx = left + (i % 3) * 400
        yy = ly + (i // 3) * 24
        o.append(marker(mk, lx, yy - 4, color))
        o.append(f'<text x="{lx + 12}" y="{yy}">{escape(FAMILY_LABEL[k])}</text>')
    o.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(o) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", metavar="BIN", help="run this feature_map_quality binary first")
    ap.add_argument("--profile", default="quick", choices=("quick", "full", "smoke"),
                    help="the profile of --run")
    ap.add_argument("--errors", help="feature_map_quality --quality_out file (with --run: where it "
                                     "goes)")
    ap.add_argument("--timings", help="feature_map_quality's Google Benchmark JSON")
    ap.add_argument("--md", help="write this markdown file (docs/feature_maps.md)")
    ap.add_argument("--svg", help="write this SVG plot (docs/feature_maps_plot.svg)")
    ap.add_argument("--panels", default="gauss0.25,gauss1,outlier8", help="input families of the "
                                                                          "plot's panels")
    ap.add_argument("--command", default=DEFAULT_COMMAND, help="the command recorded in the "
                                                               "markdown")
    a = ap.parse_args()
    if a.run:
        tmp = tempfile.mkdtemp(prefix="feature_maps.")
        a.errors = a.errors or os.path.join(tmp, "feature_map_errors.json")
        a.timings = a.timings or os.path.join(tmp, "feature_map_quality.json")
        cmd = [a.run, f"--{a.profile}", f"--quality_out={a.errors}", f"--benchmark_out={a.timings}",
               "--benchmark_out_format=json"]
        print("==", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            print("feature_map_report.py: the program failed", file=sys.stderr)
            return 1
        if a.command == DEFAULT_COMMAND:
            a.command = " ".join(["python3", "benchmarks/feature_map_report.py"] + sys.argv[1:])
    elif not a.errors:
        ap.error("give --run BIN or --errors FILE")
    d = Data(a.errors, a.timings)
    panels = [p for p in a.panels.split(",") if any(f["key"] == p for f in d.families)]
    if not panels:
        panels = [d.families[0]["key"]]
    for line in findings(d):
        print(line)
    if a.svg:
        write_svg(d, a.svg, panels)
        print(f"wrote {a.svg}")
    if a.md:
        svg_name = os.path.relpath(a.svg, os.path.dirname(os.path.abspath(a.md))) if a.svg else None
        write_markdown(d, a.md, svg_name, a.command, panels)
        print(f"wrote {a.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
