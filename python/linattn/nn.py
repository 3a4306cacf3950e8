"""The 2026 layers as ``torch.nn.Module``s (exported from ``linattn.torch``): the pieces under
flash-linear-attention's names, ``ShortConvolution`` and ``FusedRMSNormGated``, and the layers
with their checkpoints' parameter names, ``GatedDeltaNet`` (transformers'
``Qwen3NextGatedDeltaNet``) and ``KimiDeltaAttention`` (Kimi Linear's), so that
``load_state_dict`` takes those modules' state dicts as they are. CPU tensors of float32 or
float64, or bfloat16 / float16 (``module.to(torch.bfloat16)``: the convolution, the norm, the
gates and the delta rule computed in float32, as linattn.torch's FLA names do, each result
returned in its input's dtype and each gradient in its parameter's; the linear projections are
torch's in that dtype); every step differentiable (the convolution and the norm through the C++
backward, the delta rule through linattn.torch's FLA names).

The functions ``short_convolution`` and ``gated_rms_norm`` are the autograd functions the modules
run (layers/short_convolution.hpp and layers/gated_rms_norm.hpp of the C++ library).

The layers also decode one token per sequence: ``make_state`` (a ``LayerDecodeState``: the
convolution caches and a linattn.DeltaRuleDecoder of the heads) and ``step``, equal to forward
over the whole sequences.

Convolution states are FLA's and transformers' conv cache, ``[N, C, W]``: the last W inputs of
each of the N sequences, oldest first (column 0 is never read: a continuation needs W − 1).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch import nn

import linattn as _la

from . import _linattn as _ext

__all__ = [
    "short_convolution",
    "gated_rms_norm",
    "ShortConvolution",
    "FusedRMSNormGated",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "LayerState",
    "LayerDecodeState",
]

# bfloat16 / float16 are computed in float32 (the C++ kernels' float) and returned so.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CONV_ACTIVATIONS = {None: False, "identity": False, "silu": True, "swish": True}
_NORM_ACTIVATIONS = {"silu": True, "swish": True, "sigmoid": False}


def _check(fn: str, name: str, t, shapes: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__} ({shapes})")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} is on device '{t.device}'; linattn runs on the CPU ({shapes})")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{fn}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype} ({shapes})")


def _same_dtype(fn: str, shapes: str, **named):
    dtypes = {n: t.dtype for n, t in named.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"{fn}: {', '.join(dtypes)} must share one dtype, got {listed} ({shapes})")


def _shapes(**named) -> str:
    return ", ".join(f"{n} {tuple(t.shape)}" for n, t in named.items() if isinstance(t, torch.Tensor))


def _compute(t):
    """The dtype the kernels compute t's call in: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _np(t, dtype):
    return None if t is None else t.detach().to(dtype).contiguous().numpy()


def _tensor(a, like):
    """A kernel's result as a tensor of `like`'s dtype (None for None)."""
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(like.dtype)


class _ShortConv(torch.autograd.Function):
    """y rows (N x C) of the packed rows x, weight C x W, bias C or None, h0 [B, W − 1, C] or None."""

    @staticmethod
    def forward(ctx, x, weight, bias, h0, offsets, silu):
        ctx.offsets, ctx.silu = offsets, silu
        ctx.absent = [t is None for t in (bias, h0)]
        ctx.save_for_backward(*(t for t in (x, weight, bias, h0) if t is not None))
        dt = _compute(x)
        y, _ = _ext.conv_forward(_np(x, dt), _np(weight, dt), _np(bias, dt), offsets, _np(h0, dt), silu)
        return _tensor(y, x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        saved = iter(ctx.saved_tensors)
        x, weight = next(saved), next(saved)
        bias, h0 = (None if absent else next(saved) for absent in ctx.absent)
        dt = _compute(x)
        dx, dw, db, dh0 = _ext.conv_backward(_np(x, dt), _np(weight, dt), _np(bias, dt), ctx.offsets, _np(h0, dt),
                                             _np(dy, dt), ctx.silu)
        return _tensor(dx, x), _tensor(dw, weight), _tensor(db, bias), _tensor(dh0, h0), None, None


def short_convolution(x, weight, bias=None, activation: Optional[str] = "silu", initial_state=None,
                      output_final_state: bool = False, cu_seqlens=None):
    """The depthwise causal convolution y_t = act(bias + Σ_i weight[:, 0, i] ⊙ x_{t−(W−1)+i}) of
    x [B, T, C] (with cu_seqlens: B = 1 and the T rows are the packed sequences), weight
    [C, 1, W] (nn.Conv1d(C, C, W, groups=C)'s) or [C, W], bias [C] or None, activation "silu"
    or None; inputs before a sequence's first token from initial_state [N, C, W] (zeros when
    None). Returns (y [B, T, C], final_state [N, C, W] or None), differentiable in x, weight,
    bias and initial_state."""
    fn = "linattn.torch.short_convolution"
    shapes = _shapes(x=x, weight=weight, bias=bias, initial_state=initial_state)
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("initial_state", initial_state)):
        if t is not None or name in ("x", "weight"):
            _check(fn, name, t, shapes)
    _same_dtype(fn, shapes, x=x, weight=weight, bias=bias, initial_state=initial_state)
    if activation not in _CONV_ACTIVATIONS:
        raise ValueError(f"{fn}: activation must be 'silu' (or 'swish') or None, got {activation!r}")
    if x.ndim != 3:
        raise ValueError(f"{fn}: x must be [B, T, C], got {shapes}")
    B, T, C = x.shape
    if not ((weight.ndim == 3 and weight.shape[:2] == (C, 1)) or (weight.ndim == 2 and weight.shape[0] == C)) \
            or weight.shape[-1] < 1:
        raise ValueError(f"{fn}: weight must be [C, 1, W] or [C, W] with C = {C} (x's channels) and W >= 1, "
                         f"got {shapes}")
    W = weight.shape[-1]
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"{fn}: bias must be [C] = [{C}] or None, got {shapes}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{fn}: with cu_seqlens, B must be 1 (the T rows are the packed sequences), got {shapes}")
        cu = cu_seqlens.detach().cpu().numpy() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
        offsets = _la._offsets_of(fn, cu, T, shapes)
    else:
        offsets = np.arange(B + 1, dtype=np.int64) * T
    N = len(offsets) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, C, W):
        raise ValueError(f"{fn}: initial_state must be [N, C, W] = [{N}, {C}, {W}] (the last W inputs of each "
                         f"of N sequences), got {shapes}")
    rows = x.reshape(B * T, C)
    h0 = None if initial_state is None else initial_state[:, :, 1:].transpose(1, 2)
    y = _ShortConv.apply(rows, weight.reshape(C, W), bias, h0, offsets, _CONV_ACTIVATIONS[activation])
    y = y.view(B, T, C)
    if not output_final_state:
        return y, None
    # The last W inputs of [initial state; x] per sequence, in torch: differentiable as it is.
    past = x.new_zeros(N, W, C) if initial_state is None else initial_state.transpose(1, 2)
    if cu_seqlens is None:
        final = torch.cat([past, x], dim=1)[:, -W:]
    else:
        final = torch.stack([torch.cat([past[n], rows[offsets[n]:offsets[n + 1]]])[-W:] for n in range(N)])
    return y, final.transpose(1, 2).contiguous()


class _GatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, z, weight, eps, silu):
        ctx.eps, ctx.silu = eps, silu
        ctx.save_for_backward(o, z, weight)
        dt = _compute(o)
        return _tensor(_ext.norm_forward(_np(o, dt), _np(z, dt), _np(weight, dt), eps, silu), o)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        o, z, weight = ctx.saved_tensors
        dt = _compute(o)
        do, dz, dw = _ext.norm_backward(_np(o, dt), _np(z, dt), _np(weight, dt), _np(dy, dt), ctx.eps, ctx.silu)
        return _tensor(do, o), _tensor(dz, z), _tensor(dw, weight), None, None


def gated_rms_norm(o, z, weight, eps: float = 1e-6, activation: str = "silu"):
    """y = o / sqrt(mean(o²) + eps) ⊙ weight ⊙ act(z) over each group of M = weight.numel()
    entries of o's last dimension (a multiple of M: one group per head), act = SiLU ("silu",
    "swish") or sigmoid ("sigmoid"); o and z of one shape. Differentiable in o, z and weight."""
    fn = "linattn.torch.gated_rms_norm"
    shapes = _shapes(o=o, z=z, weight=weight)
    for name, t in (("o", o), ("z", z), ("weight", weight)):
        _check(fn, name, t, shapes)
    _same_dtype(fn, shapes, o=o, z=z, weight=weight)
    if activation not in _NORM_ACTIVATIONS:
        raise ValueError(f"{fn}: activation must be 'silu' (or 'swish') or 'sigmoid', got {activation!r}")
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{fn}: eps = {eps} must be finite and >= 0")
    M = weight.numel()
    if weight.ndim != 1 or M == 0 or o.ndim == 0 or o.shape[-1] % M != 0:
        raise ValueError(f"{fn}: weight must be [M], M > 0, with o's last dimension a multiple of M, got {shapes}")
    if z.shape != o.shape:
        raise ValueError(f"{fn}: z must have o's shape, got {shapes}")
    D = o.shape[-1]
    y = _GatedNorm.apply(o.reshape(-1, D), z.reshape(-1, D), weight, eps, _NORM_ACTIVATIONS[activation])
    return y.view(o.shape)


class ShortConvolution(nn.Module):
    """FLA's ShortConvolution: a depthwise causal conv1d over hidden_size channels, weight
    [hidden_size, 1, kernel_size] and bias [hidden_size] (bias=True) as nn.Conv1d(C, C, W,
    groups=C) holds them, so that its state dict loads; activation "silu" (default) or None."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: Optional[str] = "silu",
                 device=None, dtype=None):
        super().__init__()
        if hidden_size <= 0 or kernel_size <= 0:
            raise ValueError(f"linattn.torch.ShortConvolution: hidden_size = {hidden_size} and kernel_size = "
                             f"{kernel_size} must be > 0")
        if activation not in _CONV_ACTIVATIONS:
            raise ValueError(f"linattn.torch.ShortConvolution: activation must be 'silu' (or 'swish') or None, "
                             f"got {activation!r}")
        self.hidden_size, self.kernel_size, self.activation = hidden_size, kernel_size, activation
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(hidden_size, 1, kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        # nn.Conv1d's: U(±1/√fan_in) with fan_in = W (one input channel per group).
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x, residual=None, mask=None, cache=None, output_final_state: bool = False, cu_seqlens=None):
        """x [B, T, hidden_size]; mask [B, T] (FLA's padding mask: x is multiplied by it first) or
        None; cache [N, hidden_size, W] the inputs before (None: zeros). Returns (y, final cache
        [N, hidden_size, W] or None). FLA's residual is not offered."""
        if residual is not None:
            raise ValueError("linattn.torch.ShortConvolution.forward: residual is not offered")
        if mask is not None:
            if mask.shape != x.shape[:2]:
                raise ValueError(f"linattn.torch.ShortConvolution.forward: mask must be [B, T], got "
                                 f"{_shapes(x=x, mask=mask)}")
            x = x * mask.unsqueeze(-1).to(x.dtype)
        return short_convolution(x, self.weight, self.bias, self.activation, cache, output_final_state, cu_seqlens)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, kernel_size={self.kernel_size}, bias={self.bias is not None}, "
                f"activation={self.activation!r}")


class FusedRMSNormGated(nn.Module):
    """FLA's FusedRMSNormGated: y = x / sqrt(mean(x²) + eps) ⊙ weight ⊙ act(g) over the last
    dimension (hidden_size), act = SiLU ("swish", "silu") or sigmoid; weight [hidden_size]."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device=None, dtype=None):
        super().__init__()
        if activation not in _NORM_ACTIVATIONS:
            raise ValueError(f"linattn.torch.FusedRMSNormGated: activation must be 'swish', 'silu' or 'sigmoid', "
                             f"got {activation!r}")
        self.hidden_size, self.eps, self.activation = hidden_size, float(eps), activation
        ones = torch.ones(hidden_size, device=device, dtype=dtype)
        if elementwise_affine:
            self.weight = nn.Parameter(ones)
        else:
            self.register_parameter("weight", None)
            self.register_buffer("_ones", ones, persistent=False)

    def forward(self, x, g):
        if x.ndim == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"linattn.torch.FusedRMSNormGated: x must be [..., hidden_size = {self.hidden_size}], "
                             f"got {_shapes(x=x, g=g)}")
        weight = self.weight if self.weight is not None else self._ones.to(x.dtype)
        return gated_rms_norm(x, g, weight, self.eps, self.activation)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, activation={self.activation!r}"


class LayerState(NamedTuple):
    """A delta-rule layer's state after a prefill, to continue it: conv_state the convolution
    cache [N, C, W] (KimiDeltaAttention: a tuple of q's, k's and v's), recurrent_state the heads'
    [N, HV, K, V]."""

    conv_state: object
    recurrent_state: torch.Tensor


def _layer_input(fn: str, x, d: int, dtype):
    if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != d:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{fn}: hidden_states must be [B, T, hidden_size = {d}], got {got}")
    if x.dtype != dtype:
        raise TypeError(f"{fn}: hidden_states is {x.dtype} but the parameters are {dtype}")


def _unpack_state(fn: str, state, x, cu_seqlens, convs, rec_shape):
    """initial_state's caches (one per convolution of `convs`) and recurrent state, each
    checked against the call's N sequences; None: zeros."""
    if state is None:
        return (None,) * len(convs), None
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"{fn}: initial_state must be a LayerState (conv_state, recurrent_state), "
                        f"got {type(state).__name__}")
    conv, rec = state
    if len(convs) > 1:
        if not isinstance(conv, tuple) or len(conv) != len(convs):
            raise TypeError(f"{fn}: conv_state must be a tuple of {len(convs)} caches (q, k, v)")
    else:
        conv = (conv,)
    N = x.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    named = [(f"conv_state[{i}]" if len(convs) > 1 else "conv_state", c, (N, m.hidden_size, m.kernel_size))
             for i, (c, m) in enumerate(zip(conv, convs))]
    for name, t, want in named + [("recurrent_state", rec, (N, *rec_shape))]:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fn}: initial_state's {name} must be {list(want)} (N = {N} sequences), got {got} "
                             f"(hidden_states {tuple(x.shape)})")
    return conv, rec


class LayerDecodeState:
    """B sequences of a delta-rule layer being decoded one token at a time (``make_state``,
    ``step``; the C++ layers' BatchedState): ``conv_state`` the convolution caches [B, C, W] in
    the parameters' dtype (KimiDeltaAttention: the tuple of q's, k's and v's), ``decoder`` the
    heads' states in a linattn.DeltaRuleDecoder (float32, or float64 for float64 parameters;
    its ``state_dtype`` may be bfloat16 / float16). ``step`` updates both in place."""

    def __init__(self, conv_state, decoder):
        self.conv_state, self.decoder = conv_state, decoder

    @property
    def batch_size(self) -> int:
        return self.decoder.batch_size

    def layer_state(self) -> LayerState:
        """The state as ``forward(..., output_final_state=True)`` returns it (copies), to
        continue with ``forward(..., initial_state=)``: recurrent_state [B, HV, K, V] in the
        decoder's dtype (float32 for bf16 / half states, widened exactly)."""
        conv = self.conv_state
        conv = tuple(c.clone() for c in conv) if isinstance(conv, tuple) else conv.clone()
        return LayerState(conv, torch.from_numpy(self.decoder.states))


class _DeltaLayer(nn.Module):
    """What GatedDeltaNet and KimiDeltaAttention share: decoding one token per sequence. A
    subclass gives _heads() (Hk, Hv, Dk, Dv), _convs(), _tokens(), _gate() and _output()."""

    def make_state(self, batch_size: Optional[int] = None, initial_state: Optional[LayerState] = None,
                   state_dtype=None) -> LayerDecodeState:
        """The decoding state of batch_size new sequences, or of those of initial_state (a
        prefill's ``forward(..., output_final_state=True)`` LayerState: its B, caches and
        recurrent states). state_dtype: what the heads' states are kept in (None: float32, or
        float64 for float64 parameters; torch.bfloat16 / torch.float16: DeltaRuleDecoder's)."""
        fn = f"linattn.torch.{type(self).__name__}.make_state"
        Hk, Hv, Dk, Dv = self._heads()
        convs = self._convs()
        dtype = convs[0].weight.dtype
        if initial_state is not None:
            if not isinstance(initial_state, tuple) or len(initial_state) != 2 or \
                    not isinstance(initial_state[1], torch.Tensor):
                raise TypeError(f"{fn}: initial_state must be a LayerState (conv_state, recurrent_state), got "
                                f"{type(initial_state).__name__}")
            B = initial_state[1].shape[0]
            if batch_size is not None and int(batch_size) != B:
                raise ValueError(f"{fn}: batch_size = {batch_size} but initial_state holds {B} sequences")
            probe = torch.empty(B, 1, self.hidden_size, dtype=dtype)
            caches, rec = _unpack_state(fn, initial_state, probe, None, convs, (Hv, Dk, Dv))
            caches = [c.detach().to(dtype).clone() for c in caches]
        else:
            if batch_size is None or int(batch_size) < 0:
                raise ValueError(f"{fn}: batch_size must be >= 0 (or initial_state given), got {batch_size!r}")
            B, rec = int(batch_size), None
            caches = [torch.zeros(B, c.hidden_size, c.kernel_size, dtype=dtype) for c in convs]
        compute = np.float64 if dtype == torch.float64 else np.float32
        dec = _la.DeltaRuleDecoder(B, Hv, Dk, Dv, num_key_heads=Hk, use_qk_l2norm_in_kernel=True, dtype=compute,
                                   state_dtype=state_dtype)
        if rec is not None:
            dec.set_states(rec.detach())
        return LayerDecodeState(tuple(caches) if len(caches) > 1 else caches[0], dec)

    @torch.no_grad()
    def step(self, hidden_states, state: LayerDecodeState):
        """One token of each of the state's B sequences: hidden_states [B, hidden_size] (or
        [B, 1, hidden_size]) -> the output of that shape, state updated in place; what
        ``forward`` over the whole sequences gives for these tokens (the delta rule by
        DeltaRuleDecoder.step, one pass over each head's state). Inference: no gradient."""
        fn = f"linattn.torch.{type(self).__name__}.step"
        x = hidden_states
        if not isinstance(state, LayerDecodeState):
            raise TypeError(f"{fn}: state must be a LayerDecodeState (make_state()), got {type(state).__name__}")
        B = state.batch_size
        if not isinstance(x, torch.Tensor) or x.shape not in ((B, self.hidden_size), (B, 1, self.hidden_size)):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{fn}: hidden_states must be [B, hidden_size] or [B, 1, hidden_size] with B = {B} "
                             f"(the state's sequences), hidden_size = {self.hidden_size}, got {got}")
        _layer_input(fn, x.view(B, 1, -1), self.hidden_size, self._convs()[0].weight.dtype)
        q, k, v, a, b, z, conv = self._tokens(x.view(B, 1, -1), state.conv_state, True, None)
        dt = _compute(q)
        o = state.decoder.step(_np(q[:, 0], dt), _np(k[:, 0], dt), _np(v[:, 0], dt),
                               _np(self._gate(fn, a)[:, 0], dt), _np(torch.sigmoid(b[:, 0].to(dt)), dt))
        state.conv_state = conv
        y = self._output(torch.from_numpy(o).to(x.dtype).unsqueeze(1), z)
        return y.view(x.shape)


class GatedDeltaNet(_DeltaLayer):
    """transformers' Qwen3NextGatedDeltaNet (Qwen3-Next's linear attention) with its parameter
    names and shapes: in_proj_qkvz.weight (rows interleaved per key head: q, k, then the values
    and gates of its value heads), in_proj_ba.weight (per key head its b's, then its a's),
    conv1d.weight [C, 1, W], dt_bias [Hv], A_log [Hv], norm.weight [Dv], out_proj.weight. The
    arguments are Qwen3NextConfig's names (defaults: Qwen3-Next-80B-A3B); ``from_config(config)``
    reads them from a configuration object."""

    def __init__(self, hidden_size: int = 2048, linear_num_key_heads: int = 16, linear_num_value_heads: int = 32,
                 linear_key_head_dim: int = 128, linear_value_head_dim: int = 128, linear_conv_kernel_dim: int = 4,
                 rms_norm_eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        fn = "linattn.torch.GatedDeltaNet"
        sizes = dict(hidden_size=hidden_size, linear_num_key_heads=linear_num_key_heads,
                     linear_num_value_heads=linear_num_value_heads, linear_key_head_dim=linear_key_head_dim,
                     linear_value_head_dim=linear_value_head_dim, linear_conv_kernel_dim=linear_conv_kernel_dim)
        for name, v in sizes.items():
            if int(v) <= 0:
                raise ValueError(f"{fn}: {name} = {v} must be > 0")
        if linear_num_value_heads % linear_num_key_heads != 0:
            raise ValueError(f"{fn}: linear_num_value_heads = {linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads = {linear_num_key_heads}")
        self.hidden_size, self.num_k_heads, self.num_v_heads = hidden_size, linear_num_key_heads, linear_num_value_heads
        self.head_k_dim, self.head_v_dim = linear_key_head_dim, linear_value_head_dim
        self.conv_kernel_size = linear_conv_kernel_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        f = dict(device=device, dtype=dtype)
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False, **f)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * self.num_v_heads, bias=False, **f)
        self.conv1d = ShortConvolution(self.conv_dim, linear_conv_kernel_dim, bias=False, activation="silu", **f)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, **f))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads, **f).uniform_(0, 16)))
        self.norm = FusedRMSNormGated(self.head_v_dim, eps=rms_norm_eps, activation="silu", **f)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **f)

    @classmethod
    def from_config(cls, config, **kwargs):
        names = ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps")
        return cls(**{n: getattr(config, n) for n in names if hasattr(config, n)}, **kwargs)

    def forward(self, hidden_states, initial_state: Optional[LayerState] = None, output_final_state: bool = False,
                cu_seqlens=None):
        """hidden_states [B, T, hidden_size] (with cu_seqlens: B = 1, packed sequences);
        initial_state a LayerState of an earlier call (None: a new sequence). Returns the output
        [B, T, hidden_size], or (output, LayerState) with output_final_state."""
        from . import torch as lt  # linattn.torch imports this module lazily

        fn = "linattn.torch.GatedDeltaNet.forward"
        _layer_input(fn, hidden_states, self.hidden_size, self.out_proj.weight.dtype)
        (conv0,), rec0 = _unpack_state(fn, initial_state, hidden_states, cu_seqlens, [self.conv1d],
                                       self._heads()[1:])
        q, k, v, a, b, z, conv_state = self._tokens(hidden_states, conv0, output_final_state, cu_seqlens)
        o, rec = lt.chunk_gated_delta_rule(q, k, v, g=self._gate(fn, a), beta=b, initial_state=rec0,
                                           output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
                                           use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens)
        y = self._output(o, z)
        return (y, LayerState(conv_state, rec)) if output_final_state else y

    def _heads(self):
        return self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim

    def _convs(self):
        return [self.conv1d]

    def _tokens(self, x, conv0, output_final_state, cu_seqlens):
        """q, k [B, T, Hk, Dk], v [B, T, Hv, Dv] after the convolution, the gate's input a
        [B, T, Hv, 1], beta's logits [B, T, Hv], the norm's gate z [B, T, Hv, Dv] and the
        convolution's final cache (or None) of x [B, T, hidden_size]."""
        B, T, _ = x.shape
        Hk, Hv, Dk, Dv = self._heads()
        G = Hv // Hk
        # transformers' order: per key head q, k, its G values, its G gates; b's then a's.
        qkvz = self.in_proj_qkvz(x).view(B, T, Hk, 2 * Dk + 2 * G * Dv)
        q, k, v, z = torch.split(qkvz, [Dk, Dk, G * Dv, G * Dv], dim=3)
        b, a = torch.split(self.in_proj_ba(x).view(B, T, Hk, 2 * G), [G, G], dim=3)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        mixed, conv_state = self.conv1d(mixed, cache=conv0, output_final_state=output_final_state,
                                        cu_seqlens=cu_seqlens)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), v.reshape(B, T, Hv, Dv), a.reshape(B, T, Hv, 1),
                b.reshape(B, T, Hv), z.reshape(B, T, Hv, Dv), conv_state)

    def _gate(self, fn, a):
        """g = -exp(A_log)·softplus(a + dt_bias) [B, T, Hv] by the C++ gate, as per-channel with one
        channel."""
        from . import torch as lt

        return lt.TorchOps.gate(fn, a, self.A_log, self.dt_bias, None).view(a.shape[:3])

    def _output(self, o, z):
        B, T = o.shape[:2]
        return self.out_proj(self.norm(o, z).reshape(B, T, self.value_dim))


class KimiDeltaAttention(_DeltaLayer):
    """Kimi Linear's KimiDeltaAttention (KDA) with its checkpoints' parameter names and shapes:
    q_proj, k_proj, v_proj, q_conv1d, k_conv1d, v_conv1d (weights [C, 1, W]), f_a_proj, f_b_proj,
    b_proj, g_a_proj, g_b_proj, A_log [1, 1, H, 1], dt_bias [H·K], o_norm.weight [V], o_proj.
    The arguments are those of linattn's KimiDeltaAttentionConfig (Kimi Linear's
    linear_attn_config names; defaults: Kimi-Linear-48B-A3B); use_lower_bound: g =
    lower_bound·sigmoid(exp(A_log)·(a + dt_bias)) (FLA's safe_gate) instead of
    −exp(A_log)·softplus(a + dt_bias)."""

    def __init__(self, hidden_size: int = 2304, num_heads: int = 32, head_dim: int = 128, head_v_dim: int = 0,
                 short_conv_kernel_size: int = 4, rms_norm_eps: float = 1e-6, use_lower_bound: bool = False,
                 lower_bound: float = -5.0, device=None, dtype=None):
        super().__init__()
        fn = "linattn.torch.KimiDeltaAttention"
        for name, v in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                        ("short_conv_kernel_size", short_conv_kernel_size)):
            if int(v) <= 0:
                raise ValueError(f"{fn}: {name} = {v} must be > 0")
        if head_v_dim < 0:
            raise ValueError(f"{fn}: head_v_dim = {head_v_dim} must be > 0 (or 0: head_dim)")
        if use_lower_bound and not (math.isfinite(lower_bound) and lower_bound < 0):
            raise ValueError(f"{fn}: lower_bound = {lower_bound} must be finite and < 0")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.head_v_dim = head_v_dim or head_dim
        self.conv_size = short_conv_kernel_size
        self.lower_bound = float(lower_bound) if use_lower_bound else None
        HK, HV = num_heads * head_dim, num_heads * self.head_v_dim
        self.key_dim, self.value_dim = HK, HV
        f = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, HK, bias=False, **f)
        self.k_proj = nn.Linear(hidden_size, HK, bias=False, **f)
        self.v_proj = nn.Linear(hidden_size, HV, bias=False, **f)
        self.q_conv1d = ShortConvolution(HK, short_conv_kernel_size, activation="silu", **f)
        self.k_conv1d = ShortConvolution(HK, short_conv_kernel_size, activation="silu", **f)
        self.v_conv1d = ShortConvolution(HV, short_conv_kernel_size, activation="silu", **f)
        self.A_log = nn.Parameter(torch.log(torch.empty(num_heads, **f).uniform_(1, 16)).view(1, 1, -1, 1))
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False, **f)
        self.f_b_proj = nn.Linear(head_dim, HK, bias=False, **f)
        self.dt_bias = nn.Parameter(torch.zeros(HK, **f))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False, **f)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False, **f)
        self.g_b_proj = nn.Linear(head_dim, HV, bias=False, **f)
        self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=rms_norm_eps, activation="sigmoid", **f)
        self.o_proj = nn.Linear(HV, hidden_size, bias=False, **f)

    def forward(self, hidden_states, initial_state: Optional[LayerState] = None, output_final_state: bool = False,
                cu_seqlens=None):
        """As GatedDeltaNet.forward; the LayerState's conv_state is the tuple (q, k, v) of caches."""
        from . import torch as lt  # linattn.torch imports this module lazily

        fn = "linattn.torch.KimiDeltaAttention.forward"
        _layer_input(fn, hidden_states, self.hidden_size, self.o_proj.weight.dtype)
        caches, rec0 = _unpack_state(fn, initial_state, hidden_states, cu_seqlens, self._convs(), self._heads()[1:])
        q, k, v, a, beta, z, conv_state = self._tokens(hidden_states, caches, output_final_state, cu_seqlens)
        o, rec = lt.chunk_kda(q, k, v, a, beta, initial_state=rec0, output_final_state=output_final_state,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                              A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound,
                              safe_gate=self.lower_bound is not None, cu_seqlens=cu_seqlens)
        y = self._output(o, z)
        return (y, LayerState(conv_state, rec)) if output_final_state else y

    def _heads(self):
        return self.num_heads, self.num_heads, self.head_dim, self.head_v_dim

    def _convs(self):
        return [self.q_conv1d, self.k_conv1d, self.v_conv1d]

    def _tokens(self, x, caches, output_final_state, cu_seqlens):
        """As GatedDeltaNet._tokens: q, k [B, T, H, K], v [B, T, H, V], the gate's input a
        [B, T, H, K], beta's logits [B, T, H], z [B, T, H, V] and the (q, k, v) caches (or None)."""
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.head_dim, self.head_v_dim
        outs = [conv(proj(x), cache=c, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
                for conv, proj, c in zip(self._convs(), (self.q_proj, self.k_proj, self.v_proj), caches)]
        (q, cq), (k, ck), (v, cv) = outs
        a = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        z = self.g_b_proj(self.g_a_proj(x)).view(B, T, H, V)
        conv_state = (cq, ck, cv) if output_final_state else None
        return q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V), a, self.b_proj(x), z, conv_state

    def _gate(self, fn, a):
        """KDA's per-channel log decays [B, T, H, K] (the in-kernel gate of chunk_kda)."""
        from . import torch as lt

        return lt.TorchOps.gate(fn, a, self.A_log, self.dt_bias, self.lower_bound)

    def _output(self, o, z):
        B, T = o.shape[:2]
        return self.o_proj(self.o_norm(o, z).reshape(B, T, self.value_dim))
