"""linattn.torch's FLA names through torch.autograd: gradients to q, k, v, g, beta, the gate's
parameters and initial_state, by gradcheck in float64 and against autograd through FLA's
recurrence written out in torch; half-precision tensors computed in float32."""

import os

import numpy as np
import pytest

if os.environ.get("LINATTN_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

import linattn.torch as lt  # noqa: E402


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def reference(q, k, v, scale, h0=None, beta=None, g=None, gk=None, delta=False, qk_l2norm=False, cu=None):
    """FLA's recurrence token by token in torch (differentiable): S ← exp(g_t) S,
    diag(exp(gk_t)) S, then S += k_t v_tᵀ or k_t (β_t (v_t − Sᵀ k_t))ᵀ; o_t = scale·Sᵀ q_t."""
    B, T, Hk, K = q.shape
    H, V = v.shape[2:]
    seqs = [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    rows, finals = {}, []
    for n, (b, s, e) in enumerate(seqs):
        heads = []
        for h in range(H):
            c = h // (H // Hk)
            S = torch.zeros(K, V, dtype=q.dtype) if h0 is None else h0[n, h]
            for t in range(s, e):
                qt, kt = q[b, t, c], k[b, t, c]
                if qk_l2norm:
                    qt, kt = l2norm(qt), l2norm(kt)
                if g is not None:
                    S = torch.exp(g[b, t, h]) * S
                if gk is not None:
                    S = torch.exp(gk[b, t, h])[:, None] * S
                if delta:
                    S = S + torch.outer(kt, beta[b, t, h] * (v[b, t, h] - kt @ S))
                else:
                    S = S + torch.outer(kt, v[b, t, h])
                rows[(b, t, h)] = scale * (qt @ S)
            heads.append(S)
        finals.append(torch.stack(heads))
    o = torch.stack([torch.stack([torch.stack([rows[(b, t, h)] for h in range(H)]) for t in range(T)])
                     for b in range(B)])
    return o, torch.stack(finals)


def rand(rng, *shape, lo=-1.0, hi=1.0):
    return torch.from_numpy(rng.uniform(lo, hi, shape)).requires_grad_(True)


KINDS = ("gla", "simple_gla", "delta_rule", "gated_delta_rule", "kda")


def make(rng, kind, B=2, T=5, Hk=1, H=2, K=3, V=2):
    q, k, v = rand(rng, B, T, Hk, K), rand(rng, B, T, Hk, K, lo=-0.6, hi=0.6), rand(rng, B, T, H, V)
    beta = rand(rng, B, T, H, lo=0.1, hi=0.9)
    g = {"gla": rand(rng, B, T, H, K, lo=-0.5, hi=-0.01), "simple_gla": rand(rng, B, T, H, lo=-0.5, hi=-0.01),
         "gated_delta_rule": rand(rng, B, T, H, lo=-0.3, hi=-0.01),
         "kda": rand(rng, B, T, H, K, lo=-0.5, hi=-0.01)}.get(kind)
    return q, k, v, beta, g


def call(kind, q, k, v, beta, g, **kw):
    if kind == "gla":
        return lt.chunk_gla(q, k, v, g, **kw)
    if kind == "simple_gla":
        return lt.chunk_simple_gla(q, k, v, g, **kw)
    if kind == "delta_rule":
        return lt.chunk_delta_rule(q, k, v, beta, **kw)
    if kind == "gated_delta_rule":
        return lt.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    return lt.chunk_kda(q, k, v, g, beta, **kw)


def ref_call(kind, q, k, v, beta, g, h0, cu=None, qk_l2norm=False):
    scale = q.shape[-1] ** -0.5
    return reference(q, k, v, scale, h0, beta, g if kind in ("simple_gla", "gated_delta_rule") else None,
                     g if kind in ("gla", "kda") else None, delta=kind in ("delta_rule", "gated_delta_rule", "kda"),
                     qk_l2norm=qk_l2norm, cu=cu)


def inputs_of(kind, q, k, v, beta, g, h0):
    """The differentiable inputs of `kind` (beta only for the delta rule, g where it has one)."""
    xs = [q, k, v]
    if kind in ("delta_rule", "gated_delta_rule", "kda"):
        xs.append(beta)
    if g is not None:
        xs.append(g)
    return xs + [h0]


@pytest.mark.parametrize("layout", ["batch", "varlen"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_autograd_through_the_recurrence(kind, layout):
    rng = np.random.default_rng(700 + KINDS.index(kind))
    cu = None
    if layout == "batch":
        q, k, v, beta, g = make(rng, kind, T=9, Hk=1, H=2)
        N = 2
    else:
        q, k, v, beta, g = make(rng, kind, B=1, T=13, Hk=2, H=4)
        cu = [0, 4, 4, 13]
        N = 3
    h0 = rand(rng, N, v.shape[2], q.shape[-1], v.shape[-1])
    l2 = kind != "gla"
    kw = dict(use_qk_l2norm_in_kernel=True) if l2 and kind != "simple_gla" else {}
    o, ht = call(kind, q, k, v, beta, g, initial_state=h0, output_final_state=True,
                 cu_seqlens=None if cu is None else torch.tensor(cu), **kw)
    ro, rht = ref_call(kind, q, k, v, beta, g, h0, cu, qk_l2norm=bool(kw))
    assert torch.allclose(o, ro, rtol=0, atol=1e-12) and torch.allclose(ht, rht, rtol=0, atol=1e-12)
    wo, wh = torch.randn_like(o), torch.randn_like(ht)
    xs = inputs_of(kind, q, k, v, beta, g, h0)
    got = torch.autograd.grad((o * wo).sum() + (ht * wh).sum(), xs)
    want = torch.autograd.grad((ro * wo).sum() + (rht * wh).sum(), xs)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-11), (a - b).abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_with_states_and_shared_key_heads(kind):
    rng = np.random.default_rng(800 + KINDS.index(kind))
    q, k, v, beta, g = make(rng, kind, B=1, T=4, Hk=1, H=2, K=2, V=2)
    h0 = rand(rng, 1, 2, 2, 2)
    kw = {} if kind in ("gla", "simple_gla") else dict(use_qk_l2norm_in_kernel=True)
    xs = inputs_of(kind, q, k, v, beta, g, h0)

    def f(*args):
        a = dict(zip(["q", "k", "v"], args[:3]))
        rest = list(args[3:-1])
        b = rest.pop(0) if kind in ("delta_rule", "gated_delta_rule", "kda") else None
        gg = rest.pop(0) if g is not None else None
        return call(kind, a["q"], a["k"], a["v"], b, gg, initial_state=args[-1], output_final_state=True, **kw)

    assert torch.autograd.gradcheck(f, xs)


def test_gradcheck_kda_gate_in_kernel():
    rng = np.random.default_rng(900)
    q, k, v, beta, _ = make(rng, "kda", B=1, T=4, Hk=1, H=2, K=2, V=2)
    raw = rand(rng, 1, 4, 2, 2)
    A_log, dt_bias = rand(rng, 2), rand(rng, 4)
    logits = rand(rng, 1, 4, 2)
    h0 = rand(rng, 1, 2, 2, 2)
    for lb in (None, -5.0):
        f = lambda a, b, c, r, al, db, lg, s: lt.chunk_kda(
            a, b, c, r, lg, initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lb, A_log=al, dt_bias=db)
        assert torch.autograd.gradcheck(f, (q, k, v, raw, A_log, dt_bias, logits, h0))
    f = lambda a, b, c, r, db, lg: lt.fused_recurrent_kda(a, b, c, r, lg, None, db, use_gate_in_kernel=True,
                                                          lower_bound=-3.0)[0]
    assert torch.autograd.gradcheck(f, (q, k, v, raw, dt_bias, beta))


def test_only_the_output_or_only_the_state_in_the_loss():
    rng = np.random.default_rng(910)
    q, k, v, beta, g = make(rng, "gated_delta_rule")
    h0 = rand(rng, 2, 2, 3, 2)
    o, ht = lt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    (dh0,) = torch.autograd.grad(ht.sum(), [h0], retain_graph=True)
    ro, rht = ref_call("gated_delta_rule", q, k, v, beta, g, h0)
    assert torch.allclose(dh0, torch.autograd.grad(rht.sum(), [h0], retain_graph=True)[0], atol=1e-12)
    dq, dh0 = torch.autograd.grad(o.sum(), [q, h0])
    assert torch.allclose(dh0, torch.autograd.grad(ro.sum(), [h0], retain_graph=True)[0], atol=1e-12)
    # No initial state: (o, None) and gradients to q, k, v, g, beta only.
    o, none = lt.chunk_gated_delta_rule(q, k, v, g, beta)
    assert none is None
    o.sum().backward()
    assert all(x.grad is not None for x in (q, k, v, g, beta))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_float32(dtype):
    rng = np.random.default_rng(920)
    q, k, v, beta, g = (x.detach() for x in make(rng, "kda", T=7))
    h0 = torch.from_numpy(rng.uniform(-1, 1, (2, 2, 3, 2))).float()
    lo = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    o, ht = lt.chunk_kda(*lo, g.float(), beta.float(), initial_state=h0.requires_grad_(True),
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype and ht.dtype == torch.float32  # FLA's: o in q's dtype, states in float32
    want, _ = lt.chunk_kda(*(x.to(dtype).float() for x in (q, k, v)), g.float(), beta.float(), initial_state=h0,
                           use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, want.to(dtype))
    (o.float().sum() + ht.sum()).backward()
    assert all(x.grad.dtype == dtype for x in lo) and h0.grad.dtype == torch.float32


def test_errors():
    x = torch.zeros(1, 3, 2, 4)
    with pytest.raises(TypeError, match=r"linattn.torch.chunk_delta_rule: q must be float16, bfloat16, float32"):
        lt.chunk_delta_rule(x.int(), x, x, torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match=r"linattn.torch.chunk_delta_rule: initial_state must have shape "
                                         r"\(1, 2, 4, 4\)"):
        lt.chunk_delta_rule(x, x, x, torch.zeros(1, 3, 2), initial_state=torch.zeros(2, 2, 4, 4))
