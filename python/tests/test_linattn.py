"""The linattn Python package against O(N²) NumPy references in float64 (docs/SPEC.md of the C++
library: the feature maps, the guarded denominator, SoftmaxSplit's causal form) and in float32,
plus layouts, cu_seqlens, gradients by central differences, errors, zero sizes, threads."""

import threading
import time

import numpy as np
import pytest

import linattn

TINY = {np.float32: np.finfo(np.float32).tiny, np.float64: np.finfo(np.float64).tiny}
# Measured worst errors of test_linear_matches_reference, relative to the largest output:
# 7.7e-16 in float64 and 2.9e-7 in float32. float64 is held to 1e-12 (the bound the
# specification sets for every function), float32 to about five times its measured error.
TOL = {np.float64: 1e-12, np.float32: 1.5e-6}


def phi_np(name, x):
    if name == "elu":
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
    if name == "silu":
        return x / (1 + np.exp(-x))
    if name == "identity":
        return x
    if name == "cosine":
        n = np.linalg.norm(x, axis=-1, keepdims=True)
        xhat = np.where(n > 0, x / np.where(n > 0, n, 1), 0)
        return np.concatenate([np.ones(x.shape[:-1] + (1,)), xhat], axis=-1)
    if name == "relu":
        return np.maximum(x, 0)
    if name.startswith("dpfp"):  # block j (1-based) of 2D features: r_i r_{(i + j) mod 2D}
        nu = int(name[4:] or 1)
        r = np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], axis=-1)
        return np.concatenate([r * np.roll(r, -j, axis=-1) for j in range(1, nu + 1)], axis=-1)
    if name == "taylor2":  # [1, x', vec(x' x'^T) / sqrt(2)], x' = x / D^(1/4)
        D = x.shape[-1]
        xp = x / D ** 0.25
        quad = (xp[..., :, None] * xp[..., None, :]).reshape(x.shape[:-1] + (D * D,)) / np.sqrt(2)
        return np.concatenate([np.ones(x.shape[:-1] + (1,)), xp, quad], axis=-1)
    raise ValueError(name)


def softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def head_ref(q, k, v, name, causal):
    """One head, float64: q [N, D], k [L, D], v [L, M]."""
    N, L = q.shape[0], k.shape[0]
    if name == "softmax_split":
        pq = softmax(q, 1)
        if not causal:
            return pq @ (softmax(k, 0).T @ v) if L else np.zeros((N, v.shape[1]))
        out = np.zeros((N, v.shape[1]))
        for i in range(N):
            w = softmax(k[: i + 1], 0)  # per feature over the prefix
            out[i] = pq[i] @ (w.T @ v[: i + 1])
        return out
    a = phi_np(name, q) @ phi_np(name, k).T
    if causal:
        a = np.tril(a)
    num, den = a @ v, a.sum(1)
    ok = den >= TINY[np.float64]
    return np.where(ok[:, None], num / np.where(ok, den, 1)[:, None], 0)


def softmax_head_ref(q, k, v, causal):
    s = q @ k.T / np.sqrt(q.shape[1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
    return softmax(s, 1) @ v


def heads_ref(q, k, v, fn):
    """[B, T, H, D] (or [N, H, D], [N, D]) through fn per sequence and head."""
    if q.ndim == 2:
        return fn(q, k, v)
    if q.ndim == 3:
        return np.stack([fn(q[:, h], k[:, h], v[:, h]) for h in range(q.shape[1])], axis=1)
    return np.stack([heads_ref(q[b], k[b], v[b], fn) for b in range(q.shape[0])])


def rel_err(x, ref):
    return np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-300)


def inputs(rng, shape_q, shape_k, M, dtype, positive=False):
    lo = 0.1 if positive else -1.0
    q = rng.uniform(lo, 1, shape_q)
    k = rng.uniform(lo, 1, shape_k)
    v = rng.uniform(-1, 1, shape_k[:-1] + (M,))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


SHAPES = [((37, 5), (37, 5)), ((3, 29, 2, 6), (3, 29, 2, 6)), ((50, 3, 4), (50, 3, 4))]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", linattn.FEATURE_MAPS)
@pytest.mark.parametrize("shapes", SHAPES)
def test_linear_matches_reference(dtype, causal, name, shapes):
    rng = np.random.default_rng(1)
    # identity and silu features change sign on [-1, 1]: denominators could cancel.
    q, k, v = inputs(rng, shapes[0], shapes[1], 7, dtype, positive=name in ("identity", "silu"))
    out = linattn.linear_attention(q, k, v, name, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape[:-1] + (7,)
    ref = heads_ref(*(x.astype(np.float64) for x in (q, k, v)), lambda a, b, c: head_ref(a, b, c, name, causal))
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_matches_reference(dtype, causal):
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, (2, 33, 3, 8), (2, 33, 3, 8), 5, dtype)
    out = linattn.softmax_attention(q, k, v, causal=causal)
    ref = heads_ref(*(x.astype(np.float64) for x in (q, k, v)), lambda a, b, c: softmax_head_ref(a, b, c, causal))
    assert rel_err(out, ref) <= TOL[dtype]


def test_cross_attention_lengths():
    rng = np.random.default_rng(3)
    q, _, _ = inputs(rng, (2, 11, 2, 4), (2, 11, 2, 4), 3, np.float64)
    _, k, v = inputs(rng, (2, 19, 2, 4), (2, 19, 2, 4), 3, np.float64)
    out = linattn.linear_attention(q, k, v, "elu")
    ref = heads_ref(q, k, v, lambda a, b, c: head_ref(a, b, c, "elu", False))
    assert out.shape == (2, 11, 2, 3) and rel_err(out, ref) <= 1e-12
    out = linattn.softmax_attention(q, k, v)
    assert rel_err(out, heads_ref(q, k, v, lambda a, b, c: softmax_head_ref(a, b, c, False))) <= 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_cu_seqlens_equals_separate_calls(causal):
    rng = np.random.default_rng(4)
    cu = np.array([0, 13, 13, 40, 57])  # an empty sequence included
    q, k, v = inputs(rng, (57, 2, 6), (57, 2, 6), 5, np.float64)
    out = linattn.linear_attention(q, k, v, "elu", causal=causal, cu_seqlens=cu)
    one = linattn.linear_attention(q[None], k[None], v[None], "elu", causal=causal, cu_seqlens=cu)
    assert np.array_equal(one[0], out)
    for b in range(len(cu) - 1):
        s = slice(cu[b], cu[b + 1])
        part = linattn.linear_attention(q[s], k[s], v[s], "elu", causal=causal)
        assert np.allclose(out[s], part, rtol=0, atol=1e-14)
    dq, dk, dv = linattn.linear_attention_backward(q, k, v, np.ones_like(out), "elu", causal, cu)
    for b in range(len(cu) - 1):
        s = slice(cu[b], cu[b + 1])
        g = linattn.linear_attention_backward(q[s], k[s], v[s], np.ones_like(out[s]), "elu", causal)
        for x, y in zip((dq[s], dk[s], dv[s]), g):
            assert np.allclose(x, y, rtol=0, atol=1e-13)


def central_difference_worst(fn, grads, args, w, rng, samples=12):
    """The worst relative gap between grads (of L = Σ w ∘ fn(*args)) and central differences at
    `samples` random entries of each argument (None arguments skipped)."""
    h, worst = 1e-6, 0.0
    for which, x in enumerate(args):
        if x is None:
            continue
        for _ in range(samples):
            idx = tuple(rng.integers(0, n) for n in x.shape)
            a = [None if y is None else y.copy() for y in args]
            a[which][idx] += h
            lp = float((fn(*a) * w).sum())
            a[which][idx] -= 2 * h
            lm = float((fn(*a) * w).sum())
            fd = (lp - lm) / (2 * h)
            worst = max(worst, abs(fd - grads[which][idx]) / max(1.0, abs(fd)))
    return worst


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", linattn.FEATURE_MAPS + ("softmax",))
def test_gradients_central_differences(causal, name):
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, (2, 9, 2, 3), (2, 9, 2, 3), 4, np.float64, positive=name in ("identity", "silu"))
    if name == "softmax":
        fn = lambda a, b, c: linattn.softmax_attention(a, b, c, causal=causal)
        bwd = lambda a, b, c, g: linattn.softmax_attention_backward(a, b, c, g, causal=causal)
    else:
        fn = lambda a, b, c: linattn.linear_attention(a, b, c, name, causal=causal)
        bwd = lambda a, b, c, g: linattn.linear_attention_backward(a, b, c, g, name, causal=causal)
    w = rng.uniform(-1, 1, q.shape[:-1] + (4,))
    # central differences at h = 1e-6: truncation and rounding ~1e-9
    assert central_difference_worst(fn, bwd(q, k, v, w), [q, k, v], w, rng) < 1e-7


def test_dtype_errors():
    x = np.zeros((4, 3))
    with pytest.raises(TypeError, match="float32 or all float64"):
        linattn.linear_attention(x, x.astype(np.float32), x)
    with pytest.raises(TypeError, match="float32 or all float64"):
        linattn.linear_attention(x.astype(np.int64), x, x)


def test_shape_errors_carry_the_library_message():
    rng = np.random.default_rng(6)
    q, k, v = inputs(rng, (8, 4), (8, 4), 3, np.float64)
    with pytest.raises(ValueError, match=r"linear_attention: q and k must have the same last dimension D, got "
                                         r"q \(8, 4\), k \(8, 5\), v \(8, 3\)"):
        linattn.linear_attention(q, np.zeros((8, 5)), v)
    with pytest.raises(ValueError, match="causal_linear_attention"):
        linattn.linear_attention(q, k[:6], v[:6], causal=True)
    with pytest.raises(ValueError, match="unknown feature_map 'relu2'"):
        linattn.linear_attention(q, k, v, "relu2")
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to 8"):
        linattn.linear_attention(q, k, v, cu_seqlens=[0, 3, 7])
    with pytest.raises(ValueError, match="non-decreasing"):
        linattn.linear_attention(q, k, v, cu_seqlens=[0, 5, 3, 8])
    with pytest.raises(ValueError, match="same number of heads"):
        linattn.linear_attention(np.zeros((8, 2, 4)), np.zeros((8, 3, 4)), np.zeros((8, 3, 4)))
    with pytest.raises(ValueError, match="dout must have the output's shape"):
        linattn.linear_attention_backward(q, k, v, np.zeros((8, 4)))
    with pytest.raises(ValueError, match=r"\[N, D\], \[N, H, D\] or \[B, T, H, D\]"):
        linattn.linear_attention(np.zeros(4), np.zeros(4), np.zeros(4))
    # The extension's own checks, for a caller of linattn._linattn that skips the package's.
    from linattn import _linattn
    with pytest.raises(ValueError, match="k has 8 rows but v has 6"):
        _linattn.softmax_forward(q, k, v[:6], 1, False, None, None, None)
    with pytest.raises(ValueError, match="q has 2 sequences but k has 1"):
        _linattn.linear_backward(q, k, v, np.zeros((8, 3)), 1, "elu", False, np.array([0, 4, 8]), None, None)
    with pytest.raises(ValueError, match="the key mask has 5 entries but k has 8 rows"):
        _linattn.linear_backward(q, k, v, np.zeros((8, 3)), 1, "elu", False, None, None, np.ones(5, bool))
    with pytest.raises(ValueError, match="the key mask is 5x1 but must be a vector of 8 entries"):
        _linattn.linear_forward(q, k, v, 1, "elu", True, None, None, np.ones(5, bool))
    with pytest.raises(ValueError, match="must be 2-D"):
        _linattn.linear_forward(q[None], k, v, 1, "elu", False, None, None, None)
    with pytest.raises(ValueError, match="thread count must be >= 1"):
        linattn.set_num_threads(0)


def test_non_contiguous_inputs_are_copied():
    rng = np.random.default_rng(7)
    q, k, v = inputs(rng, (2, 16, 2, 8), (2, 16, 2, 8), 8, np.float64)
    qt = np.asfortranarray(q)
    ks = np.concatenate([k, k], axis=-1)[..., ::2]  # strided view, equal values
    out = linattn.linear_attention(qt, ks, v[:, :, :, :], causal=True)
    assert np.array_equal(out, linattn.linear_attention(q, np.ascontiguousarray(ks), v, causal=True))
    assert np.allclose(ks, np.concatenate([k, k], axis=-1)[..., ::2])


def test_zero_sizes():
    z = np.zeros((0, 4))
    assert linattn.linear_attention(z, z, np.zeros((0, 3))).shape == (0, 3)
    assert linattn.linear_attention(z, z, np.zeros((0, 3)), causal=True).shape == (0, 3)
    q = np.ones((5, 4))
    out = linattn.linear_attention(q, z, np.zeros((0, 3)))  # no keys: zero rows (SPEC §1)
    assert out.shape == (5, 3) and not out.any()
    assert linattn.softmax_attention(np.zeros((0, 2, 4)), np.zeros((0, 2, 4)), np.zeros((0, 2, 3))).shape == (0, 2, 3)
    g = linattn.linear_attention_backward(z, z, np.zeros((0, 3)), np.zeros((0, 3)), causal=True)
    assert [x.shape for x in g] == [(0, 4), (0, 4), (0, 3)]


def test_large_magnitudes_stay_finite():
    rng = np.random.default_rng(8)
    for dtype in (np.float32, np.float64):
        q, k, v = (100 * x for x in inputs(rng, (40, 2, 8), (40, 2, 8), 4, dtype))
        for name in linattn.FEATURE_MAPS:
            for causal in (False, True):
                assert np.isfinite(linattn.linear_attention(q, k, v, name, causal=causal)).all()
        assert np.isfinite(linattn.softmax_attention(q, k, v, causal=True)).all()


def test_threads_agree_and_run_concurrently():
    rng = np.random.default_rng(9)
    q, k, v = inputs(rng, (1, 4096, 4, 32), (1, 4096, 4, 32), 32, np.float32)
    before = linattn.get_num_threads()
    try:
        linattn.set_num_threads(1)
        one = linattn.linear_attention(q, k, v, causal=True)
        linattn.set_num_threads(2)
        two = linattn.linear_attention(q, k, v, causal=True)
        assert rel_err(two, one) <= 1e-6
    finally:
        linattn.set_num_threads(before)
    # The count holds in every Python thread, not only the one that set it (OpenMP's is a
    # per-thread setting, and a new thread starts from all cores).
    if linattn._ext.openmp:
        try:
            linattn.set_num_threads(1)
            seen = []
            worker = threading.Thread(target=lambda: seen.append(linattn._ext._threads_in_kernel()))
            worker.start()
            worker.join()
            assert seen == [1]
        finally:
            linattn.set_num_threads(before)
    # The GIL is released inside the kernels: Python threads calling them all finish with the
    # same results as the serial calls (a deadlock or a held GIL would show as a timeout here).
    results = [None] * 4
    def work(i):
        results[i] = linattn.linear_attention(q, k, v, causal=True)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert time.monotonic() - t0 < 120
    for r in results:
        assert rel_err(r, one) <= 1e-6
