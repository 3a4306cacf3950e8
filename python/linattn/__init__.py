"""linattn from Python: linear attention ("Transformers are RNNs") on numpy arrays.

Every function takes q, k, v in one of three layouts, all of one dtype (float32 or float64):

* ``[N, D]``: one sequence, one head;
* ``[N, H, D]``: H heads, the rows of one sequence, or of several packed one after the other
  when ``cu_seqlens`` (B + 1 offsets, as flash-linear-attention's) says where each starts;
* ``[B, T, H, D]``: B sequences of T tokens (flash-linear-attention's layout); with
  ``cu_seqlens``, B must be 1 and the T rows are the packed sequences.

k and v have the same number of rows (S; S = T when causal); v's last dimension M may differ
from D. Results have q's leading dimensions and last dimension M. C-contiguous arrays are read
in place (the C++ kernels see them as the packed row-major N x (H·D) matrix); any other array
is first copied by ``numpy.ascontiguousarray``: one copy of that input per call. The kernels
release the GIL and run their heads (and sequences) on ``get_num_threads()`` threads.

Shape errors raise ``ValueError`` with the C++ library's message (the function and every shape),
dtype errors ``TypeError``.
"""

from __future__ import annotations

import numpy as np

from . import _linattn as _ext

__all__ = [
    "FEATURE_MAPS",
    "linear_attention",
    "linear_attention_backward",
    "softmax_attention",
    "softmax_attention_backward",
    "gated_linear_attention",
    "gated_linear_attention_backward",
    "delta_rule_attention",
    "delta_rule_attention_backward",
    "set_num_threads",
    "get_num_threads",
    "__version__",
]

__version__: str = _ext.__version__

#: The feature maps by name: elu (elu(x) + 1, the paper's), softmax_split (softmax over a
#: query's features, over the keys per feature), cosine (1 + cos(q, k): [1, x/|x|]), silu
#: (x·σ(x)) and identity (φ(x) = x). See docs/SPEC.md of the C++ library.
FEATURE_MAPS = ("elu", "softmax_split", "cosine", "silu", "identity")
#: The maps of the gated kernels (identity: RetNet, Mamba-2, GLA; elu) and of the delta rule
#: (identity for keys the caller normalised, l2norm = x/|x|, l2norm_silu = silu(x)/|silu(x)|:
#: Gated DeltaNet's, Qwen3-Next).
GATED_FEATURE_MAPS = ("identity", "elu")
DELTA_FEATURE_MAPS = ("identity", "l2norm", "l2norm_silu")

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def set_num_threads(n: int) -> None:
    """Threads of the kernels (OpenMP); 1 runs everything on the calling thread."""
    _ext.set_num_threads(int(n))


def get_num_threads() -> int:
    """Threads the kernels use (1 when the module was built without OpenMP)."""
    return _ext.get_num_threads()


def _arrays(fn: str, **named) -> list[np.ndarray]:
    arrays = [np.asarray(x) for x in named.values()]
    dtypes = [a.dtype for a in arrays]
    if any(d not in _FLOATS for d in dtypes) or len(set(dtypes)) != 1:
        listed = ", ".join(f"{n} {d}" for n, d in zip(named, dtypes))
        raise TypeError(f"{fn}: {', '.join(named)} must all be float32 or all float64, got {listed}")
    return arrays


class _Shapes:
    """ "q (2, 5, 8), k ...": the arguments' shapes as an error message names them."""

    def __init__(self, names, arrays):
        self.names, self.arrays = names, arrays

    def __str__(self) -> str:
        return ", ".join(f"{n} {a.shape}" for n, a in zip(self.names, self.arrays))


class _Packed:
    """The arguments of one call as the C++ kernels take them: 2-D row-major arrays of H·D
    columns and the offsets of the sequences."""

    def __init__(self, fn: str, q, k, v, cu_seqlens, dout=None):
        names = dict(q=q, k=k, v=v) if dout is None else dict(q=q, k=k, v=v, dout=dout)
        arrays = _arrays(fn, **names)
        q, k, v = arrays[:3]
        nd = q.ndim
        shapes = _Shapes(names, arrays)  # formatted only for an error message
        if nd not in (2, 3, 4) or any(a.ndim != nd for a in arrays):
            raise ValueError(f"{fn}: q, k and v must all be [N, D], [N, H, D] or [B, T, H, D], got {shapes}")
        heads = 1 if nd == 2 else q.shape[-2]
        if nd > 2 and (k.shape[-2] != heads or v.shape[-2] != heads):
            raise ValueError(f"{fn}: q, k and v must have the same number of heads, got {shapes}")
        if nd == 4 and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
            raise ValueError(f"{fn}: q, k and v must have the same batch size, got {shapes}")
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"{fn}: k and v must have the same rows (and heads), got {shapes}")
        self.heads = heads
        self.q_shape, self.k_shape, self.v_shape = q.shape, k.shape, v.shape
        self.out_shape = q.shape[:-1] + (v.shape[-1],)
        if dout is not None and arrays[3].shape != self.out_shape:
            raise ValueError(f"{fn}: dout must have the output's shape {self.out_shape}, got {shapes}")
        self.arrays = [self._rows(a) for a in arrays]
        self.q_offsets = self.k_offsets = None
        if cu_seqlens is not None:
            cu = np.ascontiguousarray(cu_seqlens, dtype=np.int64)
            if nd == 4 and q.shape[0] != 1:
                raise ValueError(f"{fn}: with cu_seqlens, [B, T, H, D] inputs must have B = 1, got {shapes}")
            self.q_offsets = self.k_offsets = cu
        elif nd == 4:
            B = q.shape[0]
            self.q_offsets = np.arange(B + 1, dtype=np.int64) * q.shape[1]
            self.k_offsets = np.arange(B + 1, dtype=np.int64) * k.shape[1]

    @staticmethod
    def _rows(a: np.ndarray) -> np.ndarray:
        rows = int(np.prod(a.shape[:-2])) if a.ndim > 2 else a.shape[0]
        cols = a.shape[-1] * (a.shape[-2] if a.ndim > 2 else 1)
        return np.ascontiguousarray(a).reshape(rows, cols)


def linear_attention(q, k, v, feature_map: str = "elu", causal: bool = False, cu_seqlens=None):
    """Linear attention: out_i = φ(q_i)ᵀ S / φ(q_i)ᵀ z with S = Σ_j φ(k_j) v_jᵀ, z = Σ_j φ(k_j)
    over every key j (causal=False) or the keys j ≤ i (causal=True); O(N) time and memory.

    >>> out = linattn.linear_attention(q, k, v, "elu", causal=True)   # q, k, v [B, T, H, D]
    """
    fn = "causal_linear_attention" if causal else "linear_attention"
    p = _Packed(fn, q, k, v, cu_seqlens)
    out = _ext.linear_forward(*p.arrays, p.heads, str(feature_map), bool(causal), p.q_offsets, p.k_offsets)
    return out.reshape(p.out_shape)


def linear_attention_backward(q, k, v, dout, feature_map: str = "elu", causal: bool = False, cu_seqlens=None):
    """Gradients (dq, dk, dv) of linear_attention() for ∂L/∂out = dout (the output's shape)."""
    fn = "causal_linear_attention_backward" if causal else "linear_attention_backward"
    p = _Packed(fn, q, k, v, cu_seqlens, dout)
    dq, dk, dv = _ext.linear_backward(*p.arrays, p.heads, str(feature_map), bool(causal), p.q_offsets, p.k_offsets)
    return dq.reshape(p.q_shape), dk.reshape(p.k_shape), dv.reshape(p.v_shape)


def softmax_attention(q, k, v, causal: bool = False, cu_seqlens=None):
    """Softmax attention, softmax(q kᵀ / √D) v per head (causal: keys j ≤ i), the O(N²)
    baseline linear attention replaces; tiled, never forming the N x N matrix."""
    fn = "causal_softmax_attention" if causal else "softmax_attention"
    p = _Packed(fn, q, k, v, cu_seqlens)
    out = _ext.softmax_forward(*p.arrays, p.heads, bool(causal), p.q_offsets, p.k_offsets)
    return out.reshape(p.out_shape)


def softmax_attention_backward(q, k, v, dout, causal: bool = False, cu_seqlens=None):
    """Gradients (dq, dk, dv) of softmax_attention() for ∂L/∂out = dout."""
    fn = "causal_softmax_attention_backward" if causal else "softmax_attention_backward"
    p = _Packed(fn, q, k, v, cu_seqlens, dout)
    dq, dk, dv = _ext.softmax_backward(*p.arrays, p.heads, bool(causal), p.q_offsets, p.k_offsets)
    return dq.reshape(p.q_shape), dk.reshape(p.k_shape), dv.reshape(p.v_shape)


def _params(fn: str, p: _Packed, name: str, x, dtype, per_feature_ok: bool, feature_dim: int | None = None):
    """A per-token parameter as the 2-D packed array the kernels take: of q's leading shape (one
    per token and head) or, for per-feature gates, of q's leading shape + (F,)."""
    a = np.asarray(x)
    if a.dtype != dtype:
        raise TypeError(f"{fn}: {name} must have q's dtype {dtype}, got {a.dtype}")
    lead = tuple(p.q_shape[:-1])
    rows = int(np.prod(lead[:-1])) if len(lead) > 1 else lead[0]
    heads = lead[-1] if len(lead) > 1 else 1
    if a.shape == lead:
        return np.ascontiguousarray(a).reshape(rows, heads)
    if per_feature_ok and a.shape == lead + (feature_dim,):
        return np.ascontiguousarray(a).reshape(rows, heads * feature_dim)
    want = f"{lead}" + (f" or {lead + (feature_dim,)}" if per_feature_ok else "")
    raise ValueError(f"{fn}: {name} must have shape {want}, got {a.shape}")


def _scale(scale, q) -> float:
    return 1.0 / np.sqrt(np.asarray(q).shape[-1]) if scale is None else float(scale)


def gated_linear_attention(q, k, v, g, feature_map: str = "identity", scale=None, normalize: bool = False, cu_seqlens=None):
    """Causal attention with decay (RetNet, Mamba-2) or per-feature gates (GLA):
    S_i = diag(exp(g_i)) S_{i-1} + φ(k_i) v_iᵀ, out_i = scale·φ(q_i)ᵀ S_i (normalize=True:
    divided by φ(q_i)ᵀ z_i, z decayed likewise). g: log gates ≤ 0 of q's leading shape (one per
    token and head) or q's shape (one per token, head and feature, F = D). scale: 1/√D when
    None (the models' convention)."""
    fn = "gated_linear_attention"
    p = _Packed(fn, q, k, v, cu_seqlens)
    G = _params(fn, p, "g", g, p.arrays[0].dtype, True, np.asarray(q).shape[-1])
    out = _ext.gated_forward(*p.arrays, G, p.heads, str(feature_map), _scale(scale, q), bool(normalize), p.q_offsets)
    return out.reshape(p.out_shape)


def gated_linear_attention_backward(q, k, v, g, dout, feature_map: str = "identity", scale=None, normalize: bool = False, cu_seqlens=None):
    """Gradients (dq, dk, dv, dg) of gated_linear_attention() for ∂L/∂out = dout."""
    fn = "gated_linear_attention_backward"
    p = _Packed(fn, q, k, v, cu_seqlens, dout)
    G = _params(fn, p, "g", g, p.arrays[0].dtype, True, np.asarray(q).shape[-1])
    dq, dk, dv, dg = _ext.gated_backward(*p.arrays[:3], G, p.arrays[3], p.heads, str(feature_map), _scale(scale, q), bool(normalize), p.q_offsets)
    return dq.reshape(p.q_shape), dk.reshape(p.k_shape), dv.reshape(p.v_shape), dg.reshape(np.shape(g))


def delta_rule_attention(q, k, v, beta, g=None, feature_map: str = "l2norm_silu", scale=None, cu_seqlens=None):
    """The delta rule (DeltaNet; Gated DeltaNet with g): with k̂ = φ(k),
    S_t = exp(g_t)(I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ, out_t = scale·φ(q_t)ᵀ S_t.
    beta in [0, 2] and g (log decays ≤ 0, or None: no decay) have q's leading shape (one per
    token and head). scale: 1/√D when None. Chunked or recurrent, whichever is faster."""
    fn = "delta_rule_attention"
    p = _Packed(fn, q, k, v, cu_seqlens)
    dtype = p.arrays[0].dtype
    B = _params(fn, p, "beta", beta, dtype, False)
    A = None if g is None else _params(fn, p, "g", g, dtype, False)
    out = _ext.delta_forward(*p.arrays, B, A, p.heads, str(feature_map), _scale(scale, q), p.q_offsets)
    return out.reshape(p.out_shape)


def delta_rule_attention_backward(q, k, v, beta, g, dout, feature_map: str = "l2norm_silu", scale=None, cu_seqlens=None):
    """Gradients (dq, dk, dv, dbeta, dg) of delta_rule_attention() for ∂L/∂out = dout; dg is
    None when g is."""
    fn = "delta_rule_attention_backward"
    p = _Packed(fn, q, k, v, cu_seqlens, dout)
    dtype = p.arrays[0].dtype
    B = _params(fn, p, "beta", beta, dtype, False)
    A = None if g is None else _params(fn, p, "g", g, dtype, False)
    dq, dk, dv, db, dg = _ext.delta_backward(*p.arrays[:3], B, A, p.arrays[3], p.heads, str(feature_map), _scale(scale, q), p.q_offsets)
    return (dq.reshape(p.q_shape), dk.reshape(p.k_shape), dv.reshape(p.v_shape),
            db.reshape(np.shape(beta)), None if dg is None else dg.reshape(np.shape(g)))
