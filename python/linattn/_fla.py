"""flash-linear-attention's calls on numpy arrays: the gated kernels and the delta rule in FLA's
layout with its states, shared key heads and per-channel decays, forward and backward.

Layout (FLA's): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with HV a multiple of H (GVA: value
head h reads key head h // (HV // H)); per-token parameters ``[B, T, HV]`` (one per head) or
``[B, T, HV, K]`` (per key channel); with ``cu_seqlens`` B = 1 and the T rows are the packed
sequences. States ``[N, HV, K, V]``, N = B or len(cu_seqlens) - 1: S of head h of sequence n is
``state[n, h]``, K x V, what the recurrence S_t = exp(g_t) S_{t-1} + ... carries.

The public names (chunk_gla, chunk_kda, ...) are made by ``fla_names`` over a set of operations
(``NumpyOps`` here, linattn.torch's autograd functions there), so that the numpy and torch
functions take the same arguments and check them the same way.
"""

from __future__ import annotations

import numpy as np

from . import _linattn as _ext
from . import _arrays, _check_beta, _check_log_gates, _kernel, _offsets_of, _Shapes

#: The eps of flash-linear-attention's l2norm (fla.modules.l2norm, and transformers' Qwen3-Next
#: torch_chunk_gated_delta_rule): x / sqrt(Σ x² + 1e-6), the map of use_qk_l2norm_in_kernel.
FLA_L2NORM_EPS = 1e-6


class Call:
    """The arrays of one call as the kernels take them: q, k, v (and do) as packed row-major
    B·T x (heads·dim) arrays, the sequences' offsets, and the shapes for messages."""

    def __init__(self, fn: str, q, k, v, cu_seqlens, do=None):
        names = dict(q=q, k=k, v=v) if do is None else dict(q=q, k=k, v=v, do=do)
        arrays = _arrays(fn, **names)
        q, k, v = arrays[:3]
        self.fn, self.shapes = fn, _Shapes(names, arrays)
        if any(a.ndim != 4 for a in arrays):
            raise ValueError(f"{fn}: q, k must be [B, T, H, K] and v [B, T, HV, V] (FLA's layout), got {self.shapes}")
        if k.shape != q.shape:
            raise ValueError(f"{fn}: q and k must have the same shape [B, T, H, K], got {self.shapes}")
        B, T, Hk, K = q.shape
        if v.shape[:2] != (B, T):
            raise ValueError(f"{fn}: v must have q's B and T, got {self.shapes}")
        H, V = v.shape[2], v.shape[3]
        if K == 0 or Hk == 0 or H % Hk != 0:
            raise ValueError(f"{fn}: v's heads HV = {H} must be a positive multiple of q's and k's H = {Hk} "
                             f"(GVA) and K > 0, got {self.shapes}")
        if do is not None and arrays[3].shape != v.shape:
            raise ValueError(f"{fn}: do must have the output's shape {v.shape}, got {self.shapes}")
        self.B, self.T, self.Hk, self.H, self.K, self.V = B, T, Hk, H, K, V
        self.dtype = q.dtype
        self.key_heads = 0 if Hk == H else Hk
        self.rows = [np.ascontiguousarray(a).reshape(B * T, -1) for a in arrays]
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"{fn}: with cu_seqlens, B must be 1 (the T rows are the packed sequences), "
                                 f"got {self.shapes}")
            self.offsets = _offsets_of(fn, cu_seqlens, T, self.shapes)
        else:
            self.offsets = np.arange(B + 1, dtype=np.int64) * T
        self.N = len(self.offsets) - 1

    def params(self, name: str, x, per_channel: bool | None):
        """A per-token parameter ([B, T, HV], or [B, T, HV, K] per channel; per_channel None:
        either) packed as the kernels take it, in q's dtype; its array for the checks."""
        a = np.asarray(x)
        if not np.issubdtype(a.dtype, np.floating):
            raise TypeError(f"{self.fn}: {name} must be a float array, got {a.dtype}")
        a = a.astype(self.dtype, copy=False)
        head, channel = (self.B, self.T, self.H), (self.B, self.T, self.H, self.K)
        allowed = {None: (head, channel), False: (head,), True: (channel,)}[per_channel]
        if a.shape not in allowed:
            want = " or ".join(str(s) for s in allowed)
            raise ValueError(f"{self.fn}: {name} must have shape {want} ([B, T, HV]{' or [B, T, HV, K]' if per_channel is None else ''}), "
                             f"got {a.shape} (with {self.shapes})")
        return np.ascontiguousarray(a).reshape(self.B * self.T, -1), a

    def state(self, name: str, s):
        """A state argument [N, HV, K, V] in q's dtype (FLA keeps states in float32), or None."""
        if s is None:
            return None
        a = np.asarray(s)
        if not np.issubdtype(a.dtype, np.floating):
            raise TypeError(f"{self.fn}: {name} must be a float array, got {a.dtype}")
        want = (self.N, self.H, self.K, self.V)
        if a.shape != want:
            raise ValueError(f"{self.fn}: {name} must have shape {want} ([N, HV, K, V], N = {self.N} sequences), "
                             f"got {a.shape} (with {self.shapes})")
        return np.ascontiguousarray(a, dtype=self.dtype)

    def with_(self, **named) -> _Shapes:
        return self.shapes.with_(**named)


def _scale(scale, K: int) -> float:
    return 1.0 / np.sqrt(K) if scale is None else float(scale)


def gated(fn, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    """GLA (g [B, T, HV, K]) or simple GLA (g [B, T, HV]): S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ,
    o_t = scale·S_tᵀ q_t. Returns (o, final state or None)."""
    c = Call(fn, q, k, v, cu_seqlens)
    G, ga = c.params("g", g, None)
    shapes = c.with_(g=ga, initial_state=initial_state)
    _check_log_gates(fn, ga, shapes)
    h0 = c.state("initial_state", initial_state)
    o, ht = _kernel(fn, shapes, _ext.fla_gated_forward, *c.rows, G, c.H, c.key_heads, "identity",
                    _scale(scale, c.K), c.offsets, h0, bool(output_final_state))
    return o.reshape(c.B, c.T, c.H, c.V), ht


def gated_backward(fn, q, k, v, g, do, scale, initial_state, dht, cu_seqlens):
    """(dq, dk, dv, dg, dh0) of gated() for ∂L/∂o = do and ∂L/∂final state = dht (None: 0);
    dh0 is None without initial_state."""
    c = Call(fn, q, k, v, cu_seqlens, do)
    G, ga = c.params("g", g, None)
    shapes = c.with_(g=ga, initial_state=initial_state, dht=dht)
    h0, dh = c.state("initial_state", initial_state), c.state("dht", dht)
    q2, k2, v2, do2 = c.rows
    dq, dk, dv, dg, dh0 = _kernel(fn, shapes, _ext.fla_gated_backward, q2, k2, v2, G, do2, c.H, c.key_heads,
                                  "identity", _scale(scale, c.K), c.offsets, h0, dh)
    return (dq.reshape(c.B, c.T, c.Hk, c.K), dk.reshape(c.B, c.T, c.Hk, c.K), dv.reshape(c.B, c.T, c.H, c.V),
            dg.reshape(ga.shape), dh0)


def _delta_args(c: Call, beta, g, initial_state, extra=None):
    B, ba = c.params("beta", beta, False)
    A, aa = (None, None) if g is None else c.params("g", g, None)
    shapes = c.with_(beta=ba, g=aa, initial_state=initial_state, **(extra or {}))
    _check_beta(c.fn, ba, shapes)
    if aa is not None:
        _check_log_gates(c.fn, aa, shapes)
    return B, ba, A, aa, shapes


def delta(fn, q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens, l2norm: bool):
    """The delta rule: S_t = diag(exp(g_t)) (S_{t-1} - β_t k_t (k_tᵀ S_{t-1})) + β_t k_t v_tᵀ with g
    None (DeltaNet), [B, T, HV] (Gated DeltaNet) or [B, T, HV, K] (KDA); o_t = scale·S_tᵀ q_t;
    l2norm: q and k mapped by FLA's l2norm first. Returns (o, final state or None)."""
    c = Call(fn, q, k, v, cu_seqlens)
    B, _, A, _, shapes = _delta_args(c, beta, g, initial_state)
    h0 = c.state("initial_state", initial_state)
    fmap, eps = ("l2norm", FLA_L2NORM_EPS) if l2norm else ("identity", 0.0)
    o, ht = _kernel(fn, shapes, _ext.fla_delta_forward, *c.rows, B, A, c.H, c.key_heads, fmap, _scale(scale, c.K),
                    c.offsets, eps, h0, bool(output_final_state))
    return o.reshape(c.B, c.T, c.H, c.V), ht


def delta_backward(fn, q, k, v, beta, g, do, scale, initial_state, dht, cu_seqlens, l2norm: bool):
    """(dq, dk, dv, dbeta, dg, dh0) of delta(); dg is None when g is, dh0 when initial_state is."""
    c = Call(fn, q, k, v, cu_seqlens, do)
    B, ba, A, aa, shapes = _delta_args(c, beta, g, initial_state, dict(dht=dht))
    h0, dh = c.state("initial_state", initial_state), c.state("dht", dht)
    fmap, eps = ("l2norm", FLA_L2NORM_EPS) if l2norm else ("identity", 0.0)
    q2, k2, v2, do2 = c.rows
    dq, dk, dv, db, dg, dh0 = _kernel(fn, shapes, _ext.fla_delta_backward, q2, k2, v2, B, A, do2, c.H,
                                      c.key_heads, fmap, _scale(scale, c.K), c.offsets, eps, h0, dh)
    return (dq.reshape(c.B, c.T, c.Hk, c.K), dk.reshape(c.B, c.T, c.Hk, c.K), dv.reshape(c.B, c.T, c.H, c.V),
            db.reshape(ba.shape), None if dg is None else dg.reshape(aa.shape), dh0)


def _float_dtype(a: np.ndarray):
    return a.dtype if a.dtype in (np.float32, np.float64) else np.dtype(np.float32)


def _gate_params(fn, a: np.ndarray, A_log, dt_bias, lower_bound):
    """A_log [HV] (zeros when None with a lower bound: FLA's lb·sigmoid(g + dt_bias)) and
    dt_bias [HV·K] (or [HV, K], or None) in a's dtype, checked against g [B, T, HV, K]."""
    if a.ndim != 4:
        raise ValueError(f"{fn}: with use_gate_in_kernel, g must be [B, T, HV, K] (the gate's raw input), got {a.shape}")
    H, K = a.shape[2], a.shape[3]
    if A_log is None:
        if lower_bound is None:
            raise ValueError(f"{fn}: use_gate_in_kernel=True needs A_log, or lower_bound for lb·sigmoid(g + dt_bias)")
        A = np.zeros(H, a.dtype)
    else:
        A = np.ascontiguousarray(np.asarray(A_log, dtype=a.dtype).reshape(-1))
        if A.size != H:
            raise ValueError(f"{fn}: A_log must have HV = {H} entries (one per value head), got shape {np.shape(A_log)} "
                             f"(g {a.shape})")
    bias = None
    if dt_bias is not None:
        bias = np.ascontiguousarray(np.asarray(dt_bias, dtype=a.dtype).reshape(-1))
        if bias.size != H * K:
            raise ValueError(f"{fn}: dt_bias must have HV·K = {H * K} entries ([HV·K] or [HV, K]), got shape "
                             f"{np.shape(dt_bias)} (g {a.shape})")
    return A, bias, None if lower_bound is None else float(lower_bound)


def gate(fn, g, A_log, dt_bias, lower_bound):
    """KDA's log decays from the gate's raw input g [B, T, HV, K] (core/gates.hpp):
    -exp(A_log)·softplus(g + dt_bias), or lower_bound·sigmoid(exp(A_log)·(g + dt_bias))."""
    a = np.asarray(g)
    a = a.astype(_float_dtype(a), copy=False)
    A, bias, lb = _gate_params(fn, a, A_log, dt_bias, lower_bound)
    rows = np.ascontiguousarray(a).reshape(-1, a.shape[2] * a.shape[3])
    shapes = _Shapes(["g", "A_log", "dt_bias"], [a, A, np.zeros(0) if bias is None else bias])
    return _kernel(fn, shapes, _ext.gate_forward, rows, A, bias, lb).reshape(a.shape)


def gate_backward(fn, g, A_log, dt_bias, lower_bound, dgk):
    """(dg, dA_log, ddt_bias) of gate() for ∂L/∂(log decays) = dgk; None for an absent A_log or
    dt_bias; dA_log and ddt_bias in the shapes given."""
    a = np.asarray(g)
    a = a.astype(_float_dtype(a), copy=False)
    A, bias, lb = _gate_params(fn, a, A_log, dt_bias, lower_bound)
    rows = np.ascontiguousarray(a).reshape(-1, a.shape[2] * a.shape[3])
    d = np.ascontiguousarray(np.asarray(dgk, dtype=a.dtype)).reshape(rows.shape)
    da, dl, db = _ext.gate_backward(rows, A, bias, d, lb)
    return (da.reshape(a.shape), None if A_log is None else dl.reshape(np.shape(A_log)),
            None if db is None else db.reshape(np.shape(dt_bias)))


def beta_sigmoid(fn, beta, times_two: bool):
    """FLA's use_beta_sigmoid_in_kernel: β = sigmoid(beta), × 2 with allow_neg_eigval."""
    b = np.asarray(beta)
    b = b.astype(_float_dtype(b), copy=False)
    rows = np.ascontiguousarray(b).reshape(-1, b.shape[-1] if b.ndim else 1)
    return _ext.beta_forward(rows, bool(times_two)).reshape(b.shape)


def beta_sigmoid_backward(beta, dbeta, times_two: bool):
    b = np.asarray(beta)
    b = b.astype(_float_dtype(b), copy=False)
    rows = np.ascontiguousarray(b).reshape(-1, b.shape[-1] if b.ndim else 1)
    d = np.ascontiguousarray(np.asarray(dbeta, dtype=b.dtype)).reshape(rows.shape)
    return _ext.beta_backward(rows, d, bool(times_two)).reshape(b.shape)
