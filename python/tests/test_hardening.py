"""The Python layer's contracts beyond the kernels' numbers: FLA's l2norm eps (x / sqrt(|x|² + 1e-6))
forward and backward against a float64 reference, the zero rows of degenerate denominators,
linattn's thread count beside torch's, and error messages in the Python function's terms."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import linattn


def l2(x, eps):
    n2 = (x * x).sum(-1, keepdims=True) + eps
    return np.where(n2 > 0, x / np.sqrt(np.where(n2 > 0, n2, 1)), 0)


def delta_ref(q, k, v, beta, g, eps, scale):
    """The delta rule over [T, H, ·] inputs in float64: S_t = e^{g_t}(I − β_t k̂ k̂ᵀ)S + β_t k̂ v_tᵀ,
    k̂ = l2(k, eps) (eps None: k as given), the same map on q."""
    T, H, D = q.shape
    M = v.shape[-1]
    out = np.zeros((T, H, M))
    for h in range(H):
        S = np.zeros((D, M))
        for t in range(T):
            kk, qq = (k[t, h], q[t, h]) if eps is None else (l2(k[t, h], eps), l2(q[t, h], eps))
            a = 1.0 if g is None else np.exp(g[t, h])
            S = a * (S - beta[t, h] * np.outer(kk, kk @ S)) + beta[t, h] * np.outer(kk, v[t, h])
            out[t, h] = scale * (qq @ S)
    return out


def small_rows(rng, shape):
    """Rows whose squared norms spread around 1e-6, where FLA's eps changes the features."""
    x = rng.standard_normal(shape)
    return x * 10.0 ** rng.uniform(-4.5, -2, shape[:-1] + (1,))


def test_fla_l2norm_eps_matches_the_reference():
    rng = np.random.default_rng(51)
    T, H, D, M = 13, 2, 4, 3
    q, k = small_rows(rng, (1, T, H, D)), small_rows(rng, (1, T, H, D))
    v = rng.standard_normal((1, T, H, M))
    beta = rng.uniform(0, 1, (1, T, H))
    g = -rng.uniform(0, 0.3, (1, T, H))
    scale = 1 / np.sqrt(D)
    want = delta_ref(q[0], k[0], v[0], beta[0], g[0], 1e-6, scale)
    o, none = linattn.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert none is None
    err = np.abs(o[0] - want).max() / np.abs(want).max()
    assert err < 1e-12, err
    # eps matters for these rows: dividing by the norm alone is another function.
    plain = delta_ref(q[0], k[0], v[0], beta[0], g[0], 0.0, scale)
    assert np.abs(plain - want).max() > 1e-2 * np.abs(want).max()
    # The same through the general entry point; without use_qk_l2norm_in_kernel, q and k as given.
    same = linattn.delta_rule_attention(q, k, v, beta, g, "l2norm", l2norm_eps=1e-6)
    assert np.array_equal(same, o)
    o_delta, _ = linattn.chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)
    want_delta = delta_ref(q[0], k[0], v[0], beta[0], None, 1e-6, scale)
    assert np.abs(o_delta[0] - want_delta).max() < 1e-12 * np.abs(want_delta).max()
    raw, _ = linattn.chunk_gated_delta_rule(q, k, v, g, beta)
    want_raw = delta_ref(q[0], k[0], v[0], beta[0], g[0], None, scale)
    assert np.abs(raw[0] - want_raw).max() < 1e-12 * np.abs(want_raw).max()
    # float32: FLA's eps in float32, to float32 rounding.
    o32, _ = linattn.chunk_gated_delta_rule(*(a.astype(np.float32) for a in (q, k, v, g, beta)),
                                            use_qk_l2norm_in_kernel=True)
    assert np.abs(o32[0] - want).max() < 2e-5 * np.abs(want).max()


def test_l2norm_eps_zero_is_unchanged():
    rng = np.random.default_rng(52)
    q, k, v = (rng.standard_normal((1, 9, 2, 5)) for _ in range(3))
    beta = rng.uniform(0, 1, (1, 9, 2))
    for fmap in ("l2norm", "l2norm_silu"):
        a = linattn.delta_rule_attention(q, k, v, beta, None, fmap)
        b = linattn.delta_rule_attention(q, k, v, beta, None, fmap, l2norm_eps=0.0)
        assert np.array_equal(a, b)
    want = delta_ref(q[0], k[0], v[0], beta[0], None, 0.0, 1 / np.sqrt(5))
    got = linattn.delta_rule_attention(q, k, v, beta, None, "l2norm")
    assert np.abs(got[0] - want).max() < 1e-12 * np.abs(want).max()


def test_l2norm_eps_backward_matches_central_differences():
    rng = np.random.default_rng(53)
    T, H, D, M = 7, 2, 3, 2
    q, k = small_rows(rng, (1, T, H, D)), small_rows(rng, (1, T, H, D))
    v = rng.standard_normal((1, T, H, M))
    beta = rng.uniform(0, 1, (1, T, H))
    g = -rng.uniform(0, 0.3, (1, T, H))
    w = rng.standard_normal((1, T, H, M))

    def loss(q_, k_):
        return (w * linattn.delta_rule_attention(q_, k_, v, beta, g, "l2norm", l2norm_eps=1e-6)).sum()

    dq, dk, dv, db, dg = linattn.delta_rule_attention_backward(q, k, v, beta, g, w, "l2norm", l2norm_eps=1e-6)
    for x, grad, which in ((q, dq, 0), (k, dk, 1)):
        worst = 0.0
        for idx in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(12)]:
            h = 1e-6 * max(abs(x[idx]), 1e-5)
            xp, xm = x.copy(), x.copy()
            xp[idx] += h
            xm[idx] -= h
            args_p = (xp, k) if which == 0 else (q, xp)
            args_m = (xm, k) if which == 0 else (q, xm)
            fd = (loss(*args_p) - loss(*args_m)) / (2 * h)
            worst = max(worst, abs(fd - grad[idx]))
        assert worst < 1e-6 * np.abs(grad).max(), (which, worst, np.abs(grad).max())


def test_degenerate_denominators_give_zero_rows():
    """Normalised linear attention with features of both signs: rows whose denominator is
    negative (or rounding noise) are rows of zeros; clearly positive ones are the reference."""
    rng = np.random.default_rng(54)
    N, D, M = 64, 16, 5
    q, k, v = rng.standard_normal((N, D)), rng.standard_normal((N, D)), rng.standard_normal((N, M))
    for causal in (False, True):
        Z = np.cumsum(k, 0) if causal else np.broadcast_to(k.sum(0), (N, D))
        S = (np.cumsum(k[:, :, None] * v[:, None, :], 0) if causal
             else np.broadcast_to((k.T @ v)[None], (N, D, M)))
        den = np.einsum("nd,nd->n", q, Z)
        terms = np.einsum("nd,nd->n", np.abs(q), np.abs(Z))
        out = linattn.linear_attention(q, k, v, "identity", causal=causal)
        negative, positive = den < 0, den > 1e-6 * terms
        assert negative.sum() >= 10 and positive.sum() >= 10
        assert np.all(out[negative] == 0), causal
        ref = np.einsum("nd,ndm->nm", q, S) / den[:, None]
        err = np.abs(out[positive] - ref[positive]).max() / np.abs(ref[positive]).max()
        assert err < 1e-9, (causal, err)
        # The decoder applies the same guard.
        state = linattn.RecurrentState(1, 1, D, M, "identity", np.float64)
        if causal:
            steps = np.stack([state.step(q[t][None, None], k[t][None, None], v[t][None, None])[0, 0]
                              for t in range(N)])
            assert np.all(steps[negative] == 0)
            assert np.abs(steps[positive] - ref[positive]).max() < 1e-9 * np.abs(ref[positive]).max()


THREADS_SCRIPT = r"""
import json, numpy as np, linattn
seen = {"before": [linattn.get_num_threads(), linattn._linattn._threads_in_kernel()]}
import torch
seen["after_import"] = [linattn.get_num_threads(), linattn._linattn._threads_in_kernel()]
torch.set_num_threads(1)
seen["after_torch_set"] = [linattn.get_num_threads(), linattn._linattn._threads_in_kernel()]
x = np.ones((8, 4))
linattn.set_num_threads(2)
linattn.linear_attention(x, x, x)
seen["torch_after_linattn"] = torch.get_num_threads()
seen["linattn_after_set"] = [linattn.get_num_threads(), linattn._linattn._threads_in_kernel()]
print(json.dumps(seen))
"""


def run_threads_script(omp_num_threads):
    if importlib.util.find_spec("torch") is None:
        if os.environ.get("LINATTN_REQUIRE_TORCH") == "1":
            pytest.fail("LINATTN_REQUIRE_TORCH=1 but torch is not installed")
        pytest.skip("torch is not installed")
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_num_threads)
    done = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_torch_does_not_change_linattns_thread_count():
    seen = run_threads_script(3)
    assert seen["before"] == [3, 3]
    assert seen["after_import"] == [3, 3]
    assert seen["after_torch_set"] == [3, 3]  # torch.set_num_threads(1) is torch's setting
    assert seen["linattn_after_set"] == [2, 2]
    assert seen["torch_after_linattn"] == 1  # and linattn's calls leave torch's alone


def test_default_thread_count_survives_import_torch():
    seen = run_threads_script(None)
    assert seen["before"][0] >= 1
    assert seen["after_import"] == seen["before"]
    assert seen["after_torch_set"] == seen["before"]


def test_errors_name_the_python_function_arguments_and_shapes():
    rng = np.random.default_rng(55)
    q, k, v = (rng.standard_normal((1, 7, 2, 3)) for _ in range(3))
    g = -np.abs(rng.standard_normal((1, 7, 2)))
    beta = rng.uniform(0, 1, (1, 7, 2))
    shapes = r"q \(1, 7, 2, 3\), k \(1, 7, 2, 3\), v \(1, 7, 2, 3\), beta \(1, 7, 2\), g \(1, 7, 2\)"
    # g and beta swapped: beta receives the negative log decays.
    with pytest.raises(ValueError) as e:
        linattn.delta_rule_attention(q, k, v, g, beta)
    msg = str(e.value)
    assert msg.startswith(f"delta_rule_attention: beta[0, 0, 0] = {g[0, 0, 0]}: beta must be in [0, 2]"), msg
    assert "linattn::" not in msg and "log_a" not in msg and "7x6" not in msg
    assert re.search(shapes, msg), msg
    bad = g.copy()
    bad[0, 4, 1] = 1e-30
    with pytest.raises(ValueError, match=r"delta_rule_attention: g\[0, 4, 1\] = 1e-30: g holds log gates .*finite "
                                         r"and <= 0 \(got " + shapes):
        linattn.delta_rule_attention(q, k, v, beta, bad)
    with pytest.raises(ValueError, match=r"delta_rule_attention: beta\[0, 0, 0\] = -1e-07: beta must be in \[0, 2\]"):
        b32 = beta.astype(np.float32)
        b32[0, 0, 0] = np.float32(-1e-7)  # the float32's shortest repr, not its double expansion
        linattn.delta_rule_attention(*(a.astype(np.float32) for a in (q, k, v)), b32)
    b2 = beta.copy()
    b2[0, 2, 0] = np.nextafter(2.0, 3.0)
    with pytest.raises(ValueError, match=r"beta\[0, 2, 0\] = 2.0000000000000004: beta must be in \[0, 2\]"):
        linattn.delta_rule_attention_backward(q, k, v, b2, g, np.zeros((1, 7, 2, 3)))
    g2 = g.copy()
    g2[0, 6, 1] = np.nan
    with pytest.raises(ValueError, match=r"gated_linear_attention: g\[0, 6, 1\] = nan"):
        linattn.gated_linear_attention(q, k, v, g2)
    with pytest.raises(ValueError, match=r"causal_linear_attention: causal attention needs k and v with q's tokens "
                                         r".*got q \(1, 7, 2, 3\), k \(1, 5, 2, 3\), v \(1, 5, 2, 3\)"):
        linattn.linear_attention(q, k[:, :5], v[:, :5], causal=True)
    with pytest.raises(ValueError, match=r"delta_rule_attention: causal attention needs k and v with q's tokens"):
        linattn.delta_rule_attention(q, k[:, :5], v[:, :5], beta)
    with pytest.raises(ValueError, match=r"cu_seqlens must run from 0 to 7 .* got 0 \.\.\. 6 \(with q \(1, 7, 2, 3\)"):
        linattn.delta_rule_attention(q, k, v, beta, cu_seqlens=[0, 3, 6])
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D integer array"):
        linattn.linear_attention(q, k, v, cu_seqlens=[0.0, 7.0])
    with pytest.raises(ValueError, match=r"l2norm_eps = -1.0: l2norm_eps must be finite and >= 0"):
        linattn.delta_rule_attention(q, k, v, beta, l2norm_eps=-1)
    with pytest.raises(ValueError, match=r"l2norm_eps = 1e-06 needs feature_map 'l2norm' or 'l2norm_silu'"):
        linattn.delta_rule_attention(q, k, v, beta, None, "identity", l2norm_eps=1e-6)
    with pytest.raises(ValueError, match=r"beta must have shape \(1, 7, 2\) .*got \(1, 7\) \(with q \(1, 7, 2, 3\)"):
        linattn.delta_rule_attention(q, k, v, beta[..., 0])
    # A check only the C++ library makes: under the Python name, with the shapes.
    with pytest.raises(ValueError, match=r"^linear_attention: unknown feature_map 'relu2'.*\[called with q "):
        linattn.linear_attention(q, k, v, "relu2")
    state = linattn.RecurrentState(2, 2, 3, 3, "elu", np.float64)
    x = np.zeros((2, 2, 3))
    with pytest.raises(ValueError, match=r"RecurrentState.step: slots\[1\] = 5: slots must be in \[0, 2\)"):
        state.step(x, x, x, slots=[0, 5])
    with pytest.raises(ValueError, match=r"RecurrentState.step: the state has H = 2 heads of D = 3, M = 3"):
        state.step(np.zeros((2, 2, 4)), np.zeros((2, 2, 4)), x)
