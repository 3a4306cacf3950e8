"""Loading the Google Benchmark JSON: one Run per benchmark instance, and queries over them."""

from __future__ import annotations

import glob
import json
import os
import statistics

from .roof import Roofline


# The configuration of the performance targets.
TARGET = dict(dtype="f32", H="8", D="64", thr="1")

# Keys a benchmark name may omit, and what their absence means: column-major inputs, the
# out-parameter form with a reused workspace. Queries that do not name them get these values.
DEFAULTS = dict(layout="col", form="out")
LAYOUT_LABEL = {
    "col": "column-major packed N×(H·D)",
    "row": "row-major packed N×(H·D) (Map)",
    "hnd": "per-head row-major [H, N, D], one call per head",
    "hnd_batched": "[H, N, D] as one batched call (H sequences)",
}

# Which GEMM reference belongs to which kernel (same shape keys).
GEMM_OF = {
    "linear": "gemm_linear",
    "causal": "gemm_linear",
    "softmax": "gemm_softmax",
    "causal_softmax": "gemm_softmax",
    "mh_linear": "mh_gemm_linear",
    "mh_causal": "mh_gemm_linear",
    "mh_softmax": "mh_gemm_softmax",
    "mh_causal_softmax": "mh_gemm_softmax",
    "mh_paper_linear": "mh_gemm_linear",
    "mh_paper_causal": "mh_gemm_linear",
    # Gradients (bench_backward): every pass against the GEMMs of the backward's shapes.
    "mh_train_linear": "mh_gemm_linear_bwd",
    "mh_train_causal": "mh_gemm_linear_bwd",
    "mh_train_softmax": "mh_gemm_softmax_bwd",
    "mh_train_causal_softmax": "mh_gemm_softmax_bwd",
    # Decay and gates (bench_gated): its own GEMM reference, D = M = 64 and 128, same run.
    "gt_gated": "gt_gemm_linear",
    "gt_causal": "gt_gemm_linear",
    # The delta rule (bench_delta): its own GEMM reference, D = M = 64 and 128, same run.
    "dl_delta": "dl_gemm_linear",
    "dl_causal": "dl_gemm_linear",
}
SHAPE_KEYS = ("dtype", "H", "D", "thr")
UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
SHORT_LAYOUT = {"row": "row-major", "hnd": "[H, N, D] per head", "hnd_batched": "[H, N, D] batched",
                "col": "column-major"}


class Run:
    """One benchmark instance (one size)."""

    def __init__(self, entry: dict, program: str):
        self.name = entry["name"]
        self.program = program
        # Options Google Benchmark writes into the name are not parameters of the kernel.
        parts = [p for p in self.name.split("/")
                 if p not in ("real_time",
                              "manual_time") and not p.startswith(("min_warmup_time:", "repeats:"))]
        self.kind = parts[0]
        self.params: dict[str, str] = {}
        for p in parts[1:]:
            k, _, v = p.partition(":")
            self.params[k] = v
        self.params.setdefault("H", "1")
        self.params.setdefault("thr", "1")
        for k, v in DEFAULTS.items():
            self.params.setdefault(k, v)
        # The swept argument: N (sequence length), pos (decode position) or B (sequences served).
        self.size = int(self.params.pop("N", self.params.pop("pos", self.params.pop("B", "0"))))
        unit = UNIT_S[entry.get("time_unit", "ns")]
        self.wall = float(entry["real_time"]) * unit
        self.cpu = float(entry["cpu_time"]) * unit
        self.iterations = int(entry.get("iterations", 0))
        self.counters = {k: v for k, v in entry.items() if isinstance(v, (int, float))}
        self.label = str(entry.get("label", ""))
        self.error = entry.get("error_message") if entry.get("error_occurred") else None

    def get(self, key: str, default=None):
        return self.counters.get(key, default)

    @property
    def flops(self) -> float:
        return float(self.counters.get("flops", 0.0))

    def gflops(self, cpu: bool = False) -> float | None:
        t = self.cpu if cpu else self.wall
        return self.flops / t * 1e-9 if t > 0 and self.flops > 0 else None

    def family(self) -> tuple:
        return (self.kind,) + tuple(sorted(self.params.items()))


class Results:
    def __init__(self, directory: str):
        self.runs: list[Run] = []
        # bench_roofline's runs: this core's limits, kept out of the kernels' tables.
        roof_runs: list[Run] = []
        self.fits: list[dict] = []
        self.contexts: dict[str, dict] = {}
        self.errors: list[str] = []
        files = sorted(glob.glob(os.path.join(directory, "*.json")))
        for path in files:
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                self.errors.append(f"{os.path.basename(path)}: unreadable ({e})")
                continue
            if "benchmarks" not in data:
                continue
            program = os.path.splitext(os.path.basename(path))[0]
            self.contexts[program] = data.get("context", {})
            for e in data["benchmarks"]:
                if e.get("run_type") == "aggregate":
                    if e.get("aggregate_name") in ("BigO", "RMS"):
                        self.fits.append(e)
                    if e.get("aggregate_name") != "median":
                        continue
                    # A repeated benchmark stands for its median; the repetitions are skipped.
                    e = dict(e, name=e["run_name"])
                elif int(e.get("repetitions", 1)) > 1:
                    continue
                r = Run(e, program)
                if r.error:
                    self.errors.append(f"{r.name}: {r.error}")
                    continue
                (roof_runs if r.kind.startswith("roofline_") else self.runs).append(r)
        self.roof = Roofline(roof_runs, self.contexts)
        self.index: dict[tuple, Run] = {}
        for r in self.runs:
            self.index[r.family() + (("size", r.size),)] = r

    def find(self, kind: str, size: int, **params) -> Run | None:
        """The run of `kind` at `size` whose params include `params` (first match); layout and
        form default to DEFAULTS (column-major, out-parameter form)."""
        params = {**DEFAULTS, **params}
        for r in self.runs:
            if r.kind == kind and r.size == size and all(r.params.get(k) == v for k,
                                                         v in params.items()):
                return r
        return None

    def sizes(self, kind: str, **params) -> list[int]:
        params = {**DEFAULTS, **params}
        return sorted({r.size for r in self.runs if r.kind == kind
                       and all(r.params.get(k) == v for k, v in params.items())})

    def gemm_for(self, r: Run) -> Run | None:
        g = GEMM_OF.get(r.kind)
        if not g:
            return None
        shape = {k: r.params[k] for k in SHAPE_KEYS if k in r.params}
        return self.find(g, r.size, **shape, **DEFAULTS)

    def context(self) -> dict:
        for c in self.contexts.values():
            return c
        return {}


def frac_of_gemm(res: Results, r: Run, cpu: bool = False) -> float | None:
    g = res.gemm_for(r)
    if g is None:
        return None
    a, b = r.gflops(cpu), g.gflops(cpu)
    return a / b if a and b else None


def gt_find(res: Results, kind: str, n: int, chunk: str | None = None, **params) -> Run | None:
    """Like Results.find, but a run with a chunk key matches only when asked for that chunk (the
    chunk sweep
    must not stand in for the default chunk)."""
    params = {**DEFAULTS, **params}
    for r in res.runs:
        if r.kind == kind and r.size == n and r.params.get("chunk") == chunk and \
                all(r.params.get(k) == v for k, v in params.items()):
            return r
    return None


def large_sizes(ns: list[int]) -> list[int]:
    """N ≥ 1024 (where per-call overheads no longer dominate), or every N when none is that
    large."""
    big = [n for n in ns if n >= 1024]
    return big or list(ns)


def contention(res: Results) -> tuple[float | None, str]:
    """Median cpu/wall of the single-thread runs: < 1 means the process waited for a core."""
    ratios = [r.cpu / r.wall for r in res.runs
              if r.params.get("thr",
                              "1") == "1" and r.wall > 0 and not r.kind.startswith("split_pair")]
    if not ratios:
        return None, ""
    med = statistics.median(ratios)
    note = (f"Median cpu/wall time of the single-thread runs: {med:.2f}" +
            (" — the machine was busy (other processes held the cores), so wall times are inflated "
             "and "
             "noisy; the cpu-time columns are closer to an idle machine's." if med < 0.9 else "."))
    return med, note
