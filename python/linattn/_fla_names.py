"""flash-linear-attention's function names with FLA's arguments (order, names, defaults) and
returns, ``(o, final_state)``, over a set of operations: ``linattn``'s numpy functions
(``NumpyOps``) or ``linattn.torch``'s autograd functions. Arguments FLA has for its GPU kernels
only (cu_seqlens_cpu, chunk_size, disable_recompute, head_first=False, ...) are accepted and
change nothing; an option this library does not compute raises ``ValueError`` naming it.
"""

from __future__ import annotations

import numpy as np

from . import _fla

#: FLA's arguments that only steer its GPU kernels: accepted, whatever their value.
_KERNEL_ONLY = ("cu_seqlens_cpu", "chunk_size", "disable_recompute", "cp_context", "use_graph", "max_num_seqs",
                "chunk_indices")
#: FLA's options this library offers off only (their default): accepted when false.
_OFF_ONLY = ("head_first", "transpose_state_layout", "reverse", "return_intermediate_states",
             "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first")


class NumpyOps:
    """The operations of the names on numpy arrays (linattn.torch has the same on tensors)."""

    gated = staticmethod(_fla.gated)
    delta = staticmethod(_fla.delta)
    gate = staticmethod(_fla.gate)
    beta_sigmoid = staticmethod(_fla.beta_sigmoid)

    @staticmethod
    def per_head(q, v, fill: float):
        """[B, T, HV] of `fill` (no decay: 0; FLA's default beta: 1) in q's dtype."""
        q, v = np.asarray(q), np.asarray(v)
        return np.full(v.shape[:3], fill, q.dtype)

    @staticmethod
    def gamma(g_gamma, q, v):
        """simple GLA's data-independent log decay per head, [HV], broadcast to [B, T, HV]."""
        q, v = np.asarray(q), np.asarray(v)
        return np.broadcast_to(np.asarray(g_gamma, q.dtype).reshape(-1), v.shape[:3])

    @staticmethod
    def add_channels(g, gk):
        """A per-head decay g [B, T, HV] and per-channel ones gk [B, T, HV, K] as one."""
        return np.asarray(g)[..., None] + np.asarray(gk)

    @staticmethod
    def swap(s):
        """A state between FLA's [N, HV, V, K] (state_v_first) and [N, HV, K, V]."""
        return None if s is None else np.asarray(s).swapaxes(-1, -2)


def fla_names(ops, module: str) -> dict:
    """The names over `ops`, their errors prefixed with `module` (linattn or linattn.torch)."""

    def extras(fn, kwargs):
        for name, value in kwargs.items():
            if name in _KERNEL_ONLY or (name in _OFF_ONLY and not value):
                continue
            raise ValueError(f"{fn}: {name}={value!r} is not offered (FLA's argument for its own kernels)")

    def want(fn, name, x, ndim, shape):
        if x is None or len(np.shape(x)) != ndim:
            got = "None" if x is None else f"shape {tuple(np.shape(x))}"
            raise ValueError(f"{fn}: {name} must be {shape}, got {got}")

    def state_in(state_v_first, s):
        return ops.swap(s) if state_v_first else s

    def finish(state_v_first, result):
        o, ht = result
        return o, (ops.swap(ht) if state_v_first and ht is not None else ht)

    def betas(fn, q, v, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval):
        if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
            raise ValueError(f"{fn}: allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True (β = 2·sigmoid(beta))")
        if beta is None:
            return ops.per_head(q, v, 1.0)
        return ops.beta_sigmoid(fn, beta, allow_neg_eigval) if use_beta_sigmoid_in_kernel else beta

    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
        """GLA: S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ, o_t = scale·S_tᵀ q_t; g [B, T, HV, K] log gates."""
        fn = f"{module}.chunk_gla"
        extras(fn, kwargs)
        want(fn, "g", g, 4, "[B, T, HV, K] (per-channel log gates)")
        return ops.gated(fn, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)

    def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                            reverse=False, cu_seqlens=None, **kwargs):
        """chunk_gla with FLA's recurrent signature: gk [B, T, HV, K] (None: no decay); gv and
        reverse are not offered."""
        fn = f"{module}.fused_recurrent_gla"
        extras(fn, dict(kwargs, reverse=reverse))
        if gv is not None:
            raise ValueError(f"{fn}: gv (decays of the value channels) is not offered")
        if gk is None:
            gk = ops.per_head(q, v, 0.0)
        else:
            want(fn, "gk", gk, 4, "[B, T, HV, K] (per-channel log gates)")
        return ops.gated(fn, q, k, v, gk, scale, initial_state, output_final_state, cu_seqlens)

    def simple_gla(fn, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens):
        if g is not None and g_gamma is not None:
            raise ValueError(f"{fn}: pass g or g_gamma, not both")
        if g_gamma is not None:
            g = ops.gamma(g_gamma, q, v)
        elif g is None:
            g = ops.per_head(q, v, 0.0)
        want(fn, "g", g, 3, "[B, T, HV] (a log decay per token and head)")
        return ops.gated(fn, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)

    def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, **kwargs):
        """Simple GLA (RetNet, Mamba-2, Lightning): g [B, T, HV], or g_gamma [HV] for every token."""
        fn = f"{module}.chunk_simple_gla"
        extras(fn, kwargs)
        return simple_gla(fn, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens)

    def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                                   output_final_state=False, reverse=False, cu_seqlens=None, **kwargs):
        """chunk_simple_gla with FLA's recurrent signature (reverse is not offered)."""
        fn = f"{module}.fused_recurrent_simple_gla"
        extras(fn, dict(kwargs, reverse=reverse))
        return simple_gla(fn, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens)

    def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        """DeltaNet: S_t = S_{t-1} - β_t k_t (k_tᵀ S_{t-1}) + β_t k_t v_tᵀ, o_t = scale·S_tᵀ q_t;
        beta [B, T, HV]. use_qk_l2norm_in_kernel: q and k mapped by x / sqrt(|x|² + 1e-6) first."""
        fn = f"{module}.chunk_delta_rule"
        extras(fn, kwargs)
        return ops.delta(fn, q, k, v, beta, None, scale, initial_state, output_final_state, cu_seqlens,
                         bool(use_qk_l2norm_in_kernel))

    def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        """chunk_delta_rule; beta None: 1."""
        fn = f"{module}.fused_recurrent_delta_rule"
        extras(fn, kwargs)
        beta = ops.per_head(q, v, 1.0) if beta is None else beta
        return ops.delta(fn, q, k, v, beta, None, scale, initial_state, output_final_state, cu_seqlens,
                         bool(use_qk_l2norm_in_kernel))

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, **kwargs):
        """Gated DeltaNet, Qwen3-Next: the delta rule with S_{t-1} decayed by exp(g_t) first;
        g, beta [B, T, HV]. use_beta_sigmoid_in_kernel: beta holds logits, β = sigmoid(beta)
        (× 2 with allow_neg_eigval). state_v_first: states [N, HV, V, K]."""
        fn = f"{module}.chunk_gated_delta_rule"
        extras(fn, kwargs)
        want(fn, "g", g, 3, "[B, T, HV] (a log decay per token and head)")
        beta = betas(fn, q, v, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
        return finish(state_v_first, ops.delta(fn, q, k, v, beta, g, scale, state_in(state_v_first, initial_state),
                                               output_final_state, cu_seqlens, bool(use_qk_l2norm_in_kernel)))

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        """chunk_gated_delta_rule with FLA's recurrent signature: g [B, T, HV] and/or gk
        [B, T, HV, K] (per-channel, KDA's; both: their sum), beta None: 1; gv is not offered."""
        fn = f"{module}.fused_recurrent_gated_delta_rule"
        extras(fn, kwargs)
        if gv is not None:
            raise ValueError(f"{fn}: gv (decays of the value channels) is not offered")
        if g is not None:
            want(fn, "g", g, 3, "[B, T, HV] (a log decay per token and head)")
        if gk is not None:
            want(fn, "gk", gk, 4, "[B, T, HV, K] (a log decay per key channel)")
            g = gk if g is None else ops.add_channels(g, gk)
        beta = ops.per_head(q, v, 1.0) if beta is None else beta
        return ops.delta(fn, q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens,
                         bool(use_qk_l2norm_in_kernel))

    def kda(fn, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens):
        want(fn, "g", g, 4, "[B, T, HV, K] (a log decay per key channel)")
        if use_gate_in_kernel:
            g = ops.gate(fn, g, A_log, dt_bias, lower_bound)
        beta = betas(fn, q, v, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
        return finish(state_v_first, ops.delta(fn, q, k, v, beta, g, scale, state_in(state_v_first, initial_state),
                                               output_final_state, cu_seqlens, bool(use_qk_l2norm_in_kernel)))

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  **kwargs):
        """KDA (Kimi Linear): the delta rule with S_{t-1} decayed per key channel,
        diag(exp(g_t)) S_{t-1}; g [B, T, HV, K], beta [B, T, HV]. use_gate_in_kernel: g is the
        gate's raw input, g ← -exp(A_log)·softplus(g + dt_bias) (A_log [HV], dt_bias [HV·K] as
        keywords), or lower_bound·sigmoid(exp(A_log)·(g + dt_bias)) with lower_bound."""
        fn = f"{module}.chunk_kda"
        A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
        extras(fn, dict(kwargs, return_intermediate_states=return_intermediate_states))
        if safe_gate and use_gate_in_kernel and lower_bound is None:
            raise ValueError(f"{fn}: safe_gate=True with use_gate_in_kernel=True needs lower_bound")
        return kda(fn, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   lower_bound, state_v_first, cu_seqlens)

    def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                            state_v_first=False, cu_seqlens=None, **kwargs):
        """chunk_kda with FLA's recurrent signature (A_log and dt_bias positional)."""
        fn = f"{module}.fused_recurrent_kda"
        kwargs.pop("inplace_final_state", None)  # a GPU buffer reuse; the state returned is new
        extras(fn, kwargs)
        return kda(fn, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   lower_bound, state_v_first, cu_seqlens)

    return dict(chunk_gla=chunk_gla, fused_recurrent_gla=fused_recurrent_gla, chunk_simple_gla=chunk_simple_gla,
                fused_recurrent_simple_gla=fused_recurrent_simple_gla, chunk_delta_rule=chunk_delta_rule,
                fused_recurrent_delta_rule=fused_recurrent_delta_rule,
                chunk_gated_delta_rule=chunk_gated_delta_rule,
                fused_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule, chunk_kda=chunk_kda,
                fused_recurrent_kda=fused_recurrent_kda)
