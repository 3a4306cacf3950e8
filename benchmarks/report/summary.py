"""The summary of the performance targets: every section, in order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .delta import (
    TARGET_DELTA_CHUNKED_VS_PLAIN, TARGET_DELTA_DECODE, TARGET_DELTA_VS_TOKEN_LOOP, delta_section,
)
from .gated import TARGET_GATED_DECODE, TARGET_GATED_FEATURE, TARGET_GATED_SCALAR, gated_section
from .gradients import gradients
from .kernels import (
    decode_steps, linear_vs_softmax, two_threads, vs_gemm_causal, vs_gemm_linear, vs_gemm_softmax,
    working_memory,
)
from .layouts import TARGET_RET_VS_OUT, TARGET_ROW_VS_COL, returning_vs_out, row_vs_col, vs_paper
from .results import TARGET
from .roofline import roofline_section
from .serving import (
    TARGET_LOW_DECODE, TARGET_SPLIT_SPEEDUP, low_precision_section, serving_table, split_table,
)

if TYPE_CHECKING:
    from .results import Results


def summary(res: Results, roof_svg: str | None = None) -> tuple[list[str], list[str]]:
    """Markdown lines of the target summary, and warnings. `roof_svg`: the roofline plot to link
    from its section (relative to the Markdown file), if written."""
    L: list[str] = []
    warn: list[str] = []
    T = TARGET
    cfg = "float, 1 thread, H = 8, D = M = 64"

    def section(title: str):
        L.append("")
        L.append(f"**{title}**")
        L.append("")

    section("Roofline: this core's limits")
    L += roofline_section(res, roof_svg)

    # 1. Non-causal linear vs its GEMMs, N >= 4096.
    section(f"1. Non-causal linear attention vs the GEMMs of the same shapes, N ≥ 4096 ({cfg})")
    L += vs_gemm_linear(res)

    # 2. Causal linear vs GEMM, useful flops.
    section("2. Causal linear attention (library default, CausalAlgorithm::Auto: the recurrent "
            "kernel at "
            "this shape) vs the same GEMMs, "
            f"counting useful flops 4·N·F·M per head ({cfg})")
    L += vs_gemm_causal(res)

    # 3. Tiled softmax vs its GEMMs, N >= 2048.
    section(f"3. Tiled softmax vs the GEMMs of the same shapes (QKᵀ, PV), N ≥ 2048 ({cfg}; "
            "causal counts the useful half of the flops)")
    L += vs_gemm_softmax(res)

    # 4. Speed-up of linear over tiled softmax at N = 16384.
    section(f"4. Linear vs tiled softmax speed-up ({cfg})")
    L += linear_vs_softmax(res, warn)

    # 5. Decode step.
    section("5. Decode step, 8 heads, D = M = 64, one thread: recurrent state vs a softmax step "
            "over a KV cache")
    L += decode_steps(res)

    # 6. Working memory vs N.
    section("6. Working memory (Workspace::bytes() after the call) vs N")
    L += working_memory(res)

    # 7. Two threads.
    section("7. Multi-head forms at 2 threads vs 1 (wall time; H = 8, D = M = 64, float)")
    L += two_threads(res, warn)

    # 8. The paper's CPU algorithm, same run.
    section("8. linattn vs the paper's CPU algorithm, measured in the same run (float, 1 thread, H "
            "= 8, "
            "D = M = 64; speed-up = paper time ÷ linattn time)")
    L += vs_paper(res)

    # 9. Row-major vs column-major.
    section("9. Row-major vs column-major inputs: time ÷ time of the column-major packed call, "
            "wall (cpu) "
            f"(float, 1 thread, D = M = 64; target ≤ {TARGET_ROW_VS_COL:.2f})")
    L += row_vs_col(res, warn)

    # 10. Returning vs out-parameter forms.
    section("10. Returning form (new result and workspace per call) vs the out-parameter form "
            "with a reused "
            "workspace: time ratio, wall (cpu) (float, 1 thread, D = M = 64; target ≤ "
            f"{TARGET_RET_VS_OUT:.2f} "
            "at large N)")
    L += returning_vs_out(res, warn)

    # 11. Gradients.
    section(f"11. Gradients: forward, backward and forward + backward per call ({cfg}; "
            "GFLOP/s and % of GEMM are the backward's, useful flops)")
    L += gradients(res, warn)

    # 12. One sequence on two threads.
    section("12. One sequence on two threads (`split_pair_*`: ParallelOptions, spec §8), "
            "EluPlusOne, float, "
            f"one head, D = M = 64; target: causal ≥ {TARGET_SPLIT_SPEEDUP:.1f}× one thread at N = "
            "65536")
    L += split_table(res, warn)

    # 13. Serving many sequences.
    section("13. Serving: one decode step for B sequences × 8 heads (D = M = 64, float, "
            "EluPlusOne), tokens/s: "
            "`BatchedRecurrentLinearAttention::step` vs B "
            "`MultiHeadRecurrentLinearAttention::step` calls")
    L += serving_table(res)

    # 14. Decay and gates.
    section("14. Decay and gates (`bench_gated`): gated linear attention (Identity, normalize = "
            "false, "
            "log-gates in [−0.1, 0]) vs plain causal linear attention (EluPlusOne) of the same "
            "shape, float, 1 thread; "
            f"targets: scalar decay ≤ {TARGET_GATED_SCALAR:.1f}× plain causal, per-feature gates ≤ "
            f"{TARGET_GATED_FEATURE:.1f}×, decode step ≤ {TARGET_GATED_DECODE:.1f}× the plain "
            "recurrent step")
    L += gated_section(res, warn)

    # 15. The delta rule.
    section("15. The delta rule (`bench_delta`): Gated DeltaNet / DeltaNet (L2Normalize<Silu>, "
            "scale 1/√D, "
            "β in [0, 1], log-decays in [−0.1, 0] or none) vs plain causal linear attention "
            "(EluPlusOne) of the same "
            f"shape, float, 1 thread; targets: chunked ≤ {TARGET_DELTA_CHUNKED_VS_PLAIN:.1f}× "
            "plain causal, "
            f"the faster of Chunked and Auto ≥ {TARGET_DELTA_VS_TOKEN_LOOP:.1f}× the "
            "token-by-token recurrence written "
            "with Eigen, decode step ≤ "
            f"{TARGET_DELTA_DECODE:.1f}× the plain recurrent step")
    L += delta_section(res, warn)

    # 16. bf16 / half storage.
    section("16. bf16 and half storage (`bench_low_precision`): 8 heads, D = M = 64, EluPlusOne, 1 "
            "thread, "
            "row-major packed operands; computed in float; targets: prefill no slower than float, "
            "the decode step with "
            f"bf16 states at B = 64 ≥ {TARGET_LOW_DECODE:.1f}× the float step's tokens/s")
    L += low_precision_section(res, warn)
    return L, warn
