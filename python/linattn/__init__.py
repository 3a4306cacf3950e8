"""linattn from Python: linear attention ("Transformers are RNNs") on numpy arrays.

Every function takes q, k, v in one of three layouts, all of one dtype (float32 or float64):

* ``[N, D]``: one sequence, one head;
* ``[N, H, D]``: H heads, the rows of one sequence, or of several packed one after the other
  when ``cu_seqlens`` (B + 1 offsets, as flash-linear-attention's) says where each starts;
* ``[B, T, H, D]``: B sequences of T tokens (flash-linear-attention's layout); with
  ``cu_seqlens``, B must be 1 and the T rows are the packed sequences.

k and v have the same number of rows (S; S = T when causal); v's last dimension M may differ
from D. In linear_attention (and its backward, RecurrentState, linattn.torch's forms) q and k
may have Hk heads shared by v's H (GVA, Hk dividing H; value head h reads key head
h // (H // Hk)); the other functions of this layout take one head count for all three.
Results have q's leading dimensions, v's heads and last dimension M. C-contiguous arrays are read
in place (the C++ kernels see them as the packed row-major N x (H·D) matrix); any other array
is first copied by ``numpy.ascontiguousarray``: one copy of that input per call. The kernels
release the GIL and run their heads (and sequences) on ``get_num_threads()`` threads.

Errors: shapes and parameter values are checked here, before any kernel runs, and raise
``ValueError`` naming the Python function, the argument by its name here (q, k, v, g, beta,
cu_seqlens, ...), the offending entry (``beta[0, 3, 1] = -0.086973``) and the shapes of the
call's arrays; dtype errors raise ``TypeError``. A check only the C++ library makes is raised
with its message under the Python function's name and the call's shapes.

Denominators (normalised linear attention, ``linear_attention`` and ``gated_linear_attention``
with ``normalize=True``): out_i = φ(q_i)ᵀS / φ(q_i)ᵀz, and a row whose denominator
den_i = φ(q_i)ᵀz is degenerate is a row of zeros, never NaN or inf: den_i below the smallest
normal number of the dtype (0, subnormal, negative or NaN), or, in ``linear_attention`` and
``RecurrentState.step`` with maps whose features can be negative (identity, silu, cosine,
taylor2), den_i ≤ 2·F·ε·Σ_f |φ(q_i)_f|·|z_f| (rounding noise; ε the dtype's machine epsilon, F
the feature count). Every other row is divided as computed (the C++ library's guard,
docs/SPEC.md §2, "Denominators"; the same in every algorithm and in the decode step). With maps of features of both signs a negative denominator is
common: with the identity map and raw N(0, 1) inputs about half of the rows have q_i·Σ_j k_j
< 0 and come out as zeros. Use a map with positive features (elu, the default; relu, dpfp,
softmax_split) for normalised attention, or an unnormalised kernel (the gated kernels with
normalize=False, the delta rule) for identity features.

Threads: ``set_num_threads(n)`` is linattn's own setting, applied to each kernel call on the
thread that runs it and undone when the call returns: importing torch (which shares OpenMP
with linattn and sets its thread count at import), ``torch.set_num_threads`` or an
``omp_set_num_threads`` elsewhere neither changes linattn's count nor is changed by linattn's
calls. Until ``set_num_threads`` is called the count is the first entry of OMP_NUM_THREADS
when it is set, else every processor OpenMP may use.

Padding: ``key_padding_mask`` (bool, True marks a padding key, as in PyTorch's
``nn.MultiheadAttention``) has one entry per key row: shape [S] for [N, D] and [N, H, D] inputs
(the packed rows), [B, S] for [B, T, H, D]; every head shares it.

Decoding: ``linear_attention(..., causal=True, output_final_state=True)`` returns the output and a
``RecurrentState`` holding every sequence's state (the prefill of a server);
``RecurrentState.step`` then consumes one token of each of its B sequences, and
``RecurrentState.save`` / ``load`` move the exact decoding position through bytes (the C++
library's state file). ``GatedDecoder`` and ``DeltaRuleDecoder`` are the same for the gated
kernels and the delta rule (Gated DeltaNet, KDA) in FLA's per-token layout, continuing the
``final_state`` of the FLA names below, with several tokens per call (``extend``) and rollback
snapshots for speculative decoding.

The names of flash-linear-attention's kernels (``chunk_gla``, ``chunk_simple_gla``,
``chunk_delta_rule``, ``chunk_gated_delta_rule``, ``chunk_kda`` and their ``fused_recurrent_*``
twins) take FLA's arguments and layout, [B, T, H, K] (v with HV, a multiple of H, heads: GVA),
its states ``initial_state`` [N, HV, K, V] and return ``(o, final_state)`` (``final_state``
None unless ``output_final_state=True``).
"""

from __future__ import annotations

import re

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
    "RecurrentState",
    "GatedDecoder",
    "DeltaRuleDecoder",
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
    "set_num_threads",
    "get_num_threads",
    "__version__",
]

__version__: str = _ext.__version__

#: The feature maps by name: elu (elu(x) + 1, the paper's), softmax_split (softmax over a
#: query's features, over the keys per feature), cosine (1 + cos(q, k): [1, x/|x|]), silu
#: (x·σ(x)), identity (φ(x) = x), relu (max(x, 0)), dpfp / dpfp2 / dpfp3 (DPFP with ν = 1, 2, 3:
#: F = 2·D·ν products of ReLU pairs) and taylor2 (Based's second-order Taylor map,
#: F = 1 + D + D²). See docs/SPEC.md of the C++ library. The C++ library's FAVOR+ map (random
#: features, with a seed and a feature count) has no name here.
FEATURE_MAPS = ("elu", "softmax_split", "cosine", "silu", "identity", "relu", "dpfp", "dpfp2",
                "dpfp3", "taylor2")
#: The maps of the gated kernels (identity: RetNet, Mamba-2, GLA; elu) and of the delta rule,
#: applied to q and k (never to v): identity (q and k the caller normalised), l2norm =
#: x / sqrt(|x|² + l2norm_eps) and l2norm_silu = silu(x) / sqrt(|silu(x)|² + l2norm_eps).
#: DeltaNet, Gated DeltaNet and Qwen3-Next apply a short convolution and a SiLU to q, k and v
#: before the kernel, which then only L2-normalises q and k (FLA's use_qk_l2norm_in_kernel,
#: with eps = 1e-6): after that convolution and SiLU the kernel's map is l2norm (the FLA names
#: below with use_qk_l2norm_in_kernel=True), not l2norm_silu, which would apply the SiLU a
#: second time. l2norm_silu is for q and k taken before any SiLU (v then gets none here).
GATED_FEATURE_MAPS = ("identity", "elu")
DELTA_FEATURE_MAPS = ("identity", "l2norm", "l2norm_silu")

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def set_num_threads(n: int) -> None:
    """Threads of the kernels (OpenMP); 1 runs everything on the calling thread. linattn's own
    setting, for every Python thread: applied to each kernel call and undone after it, so that
    neither torch (``import torch``, ``torch.set_num_threads``) nor anything else that sets
    OpenMP's thread count changes it, and linattn's calls do not change theirs."""
    _ext.set_num_threads(int(n))


def get_num_threads() -> int:
    """Threads the kernels use: the last ``set_num_threads``, else the first entry of
    OMP_NUM_THREADS when set, else every processor OpenMP may use (1 when the module was built
    without OpenMP). Importing torch does not change it."""
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
        self.names, self.arrays = list(names), list(arrays)

    def with_(self, **named) -> "_Shapes":
        """These shapes and those of further (non-None) arguments."""
        extra = [(n, np.asarray(a)) for n, a in named.items() if a is not None]
        return _Shapes(self.names + [n for n, _ in extra], self.arrays + [a for _, a in extra])

    def __str__(self) -> str:
        return ", ".join(f"{n} {a.shape}" for n, a in zip(self.names, self.arrays))


def _kernel(fn: str, shapes, f, *args):
    """f(*args) (an extension function), its ValueError raised again under the Python function's
    name with the call's shapes. The checks of this module run first; what reaches here is a
    check only the C++ library makes, whose message names the C++ function and its operands (Q,
    K, V: q, k, v as packed N x (H·D) rows; log_a, log_gates: g)."""
    try:
        return f(*args)
    except ValueError as e:
        msg = str(e)
        m = re.match(r"(linattn::)?([\w:.]+): ", msg)
        origin, body = (m.group(0)[:-2], msg[m.end():]) if m else ("", msg)
        for cpp, py in (("log_a", "g"), ("log_gates", "g"), ("log-decays", "g (log decays)")):
            body = body.replace(cpp, py)
        where = f"called with {shapes}"
        if origin and origin != fn:
            where += f"; raised by the C++ {origin}, whose Q, K, V are q, k, v as packed N x (H·D) rows"
        raise ValueError(f"{fn}: {body} [{where}]") from None


def _first_bad(fn: str, name: str, a: np.ndarray, ok: np.ndarray, rule: str, shapes) -> None:
    """ValueError for the first entry of `a` where `ok` is False: "beta[0, 3, 1] = -0.08: ..."."""
    if ok.all():
        return
    idx = tuple(int(i) for i in np.argwhere(~ok)[0])
    where = ", ".join(map(str, idx))
    # str(): the shortest repr of the array's own dtype (a float32 entry formatted as a Python float
    # would print its double expansion).
    raise ValueError(f"{fn}: {name}[{where}] = {str(a[idx])}: {rule} (got {shapes})")


def _check_log_gates(fn: str, g: np.ndarray, shapes) -> None:
    with np.errstate(invalid="ignore"):
        _first_bad(fn, "g", g, np.isfinite(g) & (g <= 0), "g holds log gates (log decays), which must be "
                   "finite and <= 0", shapes)


def _check_beta(fn: str, beta: np.ndarray, shapes) -> None:
    with np.errstate(invalid="ignore"):
        _first_bad(fn, "beta", beta, (beta >= 0) & (beta <= 2), "beta must be in [0, 2]", shapes)


def _offsets_of(fn: str, cu_seqlens, rows: int, shapes) -> np.ndarray:
    """cu_seqlens as int64 offsets: 1-D, B + 1 >= 2 non-decreasing entries from 0 to `rows`."""
    a = np.asarray(cu_seqlens)
    if a.ndim != 1 or a.size < 2 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D integer array of B + 1 >= 2 offsets, got "
                         f"{a.dtype} of shape {a.shape} (with {shapes})")
    cu = np.ascontiguousarray(a, dtype=np.int64)
    if cu[0] != 0 or cu[-1] != rows:
        raise ValueError(f"{fn}: cu_seqlens must run from 0 to {rows} (the packed rows of q), got {cu[0]} ... "
                         f"{cu[-1]} (with {shapes})")
    steps = np.diff(cu)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0)) + 1
        raise ValueError(f"{fn}: cu_seqlens must be non-decreasing, got {cu[i - 1]} then {cu[i]} at entry {i} "
                         f"(with {shapes})")
    return cu


class _Packed:
    """The arguments of one call as the C++ kernels take them: 2-D row-major arrays of H·D
    columns and the offsets of the sequences. shared_heads: q and k may hold Hk heads shared by
    v's H (Hk dividing H; ``heads`` is H, ``key_heads`` Hk), as the plain linear kernels'
    key_heads option takes them; otherwise all three hold the same heads."""

    def __init__(self, fn: str, q, k, v, cu_seqlens, dout=None, causal: bool = False, shared_heads: bool = False):
        names = dict(q=q, k=k, v=v) if dout is None else dict(q=q, k=k, v=v, dout=dout)
        arrays = _arrays(fn, **names)
        q, k, v = arrays[:3]
        nd = q.ndim
        shapes = _Shapes(names, arrays)  # formatted only for an error message
        self.fn, self.shapes = fn, shapes
        if nd not in (2, 3, 4) or any(a.ndim != nd for a in arrays):
            raise ValueError(f"{fn}: q, k and v must all be [N, D], [N, H, D] or [B, T, H, D], got {shapes}")
        key_heads = 1 if nd == 2 else q.shape[-2]
        heads = 1 if nd == 2 else v.shape[-2]
        if nd > 2 and not shared_heads and (k.shape[-2] != key_heads or heads != key_heads):
            raise ValueError(f"{fn}: q, k and v must have the same number of heads, got {shapes}")
        if nd > 2 and k.shape[-2] != key_heads:
            raise ValueError(f"{fn}: q and k must have the same number of heads Hk, got Hk = {key_heads} (q) and "
                             f"{k.shape[-2]} (k) with {shapes}")
        if nd > 2 and (heads % key_heads != 0 if key_heads else heads != 0):
            raise ValueError(f"{fn}: v's heads H must be a positive multiple of q's and k's heads Hk (value head h "
                             f"reads key head h // (H // Hk)), got H = {heads}, Hk = {key_heads} ({shapes})")
        if nd == 4 and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
            raise ValueError(f"{fn}: q, k and v must have the same batch size, got {shapes}")
        if k.shape[:-2 if nd > 2 else -1] != v.shape[:-2 if nd > 2 else -1]:
            raise ValueError(f"{fn}: k and v must have the same rows, got {shapes}")
        if k.shape[-1] != q.shape[-1]:
            raise ValueError(f"{fn}: q and k must have the same last dimension D, got {shapes}")
        if q.shape[-1] == 0:
            raise ValueError(f"{fn}: the key dimension D (the last of q and k) must be positive, got {shapes}")
        if causal and k.shape[:-1] != q.shape[:-1]:
            raise ValueError(f"{fn}: causal attention needs k and v with q's tokens (S = T, the same "
                             f"sequences), got {shapes}")
        if cu_seqlens is not None and k.shape[:-1] != q.shape[:-1]:
            raise ValueError(f"{fn}: with cu_seqlens, q, k and v must have the same rows (the offsets serve "
                             f"all three), got {shapes}")
        self.heads, self.key_heads = heads, key_heads
        self.q_shape, self.k_shape, self.v_shape = q.shape, k.shape, v.shape
        self.out_shape = q.shape[:-1] + (v.shape[-1],) if nd == 2 else q.shape[:-2] + v.shape[-2:]
        if dout is not None and arrays[3].shape != self.out_shape:
            raise ValueError(f"{fn}: dout must have the output's shape {self.out_shape}, got {shapes}")
        self.arrays = [self._rows(a) for a in arrays]
        self.q_offsets = self.k_offsets = None
        if cu_seqlens is not None:
            if nd == 4 and q.shape[0] != 1:
                raise ValueError(f"{fn}: with cu_seqlens, [B, T, H, D] inputs must have B = 1, got {shapes}")
            cu = _offsets_of(fn, cu_seqlens, self.arrays[0].shape[0], shapes)
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


def _keep(fn: str, p: _Packed, key_padding_mask):
    """key_padding_mask (True = padding) as the kernels' keep mask: one bool per packed key row,
    True = the key takes part; None when there is no mask."""
    if key_padding_mask is None:
        return None
    m = np.asarray(key_padding_mask)
    if m.dtype != np.bool_:
        raise TypeError(f"{fn}: key_padding_mask must be a bool array (True = padding), got {m.dtype}")
    want = p.k_shape[:2] if len(p.k_shape) == 4 else p.k_shape[:1]
    if m.shape != want:
        raise ValueError(f"{fn}: key_padding_mask must have shape {want} (one entry per key row), got {m.shape}")
    return np.ascontiguousarray(~m.reshape(-1))


def linear_attention(q, k, v, feature_map: str = "elu", causal: bool = False, cu_seqlens=None,
                     key_padding_mask=None, initial_state=None, output_final_state: bool = False):
    """Linear attention: out_i = φ(q_i)ᵀ S / φ(q_i)ᵀ z with S = Σ_j φ(k_j) v_jᵀ, z = Σ_j φ(k_j)
    over every key j (causal=False) or the keys j ≤ i (causal=True); O(N) time and memory.

    Shared key heads (GVA): q and k may have Hk heads and v H, a multiple of Hk; value head h
    then reads query/key head h // (H // Hk) in place (the C++ key_heads option), the same
    result as q and k repeated to H heads (``np.repeat(k, H // Hk, axis=-2)``), and the output
    has v's H heads.

    key_padding_mask: True marks keys that take no part (module docs). Causal only:
    initial_state (a RecurrentState, one sequence per sequence of the input, of the call's
    heads) continues from its states; output_final_state=True returns ``(out, state)`` with a
    new RecurrentState at the end of every sequence, ready for ``state.step`` (initial_state is
    not changed).

    >>> out = linattn.linear_attention(q, k, v, "elu", causal=True)   # q, k, v [B, T, H, D]
    >>> out, state = linattn.linear_attention(q, k, v, causal=True, output_final_state=True)
    >>> out = linattn.linear_attention(q2, k2, v)   # q2, k2 [B, T, 2, D] for v's 8 heads
    """
    fn = "causal_linear_attention" if causal else "linear_attention"
    p = _Packed(fn, q, k, v, cu_seqlens, causal=bool(causal), shared_heads=True)
    keep = _keep(fn, p, key_padding_mask)
    if initial_state is None and not output_final_state:
        out = _kernel(fn, p.shapes, _ext.linear_forward, *p.arrays, p.heads, str(feature_map), bool(causal),
                      p.q_offsets, p.k_offsets, keep, p.key_heads)
        return out.reshape(p.out_shape)
    if not causal:
        raise ValueError(f"{fn}: initial_state and output_final_state need causal=True")
    if initial_state is None:
        sequences = 1 if p.q_offsets is None else len(p.q_offsets) - 1
        state = RecurrentState(sequences, p.heads, p.q_shape[-1], p.v_shape[-1], feature_map,
                               p.arrays[0].dtype, num_key_heads=p.key_heads)
    else:
        if not isinstance(initial_state, RecurrentState):
            raise TypeError(f"{fn}: initial_state must be a linattn.RecurrentState, got {type(initial_state).__name__}")
        if initial_state.feature_map != str(feature_map) or initial_state.dtype != p.arrays[0].dtype:
            raise ValueError(f"{fn}: initial_state has feature_map '{initial_state.feature_map}' and dtype "
                             f"{initial_state.dtype}, the call '{feature_map}' and {p.arrays[0].dtype}")
        if (initial_state.num_heads, initial_state.num_key_heads) != (p.heads, p.key_heads):
            raise ValueError(f"{fn}: initial_state has H = {initial_state.num_heads} value heads over "
                             f"Hk = {initial_state.num_key_heads} key heads, the call H = {p.heads} (v) over "
                             f"Hk = {p.key_heads} (q, k) ({p.shapes})")
        state = initial_state.copy()
    out = _kernel(fn, p.shapes, state._d.prefill, *p.arrays, keep, p.q_offsets).reshape(p.out_shape)
    return (out, state) if output_final_state else out


def linear_attention_backward(q, k, v, dout, feature_map: str = "elu", causal: bool = False, cu_seqlens=None,
                              key_padding_mask=None):
    """Gradients (dq, dk, dv) of linear_attention() for ∂L/∂out = dout (the output's shape, v's
    heads); masked keys get zero gradients. With a mask the heads run one after the other.
    With shared key heads (q, k Hk heads, v H) dq and dk have q's and k's shapes: a key head's
    gradient is the sum over the H // Hk value heads that read it."""
    fn = "causal_linear_attention_backward" if causal else "linear_attention_backward"
    p = _Packed(fn, q, k, v, cu_seqlens, dout, causal=bool(causal), shared_heads=True)
    keep = _keep(fn, p, key_padding_mask)
    dq, dk, dv = _kernel(fn, p.shapes, _ext.linear_backward, *p.arrays, p.heads, str(feature_map), bool(causal),
                         p.q_offsets, p.k_offsets, keep, p.key_heads)
    return dq.reshape(p.q_shape), dk.reshape(p.k_shape), dv.reshape(p.v_shape)


def softmax_attention(q, k, v, causal: bool = False, cu_seqlens=None, key_padding_mask=None):
    """Softmax attention, softmax(q kᵀ / √D) v per head (causal: keys j ≤ i), the O(N²)
    baseline linear attention replaces; tiled, never forming the N x N matrix.
    key_padding_mask (non-causal only; True = padding): the kept keys are gathered (one copy of
    them), a query with none left gets zeros."""
    fn = "causal_softmax_attention" if causal else "softmax_attention"
    p = _Packed(fn, q, k, v, cu_seqlens, causal=bool(causal))
    keep = _keep(fn, p, key_padding_mask)
    out = _kernel(fn, p.shapes, _ext.softmax_forward, *p.arrays, p.heads, bool(causal), p.q_offsets, p.k_offsets,
                  keep)
    return out.reshape(p.out_shape)


def softmax_attention_backward(q, k, v, dout, causal: bool = False, cu_seqlens=None, key_padding_mask=None):
    """Gradients (dq, dk, dv) of softmax_attention() for ∂L/∂out = dout."""
    fn = "causal_softmax_attention_backward" if causal else "softmax_attention_backward"
    p = _Packed(fn, q, k, v, cu_seqlens, dout, causal=bool(causal))
    keep = _keep(fn, p, key_padding_mask)
    dq, dk, dv = _kernel(fn, p.shapes, _ext.softmax_backward, *p.arrays, p.heads, bool(causal), p.q_offsets,
                         p.k_offsets, keep)
    return dq.reshape(p.q_shape), dk.reshape(p.k_shape), dv.reshape(p.v_shape)


def _params(fn: str, p: _Packed, name: str, x, dtype, per_feature_ok: bool, feature_dim: int | None = None,
            shapes=None):
    """A per-token parameter as the 2-D packed array the kernels take: of q's leading shape (one
    per token and head) or, for per-feature gates, of q's leading shape + (F,)."""
    a = np.asarray(x)
    if a.dtype != dtype:
        raise TypeError(f"{fn}: {name} must have q's dtype {dtype}, got {a.dtype}")
    shapes = p.shapes if shapes is None else shapes
    lead = tuple(p.q_shape[:-1])
    rows = int(np.prod(lead[:-1])) if len(lead) > 1 else lead[0]
    heads = lead[-1] if len(lead) > 1 else 1
    if a.shape == lead:
        return np.ascontiguousarray(a).reshape(rows, heads)
    if per_feature_ok and a.shape == lead + (feature_dim,):
        return np.ascontiguousarray(a).reshape(rows, heads * feature_dim)
    want = f"{lead}" + (f" or {lead + (feature_dim,)}" if per_feature_ok else "")
    raise ValueError(f"{fn}: {name} must have shape {want} (q's leading dimensions: one entry per token and "
                     f"head{', or per feature' if per_feature_ok else ''}), got {a.shape} (with {shapes})")


def _scale(scale, q) -> float:
    return 1.0 / np.sqrt(np.asarray(q).shape[-1]) if scale is None else float(scale)


def gated_linear_attention(q, k, v, g, feature_map: str = "identity", scale=None, normalize: bool = False, cu_seqlens=None):
    """Causal attention with decay (RetNet, Mamba-2) or per-feature gates (GLA):
    S_i = diag(exp(g_i)) S_{i-1} + φ(k_i) v_iᵀ, out_i = scale·φ(q_i)ᵀ S_i (normalize=True:
    divided by φ(q_i)ᵀ z_i, z decayed likewise). g: log gates ≤ 0 of q's leading shape (one per
    token and head) or q's shape (one per token, head and feature, F = D). scale: 1/√D when
    None (the models' convention)."""
    fn = "gated_linear_attention"
    p = _Packed(fn, q, k, v, cu_seqlens, causal=True)
    shapes = p.shapes.with_(g=g)
    G = _params(fn, p, "g", g, p.arrays[0].dtype, True, np.asarray(q).shape[-1], shapes)
    _check_log_gates(fn, np.asarray(g), shapes)
    out = _kernel(fn, shapes, _ext.gated_forward, *p.arrays, G, p.heads, str(feature_map), _scale(scale, q),
                  bool(normalize), p.q_offsets)
    return out.reshape(p.out_shape)


def gated_linear_attention_backward(q, k, v, g, dout, feature_map: str = "identity", scale=None, normalize: bool = False, cu_seqlens=None):
    """Gradients (dq, dk, dv, dg) of gated_linear_attention() for ∂L/∂out = dout."""
    fn = "gated_linear_attention_backward"
    p = _Packed(fn, q, k, v, cu_seqlens, dout, causal=True)
    shapes = p.shapes.with_(g=g)
    G = _params(fn, p, "g", g, p.arrays[0].dtype, True, np.asarray(q).shape[-1], shapes)
    _check_log_gates(fn, np.asarray(g), shapes)
    dq, dk, dv, dg = _kernel(fn, shapes, _ext.gated_backward, *p.arrays[:3], G, p.arrays[3], p.heads,
                             str(feature_map), _scale(scale, q), bool(normalize), p.q_offsets)
    return dq.reshape(p.q_shape), dk.reshape(p.k_shape), dv.reshape(p.v_shape), dg.reshape(np.shape(g))


def _delta_params(fn: str, p: _Packed, beta, g, feature_map, l2norm_eps):
    """beta and g (or None) packed and checked, and the map's eps, for the delta rule."""
    shapes = p.shapes.with_(beta=beta, g=g)
    dtype = p.arrays[0].dtype
    B = _params(fn, p, "beta", beta, dtype, False, None, shapes)
    A = None if g is None else _params(fn, p, "g", g, dtype, False, None, shapes)
    _check_beta(fn, np.asarray(beta), shapes)
    if g is not None:
        _check_log_gates(fn, np.asarray(g), shapes)
    eps = float(l2norm_eps)
    if not (0 <= eps < float("inf")):
        raise ValueError(f"{fn}: l2norm_eps = {eps}: l2norm_eps must be finite and >= 0")
    if eps != 0 and str(feature_map) not in ("l2norm", "l2norm_silu"):
        raise ValueError(f"{fn}: l2norm_eps = {eps} needs feature_map 'l2norm' or 'l2norm_silu', got "
                         f"'{feature_map}'")
    return B, A, eps, shapes


def delta_rule_attention(q, k, v, beta, g=None, feature_map: str = "l2norm_silu", scale=None, cu_seqlens=None,
                         l2norm_eps: float = 0.0):
    """The delta rule (DeltaNet; Gated DeltaNet with g): with k̂ = φ(k),
    S_t = exp(g_t)(I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ, out_t = scale·φ(q_t)ᵀ S_t.
    beta in [0, 2] and g (log decays ≤ 0, or None: no decay) have q's leading shape (one per
    token and head). scale: 1/√D when None. Chunked or recurrent, whichever is faster.

    feature_map, applied to q and k only (v is used as given): "l2norm_silu" (the default)
    silu(x) / sqrt(|silu(x)|² + l2norm_eps); "l2norm" x / sqrt(|x|² + l2norm_eps); "identity"
    (q and k normalised by the caller). l2norm_eps = 0 divides by the norm; FLA and transformers
    use 1e-6. The models (DeltaNet, Gated DeltaNet, Qwen3-Next) put a short convolution and a
    SiLU on q, k and v before the kernel, which then only L2-normalises q and k: pass the
    convolved and activated q, k, v with "l2norm" and l2norm_eps=1e-6 (as
    ``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)`` does), not "l2norm_silu",
    which would apply the SiLU to q and k a second time; "l2norm_silu" is for q and k taken
    before their SiLU (apply v's yourself)."""
    fn = "delta_rule_attention"
    p = _Packed(fn, q, k, v, cu_seqlens, causal=True)
    B, A, eps, shapes = _delta_params(fn, p, beta, g, feature_map, l2norm_eps)
    out = _kernel(fn, shapes, _ext.delta_forward, *p.arrays, B, A, p.heads, str(feature_map), _scale(scale, q),
                  p.q_offsets, eps)
    return out.reshape(p.out_shape)


def delta_rule_attention_backward(q, k, v, beta, g, dout, feature_map: str = "l2norm_silu", scale=None, cu_seqlens=None,
                                  l2norm_eps: float = 0.0):
    """Gradients (dq, dk, dv, dbeta, dg) of delta_rule_attention() for ∂L/∂out = dout; dg is
    None when g is. The map's gradient includes l2norm_eps (the Jacobian of
    x / sqrt(|x|² + eps) is (I − φφᵀ) / sqrt(|x|² + eps))."""
    fn = "delta_rule_attention_backward"
    p = _Packed(fn, q, k, v, cu_seqlens, dout, causal=True)
    B, A, eps, shapes = _delta_params(fn, p, beta, g, feature_map, l2norm_eps)
    dq, dk, dv, db, dg = _kernel(fn, shapes, _ext.delta_backward, *p.arrays[:3], B, A, p.arrays[3], p.heads,
                                 str(feature_map), _scale(scale, q), p.q_offsets, eps)
    return (dq.reshape(p.q_shape), dk.reshape(p.k_shape), dv.reshape(p.v_shape),
            db.reshape(np.shape(beta)), None if dg is None else dg.reshape(np.shape(g)))


# The decoder lives in _decode.py (imported here, after the helpers it uses).
from ._decode import RecurrentState, _restore  # noqa: E402,F401
# The gated and delta-rule decoders (FLA's per-token layout and states) live in _decoders.py.
from ._decoders import DeltaRuleDecoder, GatedDecoder  # noqa: E402

# flash-linear-attention's names (docs/python.md); the library picks the chunked or the
# recurrent form itself, so a chunk_ name and its fused_recurrent_ twin run the same kernels.
from ._fla_names import NumpyOps as _NumpyOps, fla_names as _fla_names  # noqa: E402

_fla_funcs = _fla_names(_NumpyOps, "linattn")
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
