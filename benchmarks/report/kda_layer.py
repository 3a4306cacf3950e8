"""The KDA layer of Kimi Linear (bench_kda_layer): prefill and decode tokens/s and the time split
of a prefill. A generated block of its own in docs/benchmarks.md (bench:kda_layer), with the run
it came from named in it; the tables are bench_gdn_layer's (layer_tables.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .gdn_layer import TARGET_CGN
from .kda import run_line
from .layer_tables import Split, decode_table, prefill_table, split_tables

if TYPE_CHECKING:
    from .results import Results


PREFIX = "kda_layer"
PARTS = ("proj", "lowrank", "conv", "gates", "rec", "norm", "oproj")
PART_LABEL = {
    "proj": "input projections (X·q_projᵀ, X·k_projᵀ, X·v_projᵀ, X·b_projᵀ)",
    "lowrank": "low-rank gate projections ((X·f_a_projᵀ)·f_b_projᵀ, (X·g_a_projᵀ)·g_b_projᵀ)",
    "conv": "short convolutions of q, k, v (`batched_short_convolution`, SiLU)",
    "gates": "gates (`beta_activation`, `gate_activation` per key channel)",
    "rec": "recurrence, per-channel decay (`batched_delta_rule_attention`)",
    "norm": "gated norm (`gated_rms_norm`, sigmoid gate)",
    "oproj": "output projection (o·o_projᵀ)",
}


def _shape(res: Results) -> str:
    r = next((r for r in res.runs if r.kind.startswith(PREFIX + "_")), None)
    if r is None:
        return "?"
    p = r.params
    return (f"hidden {p.get('hidden', '?')}, {p.get('H', '?')} heads of {p.get('D', '?')}, "
            f"gates of rank {p.get('D', '?')}")


def kda_layer_section(res: Results, warn: list[str],
                      command: str = "bench_kda_layer --full") -> list[str]:
    if not any(r.kind.startswith(PREFIX + "_") for r in res.runs):
        return ["(no bench_kda_layer runs in these results)"]
    L = run_line(res, "bench_kda_layer", command) + [""]
    L += prefill_table(
        res, f"{PREFIX}_prefill",
        f"Prefill: `forward(X)` of one new sequence of N tokens ({_shape(res)}; medians of "
        "the repetitions): time per call, tokens/s, useful GFLOP/s (the input, low-rank gate "
        "and output products and the recurrence's 4·K·V per head and token) and their fraction "
        "of the FMA peak of the same threads, measured in the same process. forward() takes no "
        "ParallelOptions: its threads are OpenMP's (the recurrence) and Eigen's (the "
        "products), both set to the count given.")
    L += [""] + decode_table(res, f"{PREFIX}_decode")
    L += split_tables(res, Split(PREFIX, PARTS, PART_LABEL, "KDA layer", TARGET_CGN,
                                 base="projections + recurrence",
                                 minus="projections − recurrence",
                                 beyond="its projections (input, low-rank, output) and recurrence",
                                 flops_of="the products and the recurrence"), warn)
    return L
