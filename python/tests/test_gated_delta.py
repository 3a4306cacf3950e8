"""Decay, gates and the delta rule from Python against per-token recurrences in NumPy float64
(docs/SPEC.md §9 of the C++ library), and their gradients against central differences."""

import numpy as np
import pytest

import linattn
from test_linattn import TOL, central_difference_worst, rel_err


def silu(x):
    return x / (1 + np.exp(-x))


def phi_np(name, x):
    if name == "identity":
        return x
    if name == "elu":
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
    if name == "l2norm":
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    if name == "l2norm_silu":
        s = silu(x)
        return s / np.linalg.norm(s, axis=-1, keepdims=True)
    raise ValueError(name)


def gated_head(q, k, v, g, name, scale, normalize):
    """One head: g [N] (decay) or [N, F] (per-feature gates)."""
    pq, pk = phi_np(name, q), phi_np(name, k)
    F, M = pk.shape[1], v.shape[1]
    S, z = np.zeros((F, M)), np.zeros(F)
    out = np.zeros((q.shape[0], M))
    for i in range(q.shape[0]):
        a = np.exp(g[i]) * np.ones(F)
        S = a[:, None] * S + np.outer(pk[i], v[i])
        z = a * z + pk[i]
        if normalize:
            den = pq[i] @ z
            out[i] = pq[i] @ S / den if den >= np.finfo(float).tiny else 0
        else:
            out[i] = scale * pq[i] @ S
    return out


def delta_head(q, k, v, beta, g, name, scale):
    pq, pk = phi_np(name, q), phi_np(name, k)
    F, M = pk.shape[1], v.shape[1]
    S = np.zeros((F, M))
    out = np.zeros((q.shape[0], M))
    for t in range(q.shape[0]):
        a = 1.0 if g is None else np.exp(g[t])
        S = a * (S - beta[t] * np.outer(pk[t], pk[t] @ S)) + beta[t] * np.outer(pk[t], v[t])
        out[t] = scale * pq[t] @ S
    return out


def per_head(fn, q, k, v, *params):
    """[B, T, H, D] inputs, params [B, T, H] or [B, T, H, F] (or None), fn per sequence and head."""
    B, T, H, _ = q.shape
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for b in range(B):
        for h in range(H):
            ps = [None if p is None else p[b, :, h] for p in params]
            out[b, :, h] = fn(q[b, :, h], k[b, :, h], v[b, :, h], *ps)
    return out


def make(rng, dtype, B=2, T=23, H=2, D=5, M=3):
    q, k, v = (rng.uniform(-1, 1, (B, T, H, n)).astype(dtype) for n in (D, D, M))
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("per_feature", [False, True])
@pytest.mark.parametrize("name", linattn.GATED_FEATURE_MAPS)
@pytest.mark.parametrize("normalize", [False, True])
def test_gated_matches_recurrence(dtype, per_feature, name, normalize):
    rng = np.random.default_rng(11)
    q, k, v = make(rng, dtype)
    if normalize:  # a denominator must not cancel: non-negative features
        q, k = np.abs(q), np.abs(k)
    g = rng.uniform(-0.5, 0, q.shape if per_feature else q.shape[:-1]).astype(dtype)
    out = linattn.gated_linear_attention(q, k, v, g, name, normalize=normalize)
    scale = 1 / np.sqrt(q.shape[-1])
    ref = per_head(lambda a, b, c, gg: gated_head(a, b, c, gg, name, scale, normalize),
                   *(x.astype(np.float64) for x in (q, k, v, g)))
    assert out.dtype == dtype and rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", linattn.DELTA_FEATURE_MAPS)
@pytest.mark.parametrize("decay", [False, True])
def test_delta_matches_recurrence(dtype, name, decay):
    rng = np.random.default_rng(12)
    q, k, v = make(rng, dtype, T=70)  # longer than one chunk
    beta = rng.uniform(0, 1, q.shape[:-1]).astype(dtype)
    g = rng.uniform(-0.1, 0, q.shape[:-1]).astype(dtype) if decay else None
    out = linattn.delta_rule_attention(q, k, v, beta, g, name, scale=0.7)
    ref = per_head(lambda a, b, c, bb, gg: delta_head(a, b, c, bb, gg, name, 0.7),
                   *(x.astype(np.float64) for x in (q, k, v, beta)), None if g is None else g.astype(np.float64))
    # identity keys of norm up to √5 with β ≤ 1 can grow the state; relative to the largest output
    # the float32 error stays within the same bound.
    assert out.dtype == dtype and rel_err(out, ref) <= TOL[dtype]


def test_single_head_and_cu_seqlens():
    rng = np.random.default_rng(13)
    q, k, v = make(rng, np.float64, B=1, T=40, H=1)
    beta = rng.uniform(0, 1, q.shape[:-1])
    g = rng.uniform(-0.2, 0, q.shape[:-1])
    full = linattn.delta_rule_attention(q, k, v, beta, g)
    flat = linattn.delta_rule_attention(q[0, :, 0], k[0, :, 0], v[0, :, 0], beta[0, :, 0], g[0, :, 0])
    assert np.array_equal(full[0, :, 0], flat)
    cu = np.array([0, 15, 40])
    packed = linattn.gated_linear_attention(q[0], k[0], v[0], g[0], cu_seqlens=cu)
    for s in (slice(0, 15), slice(15, 40)):
        part = linattn.gated_linear_attention(q[0, s], k[0, s], v[0, s], g[0, s])
        assert np.allclose(packed[s], part, rtol=0, atol=1e-14)


@pytest.mark.parametrize("per_feature", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_gated_gradients(per_feature, normalize):
    rng = np.random.default_rng(14)
    q, k, v = make(rng, np.float64, T=9)
    if normalize:
        q, k = np.abs(q) + 0.1, np.abs(k) + 0.1
    g = rng.uniform(-0.5, -0.01, q.shape if per_feature else q.shape[:-1])
    w = rng.uniform(-1, 1, q.shape[:-1] + (v.shape[-1],))
    fn = lambda a, b, c, d: linattn.gated_linear_attention(a, b, c, d, normalize=normalize)
    grads = linattn.gated_linear_attention_backward(q, k, v, g, w, normalize=normalize)
    assert central_difference_worst(fn, grads, [q, k, v, g], w, rng, samples=10) < 1e-7


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("name", linattn.DELTA_FEATURE_MAPS)
def test_delta_gradients(decay, name):
    rng = np.random.default_rng(15)
    q, k, v = make(rng, np.float64, T=40)
    beta = rng.uniform(0.1, 0.9, q.shape[:-1])
    g = rng.uniform(-0.2, -0.01, q.shape[:-1]) if decay else None
    w = rng.uniform(-1, 1, q.shape[:-1] + (v.shape[-1],))
    fn = lambda a, b, c, bb, gg: linattn.delta_rule_attention(a, b, c, bb, gg, name)
    grads = linattn.delta_rule_attention_backward(q, k, v, beta, g, w, name)
    assert (grads[4] is None) == (g is None)
    assert central_difference_worst(fn, grads, [q, k, v, beta, g], w, rng, samples=10) < 1e-7


def test_errors():
    rng = np.random.default_rng(16)
    q, k, v = make(rng, np.float64)
    beta = np.full(q.shape[:-1], 0.5)
    with pytest.raises(ValueError, match="beta"):
        linattn.delta_rule_attention(q, k, v, 4.5 * beta)  # β = 2.25 outside [0, 2]: the C++ check
    with pytest.raises(ValueError, match=r"g\[0, 0, 0\] = 0.1: g holds log gates"):
        linattn.delta_rule_attention(q, k, v, beta, np.full(q.shape[:-1], 0.1))  # g > 0
    with pytest.raises(ValueError, match=r"beta must have shape \(2, 23, 2\)"):
        linattn.delta_rule_attention(q, k, v, beta[:, :5])
    with pytest.raises(TypeError, match="must have q's dtype"):
        linattn.delta_rule_attention(q, k, v, beta.astype(np.float32))
    with pytest.raises(ValueError, match="unknown feature_map 'elu' for the delta rule"):
        linattn.delta_rule_attention(q, k, v, beta, None, "elu")
    with pytest.raises(ValueError, match="unknown feature_map 'cosine' for the gated kernels"):
        linattn.gated_linear_attention(q, k, v, np.zeros(q.shape[:-1]), "cosine")
    with pytest.raises(ValueError, match="log"):
        linattn.gated_linear_attention(q, k, v, np.full(q.shape[:-1], 0.5))  # a gate > 1
