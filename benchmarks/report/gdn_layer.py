"""The Gated DeltaNet layer of Qwen3-Next (bench_gdn_layer): prefill and decode tokens/s and the
time split of a prefill. A generated block of its own in docs/benchmarks.md (bench:gdn_layer),
with the run it came from named in it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .kda import run_line
from .layer_tables import Split, decode_table, prefill_table, split_tables

if TYPE_CHECKING:
    from .results import Results


# The target: the convolution, gates and norm together add at most this fraction of the
# projections' and recurrence's time to the layer's prefill.
TARGET_CGN = 0.15

PARTS = ("proj", "gather", "conv", "gates", "rec", "norm")
PART_LABEL = {
    "proj": "projections (X·in_proj_qkvzᵀ, X·in_proj_baᵀ, o·out_projᵀ)",
    "gather": "gather (interleaved projections → packed q, k, v, z, b, a)",
    "conv": "short convolution (`batched_short_convolution`, SiLU)",
    "gates": "gates (`beta_activation`, `gate_activation`)",
    "rec": "recurrence (`batched_delta_rule_attention`)",
    "norm": "gated norm (`gated_rms_norm`)",
}


def _shape(res: Results) -> str:
    r = next((r for r in res.runs if r.kind.startswith("gdn_")), None)
    if r is None:
        return "?"
    p = r.params
    return (f"hidden {p.get('hidden', '?')}, {p.get('Hk', '?')} query/key heads and "
            f"{p.get('Hv', '?')} value heads of {p.get('D', '?')}")


def gdn_layer_section(res: Results, warn: list[str],
                      command: str = "bench_gdn_layer --full") -> list[str]:
    if not any(r.kind.startswith("gdn_") for r in res.runs):
        return ["(no bench_gdn_layer runs in these results)"]
    L = run_line(res, "bench_gdn_layer", command) + [""]
    L += prefill_table(
        res, "gdn_prefill",
        f"Prefill: `forward(X)` of one new sequence of N tokens ({_shape(res)}; medians of "
        "the repetitions): time per call, tokens/s, useful GFLOP/s (the three products and "
        "the recurrence's 4·Dk·Dv per value head and token) and their fraction of the FMA "
        "peak of the same threads, measured in the same process. forward() takes no "
        "ParallelOptions: its threads are OpenMP's (the recurrence) and Eigen's (the "
        "products), both set to the count given.")
    L += [""] + decode_table(res, "gdn_decode")
    L += split_tables(res, Split("gdn", PARTS, PART_LABEL, "Gated DeltaNet", TARGET_CGN), warn)
    return L
