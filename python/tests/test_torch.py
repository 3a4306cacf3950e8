"""linattn.torch: the autograd wrappers, by torch.autograd.gradcheck in float64 for every wrapped
kernel and map, against the numpy functions (same kernels: same bits), and the checks a PyTorch
caller meets (device, dtype, contiguity, training)."""

import os

import numpy as np
import pytest

# Skipped without torch (an optional dependency), unless the build asks for these tests
# (LINATTN_PYTHON_REQUIRED, as CI does): then a missing torch is an error.
if os.environ.get("LINATTN_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

import linattn  # noqa: E402
import linattn.torch as lt  # noqa: E402
from test_shared_heads import make, rel_err  # noqa: E402


def rand(rng, *shape, lo=-1.0, hi=1.0, requires_grad=True):
    t = torch.from_numpy(rng.uniform(lo, hi, shape))
    return t.requires_grad_(requires_grad)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", linattn.FEATURE_MAPS)
def test_gradcheck_linear(causal, name):
    rng = np.random.default_rng(21)
    lo = 0.1 if name in ("identity", "silu") else -1.0  # no cancelling denominators
    q, k = rand(rng, 1, 6, 2, 3, lo=lo), rand(rng, 1, 6, 2, 3, lo=lo)
    v = rand(rng, 1, 6, 2, 2)
    assert torch.autograd.gradcheck(lambda a, b, c: lt.linear_attention(a, b, c, name, causal), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_softmax(causal):
    rng = np.random.default_rng(22)
    q, k, v = rand(rng, 2, 5, 2, 3), rand(rng, 2, 5, 2, 3), rand(rng, 2, 5, 2, 2)
    assert torch.autograd.gradcheck(lambda a, b, c: lt.softmax_attention(a, b, c, causal), (q, k, v))


@pytest.mark.parametrize("per_feature", [False, True])
@pytest.mark.parametrize("name", linattn.GATED_FEATURE_MAPS)
def test_gradcheck_gated(per_feature, name):
    rng = np.random.default_rng(23)
    q, k, v = rand(rng, 1, 6, 2, 3), rand(rng, 1, 6, 2, 3), rand(rng, 1, 6, 2, 2)
    g = rand(rng, *((1, 6, 2, 3) if per_feature else (1, 6, 2)), lo=-0.5, hi=-0.05)
    assert torch.autograd.gradcheck(lambda a, b, c, d: lt.gated_linear_attention(a, b, c, d, name), (q, k, v, g))


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("name", linattn.DELTA_FEATURE_MAPS)
def test_gradcheck_delta(decay, name):
    rng = np.random.default_rng(24)
    q, k, v = rand(rng, 1, 7, 2, 3), rand(rng, 1, 7, 2, 3), rand(rng, 1, 7, 2, 2)
    beta = rand(rng, 1, 7, 2, lo=0.1, hi=0.9)
    if decay:
        g = rand(rng, 1, 7, 2, lo=-0.3, hi=-0.01)
        f = lambda a, b, c, bb, gg: lt.delta_rule_attention(a, b, c, bb, gg, name)
        assert torch.autograd.gradcheck(f, (q, k, v, beta, g))
    else:
        f = lambda a, b, c, bb: lt.delta_rule_attention(a, b, c, bb, None, name)
        assert torch.autograd.gradcheck(f, (q, k, v, beta))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_key_padding_mask(causal):
    rng = np.random.default_rng(25)
    q, k, v = rand(rng, 2, 6, 2, 3), rand(rng, 2, 6, 2, 3), rand(rng, 2, 6, 2, 2)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 2] = pad[1, 5] = True
    f = lambda a, b, c: lt.linear_attention(a, b, c, "elu", causal, key_padding_mask=pad)
    assert torch.autograd.gradcheck(f, (q, k, v))
    if not causal:
        f = lambda a, b, c: lt.softmax_attention(a, b, c, key_padding_mask=pad)
        assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradcheck_fla_names():
    rng = np.random.default_rng(26)
    q, k, v = rand(rng, 1, 6, 2, 3), rand(rng, 1, 6, 2, 3), rand(rng, 1, 6, 2, 2)
    g, beta = rand(rng, 1, 6, 2, lo=-0.3, hi=-0.01), rand(rng, 1, 6, 2, lo=0.1, hi=0.9)
    f = lambda a, b, c, gg, bb: lt.chunk_gated_delta_rule(a, b, c, gg, bb, use_qk_l2norm_in_kernel=True)[0]
    assert torch.autograd.gradcheck(f, (q, k, v, g, beta))
    f = lambda a, b, c, gg: lt.fused_recurrent_simple_gla(a, b, c, gg)[0]
    assert torch.autograd.gradcheck(f, (q, k, v, g))


def test_same_bits_as_numpy_and_shared_memory():
    rng = np.random.default_rng(25)
    q, k, v = (rand(rng, 2, 33, 2, 8, requires_grad=False).float() for _ in range(3))
    out = lt.causal_linear_attention(q, k, v)
    ref = linattn.linear_attention(q.numpy(), k.numpy(), v.numpy(), causal=True)
    assert out.dtype == torch.float32 and np.array_equal(out.numpy(), ref)
    # Non-contiguous inputs are made contiguous: same result.
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    assert torch.equal(lt.causal_linear_attention(qt, k, v), out)


def test_training_reduces_the_loss():
    torch.manual_seed(0)
    B, T, H, D = 2, 32, 2, 8
    x = torch.randn(B, T, H * D, dtype=torch.float64)
    target = torch.randn(B, T, H, D, dtype=torch.float64)
    w = [torch.nn.Parameter(0.3 * torch.randn(H * D, H * D, dtype=torch.float64)) for _ in range(3)]
    opt = torch.optim.SGD(w, lr=0.5)
    losses = []
    for _ in range(20):
        q, k, v = ((x @ wi).reshape(B, T, H, D) for wi in w)
        loss = ((lt.causal_linear_attention(q, k, v) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


def test_errors():
    x = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="linattn runs on the CPU"):
        lt.linear_attention(torch.zeros(4, 3, device="meta"), x, x)
    with pytest.raises(TypeError, match="float32 or float64, got torch.float16"):
        lt.linear_attention(x.half(), x, x)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        lt.linear_attention(np.zeros((4, 3)), x, x)
    with pytest.raises(ValueError, match=r"linear_attention: q and k must have the same last dimension D, got "
                                         r"q \(4, 3\), k \(4, 5\)"):
        lt.linear_attention(x, torch.zeros(4, 5), x)


# Shared key heads (GVA): q, k of Hk heads for v's H (test_shared_heads.py has the numpy calls).
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", ["elu", "softmax_split", "dpfp"])
def test_gradcheck_shared_key_heads(causal, masked, name):
    rng = np.random.default_rng(9)
    Hk, G = 1, 3
    q = torch.from_numpy(rng.uniform(-1, 1, (2, 6, Hk, 3))).requires_grad_()
    k = torch.from_numpy(rng.uniform(-1, 1, (2, 6, Hk, 3))).requires_grad_()
    v = torch.from_numpy(rng.uniform(-1, 1, (2, 6, Hk * G, 2))).requires_grad_()
    pad = None
    if masked:
        pad = torch.zeros(2, 6, dtype=torch.bool)
        pad[0, 2] = pad[1, 5] = True
    f = lambda a, b, c: lt.linear_attention(a, b, c, name, causal, key_padding_mask=pad)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_shared_key_heads_match_numpy_and_repeat_interleave():
    Hk, G = 2, 2
    q, k, v, kw = make("packed", Hk, G, np.float64, "elu", seed=10)
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    out = lt.causal_linear_attention(tq, tk, tv, cu_seqlens=torch.tensor(kw["cu_seqlens"]))
    np.testing.assert_array_equal(out.detach().numpy(), linattn.linear_attention(q, k, v, causal=True, **kw))
    # Through torch's repeat_interleave: autograd sums the copies' gradients itself.
    rq, rk, rv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    ref = lt.causal_linear_attention(rq.repeat_interleave(G, dim=-2), rk.repeat_interleave(G, dim=-2), rv,
                                     cu_seqlens=kw["cu_seqlens"])
    np.testing.assert_array_equal(out.detach().numpy(), ref.detach().numpy())
    w = torch.from_numpy(np.random.default_rng(11).uniform(-1, 1, out.shape))
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for a, b in ((tq, rq), (tk, rk), (tv, rv)):
        assert a.grad.shape == a.shape
        assert rel_err(a.grad.numpy(), b.grad.numpy()) <= 1e-12
