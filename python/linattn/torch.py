"""linattn for PyTorch: the kernels as ``torch.autograd.Function``s, so that

    out = linattn.torch.causal_linear_attention(q, k, v)   # q, k, v: [B, T, H, D] CPU tensors
    out.sum().backward()                                    # q.grad, k.grad, v.grad

trains. Imported on its own (``import linattn.torch``), only when torch is installed. Arguments
and layouts are those of the numpy functions of ``linattn`` (docs there). CPU tensors of
float32 or float64; contiguous tensors are shared with the kernels without a copy (through
``Tensor.numpy()`` and ``torch.from_numpy``), others are made contiguous first (one copy).
CUDA (or any non-CPU) tensors raise ``ValueError``, other dtypes ``TypeError``; shape and value
errors raise ``ValueError`` naming the numpy function, the argument and the shapes (the numpy
functions' checks). The backward passes are the library's gradient kernels (first derivatives
only). Normalised attention gives zero rows where a denominator is degenerate (negative ones
included) and linattn keeps its own thread count beside torch's: see the numpy module's docs.

The FLA names (chunk_gla, ..., chunk_kda) return ``(o, final_state)`` and are differentiable in
initial_state too (and in KDA's A_log and dt_bias); they also take bfloat16 and float16 tensors,
computed in float32, o returned in q's dtype and the state in float32 (docs/python.md).

The 2026 layers as modules, ``ShortConvolution``, ``FusedRMSNormGated``, ``GatedDeltaNet`` and
``KimiDeltaAttention`` (with the functions ``short_convolution`` and ``gated_rms_norm``), are
linattn.nn's, exported here.
"""

from __future__ import annotations

import numpy as np
import torch

import linattn as _la

__all__ = [
    "linear_attention",
    "causal_linear_attention",
    "softmax_attention",
    "gated_linear_attention",
    "delta_rule_attention",
    "chunk_gla",
    "fused_recurrent_gla",
    "chunk_simple_gla",
    "fused_recurrent_simple_gla",
    "chunk_delta_rule",
    "fused_recurrent_delta_rule",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "chunk_kda",
    "fused_recurrent_kda",
    # linattn.nn, loaded on first use (it runs the functions above):
    "short_convolution",
    "gated_rms_norm",
    "ShortConvolution",
    "FusedRMSNormGated",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "LayerState",
    "LayerDecodeState",
]

_DTYPES = (torch.float32, torch.float64)


def _array(fn: str, name: str, t):
    """A CPU tensor as a numpy array sharing its memory (a contiguous copy if it is not)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} is on device '{t.device}'; linattn runs on the CPU "
                         f"(move it with .cpu())")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{fn}: {name} must be float32 or float64, got {t.dtype}")
    return t.detach().contiguous().numpy()


def _offsets(cu_seqlens):
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens.detach().cpu().numpy().astype(np.int64)
    return np.asarray(cu_seqlens, dtype=np.int64)


def _mask(fn: str, m):
    """A key padding mask (True = padding) as a numpy bool array; it takes no gradient."""
    if m is None:
        return None
    if isinstance(m, torch.Tensor):
        if m.dtype != torch.bool:
            raise TypeError(f"{fn}: key_padding_mask must be a bool tensor (True = padding), got {m.dtype}")
        return m.detach().cpu().numpy()
    return np.asarray(m)


def _tensors(*arrays):
    return tuple(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)


class _Kernel(torch.autograd.Function):
    """One of linattn's numpy functions `fwd` and its gradient `bwd` (which takes the same
    arrays, then dout, and returns one gradient per array) as an autograd function of the
    tensors (None: an absent optional input, such as the delta rule's g)."""

    @staticmethod
    def forward(ctx, fwd, bwd, names, options, *tensors):
        ctx.fn = f"linattn.torch.{fwd.__name__}"
        ctx.bwd, ctx.names, ctx.options = bwd, names, options
        ctx.absent = [t is None for t in tensors]
        ctx.save_for_backward(*(t for t in tensors if t is not None))
        arrays = [None if t is None else _array(ctx.fn, n, t) for n, t in zip(names, tensors)]
        return torch.from_numpy(fwd(*arrays, **options))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        saved = iter(ctx.saved_tensors)
        tensors = [None if absent else next(saved) for absent in ctx.absent]
        arrays = [None if t is None else _array(ctx.fn, n, t) for n, t in zip(ctx.names, tensors)]
        grads = ctx.bwd(*arrays, _array(ctx.fn, "dout", dout), **ctx.options)
        return (None, None, None, None, *_tensors(*grads))


def linear_attention(q, k, v, feature_map: str = "elu", causal: bool = False, cu_seqlens=None,
                     key_padding_mask=None):
    """linattn.linear_attention() on tensors, differentiable in q, k and v (the decoding
    arguments initial_state / output_final_state are the numpy function's: inference only).
    q and k may have Hk heads shared by v's H (GVA, Hk dividing H); their gradients are summed
    over the value heads that read them, as autograd sums them through repeat_interleave."""
    options = dict(feature_map=str(feature_map), causal=bool(causal), cu_seqlens=_offsets(cu_seqlens),
                   key_padding_mask=_mask("linattn.torch.linear_attention", key_padding_mask))
    return _Kernel.apply(_la.linear_attention, _la.linear_attention_backward, "qkv", options, q, k, v)


def causal_linear_attention(q, k, v, feature_map: str = "elu", cu_seqlens=None, key_padding_mask=None):
    """linear_attention(..., causal=True)."""
    return linear_attention(q, k, v, feature_map, True, cu_seqlens, key_padding_mask)


def softmax_attention(q, k, v, causal: bool = False, cu_seqlens=None, key_padding_mask=None):
    """linattn.softmax_attention() on tensors, differentiable in q, k and v."""
    options = dict(causal=bool(causal), cu_seqlens=_offsets(cu_seqlens),
                   key_padding_mask=_mask("linattn.torch.softmax_attention", key_padding_mask))
    return _Kernel.apply(_la.softmax_attention, _la.softmax_attention_backward, "qkv", options, q, k, v)


def gated_linear_attention(q, k, v, g, feature_map: str = "identity", scale=None, normalize: bool = False,
                           cu_seqlens=None):
    """linattn.gated_linear_attention() on tensors, differentiable in q, k, v and g."""
    options = dict(feature_map=str(feature_map), scale=None if scale is None else float(scale),
                   normalize=bool(normalize), cu_seqlens=_offsets(cu_seqlens))
    return _Kernel.apply(_la.gated_linear_attention, _la.gated_linear_attention_backward, "qkvg", options,
                         q, k, v, g)


def delta_rule_attention(q, k, v, beta, g=None, feature_map: str = "l2norm_silu", scale=None, cu_seqlens=None,
                         l2norm_eps: float = 0.0):
    """linattn.delta_rule_attention() on tensors, differentiable in q, k, v, beta and g (the map,
    its l2norm_eps and which model uses which: docs there)."""
    options = dict(feature_map=str(feature_map), scale=None if scale is None else float(scale),
                   cu_seqlens=_offsets(cu_seqlens), l2norm_eps=float(l2norm_eps))
    return _Kernel.apply(_la.delta_rule_attention, _la.delta_rule_attention_backward,
                         ("q", "k", "v", "beta", "g"), options, q, k, v, beta, g)


# flash-linear-attention's names (docs/python.md), differentiable in q, k, v, g, beta, the gate's
# parameters and initial_state; bfloat16 and float16 tensors are computed in float32.
_FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _compute_dtype(q):
    return torch.float64 if isinstance(q, torch.Tensor) and q.dtype == torch.float64 else torch.float32


def _fla_array(fn: str, name: str, t, dtype):
    """A tensor (or None) as a numpy array of the call's compute dtype."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} is on device '{t.device}'; linattn runs on the CPU (move it with .cpu())")
    if t.dtype not in _FLA_DTYPES:
        raise TypeError(f"{fn}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    return t.detach().to(dtype).contiguous().numpy()


def _like(a, t):
    """A numpy result as a tensor of t's dtype (None for None)."""
    return None if a is None or t is None else torch.from_numpy(np.ascontiguousarray(a)).to(t.dtype)


class _FlaKernel(torch.autograd.Function):
    """One FLA call (o, final state) of linattn._fla's `kind` ("gated" or "delta") on tensors
    q, k, v, beta (delta), g, initial_state (None: absent); backward through its gradients."""

    @staticmethod
    def forward(ctx, kind, fn, options, q, k, v, beta, g, h0):
        ctx.set_materialize_grads(False)
        ctx.kind, ctx.fn, ctx.options = kind, fn, options
        ctx.dtype = _compute_dtype(q)
        tensors = (q, k, v, beta, g, h0)
        ctx.absent = [t is None for t in tensors]
        ctx.save_for_backward(*(t for t in tensors if t is not None))
        a = [_fla_array(fn, n, t, ctx.dtype) for n, t in zip(("q", "k", "v", "beta", "g", "initial_state"), tensors)]
        o = options
        if kind == "gated":
            out, ht = _la._fla.gated(fn, a[0], a[1], a[2], a[4], o["scale"], a[5], o["want_final"], o["cu_seqlens"])
        else:
            out, ht = _la._fla.delta(fn, a[0], a[1], a[2], a[3], a[4], o["scale"], a[5], o["want_final"],
                                     o["cu_seqlens"], o["l2norm"])
        # FLA returns o in q's dtype and the state in float32 (here: the compute dtype).
        return _like(out, q), None if ht is None else torch.from_numpy(ht)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        saved = iter(ctx.saved_tensors)
        q, k, v, beta, g, h0 = (None if absent else next(saved) for absent in ctx.absent)
        fn, o, dt = ctx.fn, ctx.options, ctx.dtype
        a = [_fla_array(fn, n, t, dt) for n, t in zip(("q", "k", "v", "beta", "g", "initial_state"),
                                                        (q, k, v, beta, g, h0))]
        d_o = torch.zeros(v.shape, dtype=dt).numpy() if do is None else _fla_array(fn, "do", do, dt)
        d_ht = _fla_array(fn, "dht", dht, dt)
        if ctx.kind == "gated":
            dq, dk, dv, dg, dh0 = _la._fla.gated_backward(fn, a[0], a[1], a[2], a[4], d_o, o["scale"], a[5], d_ht,
                                                           o["cu_seqlens"])
            db = None
        else:
            dq, dk, dv, db, dg, dh0 = _la._fla.delta_backward(fn, a[0], a[1], a[2], a[3], a[4], d_o, o["scale"],
                                                               a[5], d_ht, o["cu_seqlens"], o["l2norm"])
        return (None, None, None, _like(dq, q), _like(dk, k), _like(dv, v), _like(db, beta), _like(dg, g),
                _like(dh0, h0))


class _KdaGate(torch.autograd.Function):
    """KDA's log decays from the gate's raw input and A_log, dt_bias (core/gates.hpp)."""

    @staticmethod
    def forward(ctx, fn, lower_bound, g, A_log, dt_bias):
        ctx.fn, ctx.lower_bound = fn, lower_bound
        ctx.absent = [t is None for t in (A_log, dt_bias)]
        ctx.save_for_backward(*(t for t in (g, A_log, dt_bias) if t is not None))
        dt = _compute_dtype(g)
        a = [_fla_array(fn, n, t, dt) for n, t in (("g", g), ("A_log", A_log), ("dt_bias", dt_bias))]
        return torch.from_numpy(_la._fla.gate(fn, a[0], a[1], a[2], lower_bound))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dgk):
        saved = iter(ctx.saved_tensors)
        g = next(saved)
        A_log, dt_bias = (None if absent else next(saved) for absent in ctx.absent)
        dt = _compute_dtype(g)
        a = [_fla_array(ctx.fn, n, t, dt) for n, t in (("g", g), ("A_log", A_log), ("dt_bias", dt_bias))]
        dg, dA, db = _la._fla.gate_backward(ctx.fn, a[0], a[1], a[2], ctx.lower_bound, dgk.detach().to(dt).numpy())
        return None, None, _like(dg, g), _like(dA, A_log), _like(db, dt_bias)


class TorchOps:
    """linattn._fla_names' operations on tensors."""

    @staticmethod
    def gated(fn, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
        options = dict(scale=None if scale is None else float(scale), want_final=bool(output_final_state),
                       cu_seqlens=_offsets(cu_seqlens))
        return _FlaKernel.apply("gated", fn, options, q, k, v, None, g, initial_state)

    @staticmethod
    def delta(fn, q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens, l2norm):
        options = dict(scale=None if scale is None else float(scale), want_final=bool(output_final_state),
                       cu_seqlens=_offsets(cu_seqlens), l2norm=bool(l2norm))
        return _FlaKernel.apply("delta", fn, options, q, k, v, beta, g, initial_state)

    @staticmethod
    def gate(fn, g, A_log, dt_bias, lower_bound):
        return _KdaGate.apply(fn, None if lower_bound is None else float(lower_bound), g, A_log, dt_bias)

    @staticmethod
    def beta_sigmoid(fn, beta, times_two):
        b = torch.sigmoid(beta.to(_compute_dtype(beta)))
        return 2 * b if times_two else b

    @staticmethod
    def per_head(q, v, fill):
        return torch.full(tuple(v.shape[:3]), fill, dtype=_compute_dtype(q))

    @staticmethod
    def gamma(g_gamma, q, v):
        return torch.as_tensor(g_gamma).reshape(-1).expand(tuple(v.shape[:3]))

    @staticmethod
    def add_channels(g, gk):
        return g.unsqueeze(-1) + gk

    @staticmethod
    def swap(s):
        return None if s is None else s.transpose(-1, -2)


_fla_funcs = _la._fla_names(TorchOps, "linattn.torch")
chunk_gla = _fla_funcs["chunk_gla"]
fused_recurrent_gla = _fla_funcs["fused_recurrent_gla"]
chunk_simple_gla = _fla_funcs["chunk_simple_gla"]
fused_recurrent_simple_gla = _fla_funcs["fused_recurrent_simple_gla"]
chunk_delta_rule = _fla_funcs["chunk_delta_rule"]
fused_recurrent_delta_rule = _fla_funcs["fused_recurrent_delta_rule"]
chunk_gated_delta_rule = _fla_funcs["chunk_gated_delta_rule"]
fused_recurrent_gated_delta_rule = _fla_funcs["fused_recurrent_gated_delta_rule"]
chunk_kda = _fla_funcs["chunk_kda"]
fused_recurrent_kda = _fla_funcs["fused_recurrent_kda"]


_NN_NAMES = ("short_convolution", "gated_rms_norm", "ShortConvolution", "FusedRMSNormGated", "GatedDeltaNet",
             "KimiDeltaAttention", "LayerState", "LayerDecodeState")


def __getattr__(name):
    # linattn.nn imports this module for the FLA names: loaded here on first use, not at import.
    if name in _NN_NAMES:
        from . import nn

        return getattr(nn, name)
    raise AttributeError(f"module 'linattn.torch' has no attribute {name!r}")
