"""linattn for PyTorch: the kernels as ``torch.autograd.Function``s, so that

    out = linattn.torch.causal_linear_attention(q, k, v)   # q, k, v: [B, T, H, D] CPU tensors
    out.sum().backward()                                    # q.grad, k.grad, v.grad

trains. Imported on its own (``import linattn.torch``), only when torch is installed. Arguments
and layouts are those of the numpy functions of ``linattn`` (docs there). CPU tensors of
float32 or float64; contiguous tensors are shared with the kernels without a copy (through
``Tensor.numpy()`` and ``torch.from_numpy``), others are made contiguous first (one copy).
CUDA (or any non-CPU) tensors raise ``ValueError``, other dtypes ``TypeError``; shape errors
raise ``ValueError`` with the C++ message. The backward passes are the library's gradient
kernels (first derivatives only).
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


def _tensors(*arrays):
    return tuple(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, feature_map, causal, cu_seqlens):
        fn = "linattn.torch.linear_attention"
        x = [_array(fn, n, t) for n, t in zip("qkv", (q, k, v))]
        ctx.save_for_backward(q, k, v)
        ctx.args = (feature_map, causal, cu_seqlens)
        return torch.from_numpy(_la.linear_attention(*x, feature_map, causal, cu_seqlens))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        fn = "linattn.torch.linear_attention"
        x = [_array(fn, n, t) for n, t in zip("qkv", ctx.saved_tensors)]
        g = _la.linear_attention_backward(*x, _array(fn, "dout", dout), *ctx.args)
        return (*_tensors(*g), None, None, None)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, cu_seqlens):
        fn = "linattn.torch.softmax_attention"
        x = [_array(fn, n, t) for n, t in zip("qkv", (q, k, v))]
        ctx.save_for_backward(q, k, v)
        ctx.args = (causal, cu_seqlens)
        return torch.from_numpy(_la.softmax_attention(*x, *ctx.args))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        fn = "linattn.torch.softmax_attention"
        x = [_array(fn, n, t) for n, t in zip("qkv", ctx.saved_tensors)]
        g = _la.softmax_attention_backward(*x, _array(fn, "dout", dout), *ctx.args)
        return (*_tensors(*g), None, None)


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, feature_map, scale, normalize, cu_seqlens):
        fn = "linattn.torch.gated_linear_attention"
        x = [_array(fn, n, t) for n, t in zip("qkvg", (q, k, v, g))]
        ctx.save_for_backward(q, k, v, g)
        ctx.args = (feature_map, scale, normalize, cu_seqlens)
        return torch.from_numpy(_la.gated_linear_attention(*x, *ctx.args))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        fn = "linattn.torch.gated_linear_attention"
        x = [_array(fn, n, t) for n, t in zip("qkvg", ctx.saved_tensors)]
        grads = _la.gated_linear_attention_backward(*x, _array(fn, "dout", dout), *ctx.args)
        return (*_tensors(*grads), None, None, None, None)


class _Delta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, g, feature_map, scale, cu_seqlens):
        fn = "linattn.torch.delta_rule_attention"
        x = [_array(fn, n, t) for n, t in zip(("q", "k", "v", "beta"), (q, k, v, beta))]
        ga = None if g is None else _array(fn, "g", g)
        ctx.has_g = g is not None
        ctx.save_for_backward(q, k, v, beta, *(() if g is None else (g,)))
        ctx.args = (feature_map, scale, cu_seqlens)
        return torch.from_numpy(_la.delta_rule_attention(*x, ga, *ctx.args))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        fn = "linattn.torch.delta_rule_attention"
        saved = ctx.saved_tensors
        x = [_array(fn, n, t) for n, t in zip(("q", "k", "v", "beta"), saved[:4])]
        ga = _array(fn, "g", saved[4]) if ctx.has_g else None
        grads = _la.delta_rule_attention_backward(*x, ga, _array(fn, "dout", dout), *ctx.args)
        return (*_tensors(*grads), None, None, None)


def linear_attention(q, k, v, feature_map: str = "elu", causal: bool = False, cu_seqlens=None):
    """linattn.linear_attention() on tensors, differentiable in q, k and v."""
    return _Linear.apply(q, k, v, str(feature_map), bool(causal), _offsets(cu_seqlens))


def causal_linear_attention(q, k, v, feature_map: str = "elu", cu_seqlens=None):
    """linear_attention(..., causal=True)."""
    return linear_attention(q, k, v, feature_map, True, cu_seqlens)


def softmax_attention(q, k, v, causal: bool = False, cu_seqlens=None):
    """linattn.softmax_attention() on tensors, differentiable in q, k and v."""
    return _Softmax.apply(q, k, v, bool(causal), _offsets(cu_seqlens))


def gated_linear_attention(q, k, v, g, feature_map: str = "identity", scale=None, normalize: bool = False,
                           cu_seqlens=None):
    """linattn.gated_linear_attention() on tensors, differentiable in q, k, v and g."""
    s = None if scale is None else float(scale)
    return _Gated.apply(q, k, v, g, str(feature_map), s, bool(normalize), _offsets(cu_seqlens))


def delta_rule_attention(q, k, v, beta, g=None, feature_map: str = "l2norm_silu", scale=None, cu_seqlens=None):
    """linattn.delta_rule_attention() on tensors, differentiable in q, k, v, beta and g."""
    s = None if scale is None else float(scale)
    return _Delta.apply(q, k, v, beta, g, str(feature_map), s, _offsets(cu_seqlens))
