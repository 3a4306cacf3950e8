"""linattn.torch's modules of the 2026 layers (linattn/nn.py): ShortConvolution and
FusedRMSNormGated against their formulas in plain torch, GatedDeltaNet and KimiDeltaAttention
against transformers' and Kimi Linear's forward written out in plain torch (float64) on the
same state dict, prefills continued from their states, packed sequences, gradcheck of every
parameter, bfloat16 / float16 modules against float32 ones, single-token decoding (step) against
forward, state dicts under the checkpoints'
names, and the errors of bad inputs."""

import os

import numpy as np
import pytest

if os.environ.get("LINATTN_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import linattn.torch as lt  # noqa: E402
from linattn import _linattn as ext  # noqa: E402

D64 = torch.float64


def rand(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=D64) * scale)


def close(a, b, tol=1e-12):
    """|a - b| <= tol · max(1, max |b|): relative to the result's magnitude."""
    err = (a - b).abs().max().item() if a.numel() else 0.0
    ref = max(1.0, b.abs().max().item() if b.numel() else 0.0)
    assert err <= tol * ref, f"max error {err:.3e} > {tol:.0e} x {ref:.3e}"


# ---------------------------------------------------------------- plain-torch references

def ref_conv(x, weight, bias, silu, cache=None):
    """One sequence x [T, C] through nn.Conv1d(C, C, W, groups=C) after its past inputs
    (cache [C, W], the last W; None: zeros); returns (y [T, C], the last W inputs [C, W])."""
    C, _, W = weight.shape
    past = torch.zeros(W, C, dtype=x.dtype) if cache is None else cache.T
    full = torch.cat([past, x])  # the W past inputs, then the sequence
    u = F.conv1d(full.T.unsqueeze(0), weight, bias, groups=C)[0].T[1:]
    return (F.silu(u) if silu else u), full[-W:].T


def ref_norm(o, z, w, eps, silu):
    M = w.numel()
    og, zg = o.reshape(-1, M), z.reshape(-1, M)
    n = og * torch.rsqrt(og.pow(2).mean(-1, keepdim=True) + eps) * w
    return (n * (F.silu(zg) if silu else torch.sigmoid(zg))).reshape(o.shape)


def l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def ref_delta(q, k, v, beta, g, S0=None):
    """One sequence's delta rule, token by token: q, k [T, Hk, K], v [T, H, V], beta [T, H], g
    [T, H] or [T, H, K] (log decays); S ← diag(exp g) S, S += β k (v − Sᵀk)ᵀ, o = Sᵀq/√K with q,
    k L2-normalised. Returns (o [T, H, V], S [H, K, V])."""
    T, Hk, K = q.shape
    H, V = v.shape[1:]
    S = [torch.zeros(K, V, dtype=q.dtype) if S0 is None else S0[h] for h in range(H)]
    out = torch.zeros(T, H, V, dtype=q.dtype)
    for t in range(T):
        for h in range(H):
            c = h // (H // Hk)
            qt, kt = l2norm(q[t, c]), l2norm(k[t, c])
            decay = torch.exp(g[t, h])
            s = decay.unsqueeze(-1) * S[h] if decay.ndim else decay * S[h]
            s = s + beta[t, h] * torch.outer(kt, v[t, h] - s.T @ kt)
            S[h] = s
            out[t, h] = s.T @ qt / K ** 0.5
    return out, torch.stack(S)


def ref_gdn(sd, cfg, x, state=None):
    """transformers' Qwen3NextGatedDeltaNet.forward of one sequence x [T, d] from the state dict
    sd (its names); state (conv cache [C, W], recurrent [Hv, Dk, Dv]) or None."""
    d, Hk, Hv, Dk, Dv, W, eps = cfg
    G = Hv // Hk
    T = x.shape[0]
    qkvz = (x @ sd["in_proj_qkvz.weight"].T).view(T, Hk, 2 * Dk + 2 * G * Dv)
    q, k, v, z = torch.split(qkvz, [Dk, Dk, G * Dv, G * Dv], dim=-1)
    b, a = torch.split((x @ sd["in_proj_ba.weight"].T).view(T, Hk, 2 * G), [G, G], dim=-1)
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
    mixed, conv = ref_conv(mixed, sd["conv1d.weight"], None, True, None if state is None else state[0])
    q, k, v = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    beta = torch.sigmoid(b.reshape(T, Hv))
    g = -sd["A_log"].exp() * F.softplus(a.reshape(T, Hv) + sd["dt_bias"])
    o, S = ref_delta(q.reshape(T, Hk, Dk), k.reshape(T, Hk, Dk), v.reshape(T, Hv, Dv), beta, g,
                     None if state is None else state[1])
    o = ref_norm(o, z.reshape(T, Hv, Dv), sd["norm.weight"], eps, True)
    return o.reshape(T, -1) @ sd["out_proj.weight"].T, (conv, S)


def ref_kda(sd, cfg, x, state=None, lower_bound=None):
    """Kimi Linear's KimiDeltaAttention.forward of one sequence x [T, d] from the state dict."""
    d, H, K, V, W, eps = cfg
    T = x.shape[0]
    caches = (None, None, None) if state is None else state[0]
    q, cq = ref_conv(x @ sd["q_proj.weight"].T, sd["q_conv1d.weight"], None, True, caches[0])
    k, ck = ref_conv(x @ sd["k_proj.weight"].T, sd["k_conv1d.weight"], None, True, caches[1])
    v, cv = ref_conv(x @ sd["v_proj.weight"].T, sd["v_conv1d.weight"], None, True, caches[2])
    a = (x @ sd["f_a_proj.weight"].T @ sd["f_b_proj.weight"].T + sd["dt_bias"]).view(T, H, K)
    A = sd["A_log"].reshape(H, 1).exp()
    g = -A * F.softplus(a) if lower_bound is None else lower_bound * torch.sigmoid(A * a)
    beta = torch.sigmoid(x @ sd["b_proj.weight"].T)
    o, S = ref_delta(q.view(T, H, K), k.view(T, H, K), v.view(T, H, V), beta, g,
                     None if state is None else state[1])
    z = (x @ sd["g_a_proj.weight"].T @ sd["g_b_proj.weight"].T).view(T, H, V)
    o = ref_norm(o, z, sd["o_norm.weight"], eps, False)
    return o.reshape(T, -1) @ sd["o_proj.weight"].T, ((cq, ck, cv), S)


def gdn_state_dict(g, d, Hk, Hv, Dk, Dv, W):
    """A state dict under transformers' Qwen3NextGatedDeltaNet names and shapes."""
    C = 2 * Hk * Dk + Hv * Dv
    return {"in_proj_qkvz.weight": rand(g, 2 * Hk * Dk + 2 * Hv * Dv, d, scale=d ** -0.5),
            "in_proj_ba.weight": rand(g, 2 * Hv, d, scale=d ** -0.5),
            "conv1d.weight": rand(g, C, 1, W, scale=0.5),
            "dt_bias": rand(g, Hv, scale=0.5),
            "A_log": rand(g, Hv, scale=0.5),
            "norm.weight": 1 + rand(g, Dv, scale=0.2),
            "out_proj.weight": rand(g, d, Hv * Dv, scale=(Hv * Dv) ** -0.5)}


def kda_state_dict(g, d, H, K, V, W):
    """A state dict under Kimi Linear's KimiDeltaAttention names and shapes."""
    s = d ** -0.5
    return {"q_proj.weight": rand(g, H * K, d, scale=s), "k_proj.weight": rand(g, H * K, d, scale=s),
            "v_proj.weight": rand(g, H * V, d, scale=s),
            "q_conv1d.weight": rand(g, H * K, 1, W, scale=0.5), "k_conv1d.weight": rand(g, H * K, 1, W, scale=0.5),
            "v_conv1d.weight": rand(g, H * V, 1, W, scale=0.5),
            "A_log": rand(g, 1, 1, H, 1, scale=0.5), "f_a_proj.weight": rand(g, K, d, scale=s),
            "f_b_proj.weight": rand(g, H * K, K, scale=K ** -0.5), "dt_bias": rand(g, H * K, scale=0.5),
            "b_proj.weight": rand(g, H, d, scale=s), "g_a_proj.weight": rand(g, K, d, scale=s),
            "g_b_proj.weight": rand(g, H * V, K, scale=K ** -0.5), "o_norm.weight": 1 + rand(g, V, scale=0.2),
            "o_proj.weight": rand(g, d, H * V, scale=(H * V) ** -0.5)}


def make_gdn(g, d=8, Hk=2, Hv=4, Dk=3, Dv=2, W=4, eps=1e-6):
    m = lt.GatedDeltaNet(d, Hk, Hv, Dk, Dv, W, eps, dtype=D64)
    sd = gdn_state_dict(g, d, Hk, Hv, Dk, Dv, W)
    m.load_state_dict(sd)
    return m, sd, (d, Hk, Hv, Dk, Dv, W, eps)


def make_kda(g, d=8, H=2, K=3, V=2, W=4, eps=1e-6, lower_bound=None):
    kw = {} if lower_bound is None else dict(use_lower_bound=True, lower_bound=lower_bound)
    m = lt.KimiDeltaAttention(d, H, K, V, W, eps, dtype=D64, **kw)
    sd = kda_state_dict(g, d, H, K, V, W)
    m.load_state_dict(sd)
    return m, sd, (d, H, K, V, W, eps)


# ---------------------------------------------------------------- the convolution and the norm

@pytest.mark.parametrize("W, bias, activation", [(4, False, "silu"), (3, True, None), (1, True, "silu")])
def test_short_convolution_equals_conv1d_with_states_and_packed_sequences(W, bias, activation):
    g = torch.Generator().manual_seed(W)
    C, lens = 5, [3, 1, 6]
    conv = lt.ShortConvolution(C, W, bias=bias, activation=activation, dtype=D64)
    ref = torch.nn.Conv1d(C, C, W, groups=C, bias=bias, dtype=D64)
    ref.weight.data.copy_(rand(g, C, 1, W))
    if bias:
        ref.bias.data.copy_(rand(g, C))
    conv.load_state_dict(ref.state_dict())  # nn.Conv1d's state dict loads as it is
    x = rand(g, 1, sum(lens), C)
    cache = rand(g, len(lens), C, W)
    cu = torch.tensor(np.cumsum([0] + lens))
    y, final = conv(x, cache=cache, output_final_state=True, cu_seqlens=cu)
    for n in range(len(lens)):
        yr, fr = ref_conv(x[0, cu[n]:cu[n + 1]], ref.weight, ref.bias, activation == "silu", cache[n])
        close(y[0, cu[n]:cu[n + 1]], yr)
        close(final[n], fr)
    # The kernel's own final state (the last W - 1 inputs) is the cache's last W - 1 columns.
    w2 = conv.weight.detach().reshape(C, W).numpy()
    b2 = None if conv.bias is None else conv.bias.detach().numpy()
    h0 = np.ascontiguousarray(cache[:, :, 1:].transpose(1, 2).numpy())
    _, kfinal = ext.conv_forward(x[0].numpy(), w2, b2, cu.numpy(), h0, activation == "silu")
    np.testing.assert_array_equal(kfinal, final[:, :, 1:].transpose(1, 2).detach().numpy())


def test_short_convolution_continues_a_prefill_and_batches():
    g = torch.Generator().manual_seed(7)
    conv = lt.ShortConvolution(4, 4, dtype=D64)
    x = rand(g, 2, 9, 4)
    y, _ = conv(x)
    y1, c1 = conv(x[:, :2], output_final_state=True)  # shorter than the window: the cache's zeros shift
    y2, c2 = conv(x[:, 2:5], cache=c1, output_final_state=True)
    y3, _ = conv(x[:, 5:], cache=c2)
    close(torch.cat([y1, y2, y3], 1), y, 1e-15)
    for b in range(2):
        close(y[b], ref_conv(x[b], conv.weight, None, True)[0])
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding: those inputs read as zeros
    xm = x.clone()
    xm[1, :3] = 0
    close(conv(x, mask=mask)[0], conv(xm)[0], 0)
    with pytest.raises(ValueError, match="ShortConvolution.forward: residual is not offered"):
        conv(x, residual=x)


def test_gated_rms_norm_equals_its_formula():
    g = torch.Generator().manual_seed(11)
    for activation, silu in (("swish", True), ("silu", True), ("sigmoid", False)):
        norm = lt.FusedRMSNormGated(3, eps=1e-5, activation=activation, dtype=D64)
        norm.weight.data.copy_(rand(g, 3))
        o, z = rand(g, 2, 5, 4, 3), rand(g, 2, 5, 4, 3)
        close(norm(o, z), ref_norm(o, z, norm.weight, 1e-5, silu))
    o, z, w = rand(g, 6, 8), rand(g, 6, 8), rand(g, 4)  # the function: two heads of 4 per row
    close(lt.gated_rms_norm(o, z, w, 1e-6, "sigmoid"), ref_norm(o, z, w, 1e-6, False))
    assert lt.FusedRMSNormGated(4, elementwise_affine=False, dtype=D64)(o[:, :4], z[:, :4]).shape == (6, 4)


def test_gradcheck_of_the_convolution_and_the_norm():
    g = torch.Generator().manual_seed(13)
    x, w, b, h0 = rand(g, 1, 5, 3), rand(g, 3, 1, 3), rand(g, 3), rand(g, 2, 3, 3)
    cu = torch.tensor([0, 2, 5])
    for t in (x, w, b, h0):
        t.requires_grad_()
    for act in ("silu", None):
        f = lambda x, w, b, h0: lt.short_convolution(x, w, b, act, h0, True, cu)  # noqa: E731
        assert torch.autograd.gradcheck(f, (x, w, b, h0))
    xb = rand(g, 2, 3, 3).requires_grad_()  # B sequences of T tokens, zero states
    f = lambda x, w: lt.short_convolution(x, w, None, "silu", None, True)  # noqa: E731
    assert torch.autograd.gradcheck(f, (xb, w))
    o, z, wn = rand(g, 3, 2, 4), rand(g, 3, 2, 4), 1 + rand(g, 4, scale=0.3)
    for t in (o, z, wn):
        t.requires_grad_()
    for act in ("silu", "sigmoid"):
        assert torch.autograd.gradcheck(lambda o, z, w: lt.gated_rms_norm(o, z, w, 1e-6, act), (o, z, wn))


# ---------------------------------------------------------------- the layers

def test_gated_delta_net_equals_transformers_formulas():
    g = torch.Generator().manual_seed(21)
    m, sd, cfg = make_gdn(g)
    x = rand(g, 2, 7, cfg[0])
    y, state = m(x, output_final_state=True)
    for b in range(2):
        yr, (cr, Sr) = ref_gdn(sd, cfg, x[b])
        close(y[b], yr)
        close(state.conv_state[b], cr)
        close(state.recurrent_state[b], Sr)
    # A prefill continued from its state gives the whole sequence's output.
    y1, s1 = m(x[:, :3], output_final_state=True)
    y2 = m(x[:, 3:], initial_state=s1)
    close(torch.cat([y1, y2], 1), y)


def test_gated_delta_net_packed_sequences_equal_separate_calls():
    g = torch.Generator().manual_seed(22)
    m, sd, cfg = make_gdn(g, Hk=1, Hv=2, W=3)
    lens = [4, 1, 5]
    x = rand(g, 1, sum(lens), cfg[0])
    cu = torch.tensor(np.cumsum([0] + lens))
    y, state = m(x, output_final_state=True, cu_seqlens=cu)
    for n in range(len(lens)):
        yr, (cr, Sr) = ref_gdn(sd, cfg, x[0, cu[n]:cu[n + 1]])
        close(y[0, cu[n]:cu[n + 1]], yr)
        close(state.conv_state[n], cr)
        close(state.recurrent_state[n], Sr)


@pytest.mark.parametrize("lower_bound", [None, -4.0])
def test_kimi_delta_attention_equals_kimi_linear_formulas(lower_bound):
    g = torch.Generator().manual_seed(31)
    m, sd, cfg = make_kda(g, lower_bound=lower_bound)
    x = rand(g, 2, 6, cfg[0])
    y, state = m(x, output_final_state=True)
    for b in range(2):
        yr, (cr, Sr) = ref_kda(sd, cfg, x[b], lower_bound=lower_bound)
        close(y[b], yr)
        for c, r in zip(state.conv_state, cr):
            close(c[b], r)
        close(state.recurrent_state[b], Sr)
    y1, s1 = m(x[:, :4], output_final_state=True)
    y2, s2 = m(x[:, 4:], initial_state=s1, output_final_state=True)
    close(torch.cat([y1, y2], 1), y)
    close(s2.recurrent_state, state.recurrent_state)


def test_kimi_delta_attention_packed_sequences():
    g = torch.Generator().manual_seed(32)
    m, sd, cfg = make_kda(g, K=2, V=3, W=2)
    lens = [2, 5]
    x = rand(g, 1, sum(lens), cfg[0])
    cu = torch.tensor(np.cumsum([0] + lens))
    y = m(x, cu_seqlens=cu)
    for n in range(len(lens)):
        close(y[0, cu[n]:cu[n + 1]], ref_kda(sd, cfg, x[0, cu[n]:cu[n + 1]])[0])


def gradcheck_module(m, x, state=None):
    """gradcheck of the output and the final recurrent state in x, every parameter and, when
    given, the initial state (GatedDeltaNet's: one conv cache)."""
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in m.named_parameters()]
    from torch.nn.utils import stateless

    states = () if state is None else tuple(t.detach().clone().requires_grad_() for t in state)

    def f(x, *args):
        ps, st = args[:len(names)], args[len(names):]
        y, s = stateless.functional_call(m, dict(zip(names, ps)), (x, lt.LayerState(*st) if st else None, True))
        return y, s.recurrent_state

    assert torch.autograd.gradcheck(f, (x.requires_grad_(), *params, *states))
    assert len(names) == len(dict(m.state_dict()))


def test_gradcheck_of_a_tiny_gated_delta_net():
    g = torch.Generator().manual_seed(41)
    m, _, cfg = make_gdn(g, d=3, Hk=1, Hv=2, Dk=2, Dv=2, W=2)
    x = rand(g, 1, 3, 3)
    _, state = m(x, output_final_state=True)  # a carried state: its gradients are checked too
    gradcheck_module(m, rand(g, 1, 3, 3), state)


def test_gradcheck_of_a_tiny_kimi_delta_attention():
    g = torch.Generator().manual_seed(42)
    m, _, cfg = make_kda(g, d=3, H=2, K=2, V=2, W=2)
    gradcheck_module(m, rand(g, 1, 3, 3))


def test_float32_modules_agree_with_float64():
    g = torch.Generator().manual_seed(61)
    for make in (make_gdn, make_kda):
        m64, sd, cfg = make(g)
        m32 = type(m64)(*cfg)  # float32: torch's default dtype
        m32.load_state_dict({k: v.float() for k, v in sd.items()})
        x = rand(g, 2, 5, cfg[0])
        y32 = m32(x.float())
        assert y32.dtype == torch.float32
        close(y32.double(), m64(x), 1e-5)


# ---------------------------------------------------------------- bfloat16 / float16

LOW = [torch.bfloat16, torch.float16]


def half_matmul_on_cpu():
    """Whether this torch multiplies float16 matrices on the CPU (nn.Linear; 1.13 does not)."""
    try:
        F.linear(torch.ones(1, 1, dtype=torch.float16), torch.ones(1, 1, dtype=torch.float16))
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_convolution_and_norm_compute_in_float32(dtype):
    # The kernels run in float32 on the widened inputs, each result rounded once to the input's
    # dtype: the bits of the float32 call on the same values, rounded; gradients likewise.
    g = torch.Generator().manual_seed(71)
    conv = lt.ShortConvolution(6, 3, bias=True).to(dtype)
    conv32 = lt.ShortConvolution(6, 3, bias=True)
    conv32.load_state_dict({k: v.float() for k, v in conv.state_dict().items()})
    x = rand(g, 2, 7, 6).to(dtype).requires_grad_()
    x32 = x.detach().float().requires_grad_()
    cache = rand(g, 2, 6, 3).to(dtype)
    y, final = conv(x, cache=cache, output_final_state=True)
    y32, final32 = conv32(x32, cache=cache.float(), output_final_state=True)
    assert y.dtype == dtype and final.dtype == dtype and conv.weight.dtype == dtype
    assert torch.equal(y, y32.to(dtype)) and torch.equal(final, final32.to(dtype))
    dy = rand(g, *y.shape).to(dtype)
    y.backward(dy)
    y32.backward(dy.float())
    assert x.grad.dtype == dtype and torch.equal(x.grad, x32.grad.to(dtype))
    for p, p32 in zip(conv.parameters(), conv32.parameters()):
        assert p.grad.dtype == dtype and torch.equal(p.grad, p32.grad.to(dtype))
    norm = lt.FusedRMSNormGated(4, activation="sigmoid").to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + rand(g, 4, scale=0.2))
    o, z = (rand(g, 3, 2, 4).to(dtype).requires_grad_() for _ in range(2))
    o32, z32 = (t.detach().float().requires_grad_() for t in (o, z))
    w32 = norm.weight.detach().float().requires_grad_()
    out = norm(o, z)
    out32 = lt.gated_rms_norm(o32, z32, w32, norm.eps, "sigmoid")
    assert out.dtype == dtype and torch.equal(out, out32.to(dtype))
    dy = rand(g, *out.shape).to(dtype)
    out.backward(dy)
    out32.backward(dy.float())
    for t, t32 in ((o, o32), (z, z32), (norm.weight, w32)):
        assert t.grad.dtype == dtype and torch.equal(t.grad, t32.grad.to(dtype))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("make", [make_gdn, make_kda])
def test_low_precision_layers_are_close_to_float32_and_train(make, dtype):
    if dtype == torch.float16 and not half_matmul_on_cpu():
        pytest.skip("this torch has no float16 matrix product on the CPU (nn.Linear)")
    # The float32 module on the same (rounded) weights and inputs: the low one differs by the
    # roundings of its activations to the dtype (unit roundoff u = 2^-8 for bf16, 2^-11 for
    # half) after each of its ~6 stages (projections, convolution, o, norm, output); measured
    # 1.3e-2 = 3.2u at most over 5 seeds in bf16. The bound: 10u of max |y|.
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    g = torch.Generator().manual_seed(72)
    m64, sd, cfg = make(g)
    low = type(m64)(*cfg).to(dtype)  # module.to(): every parameter in the dtype
    low.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
    ref = type(m64)(*cfg)
    ref.load_state_dict({k: v.to(dtype).float() for k, v in sd.items()})
    assert all(p.dtype == dtype for p in low.parameters())
    x = rand(g, 2, 9, cfg[0]).to(dtype)
    y, state = low(x, output_final_state=True)
    y32, state32 = ref(x.float(), output_final_state=True)
    assert y.dtype == dtype and state.recurrent_state.dtype == torch.float32  # FLA's state dtype
    close(y.float(), y32, 10 * u)
    # A prefill continued from its state: the whole sequence, to the same bound.
    y_a, s_a = low(x[:, :5], output_final_state=True)
    y_b = low(x[:, 5:], initial_state=s_a)
    close(torch.cat([y_a, y_b], 1).float(), y32, 10 * u)
    # Backward: a gradient of each parameter's dtype, near the float32 one (norm-wise: the sums
    # over tokens of A_log's and dt_bias's gradients cancel; measured 9% at most in bf16).
    dy = rand(g, *y.shape).to(dtype)
    y.backward(dy)
    y32.backward(dy.float())
    for (name, p), p32 in zip(low.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == dtype, name
        err = (p.grad.double() - p32.grad.double()).norm() / p32.grad.double().norm()
        assert err <= 0.25, f"{name}: {err:.3f}"


# ---------------------------------------------------------------- single-token decoding

@pytest.mark.parametrize("make", [make_gdn, make_kda, lambda g: make_kda(g, lower_bound=-4.0)])
def test_step_one_token_at_a_time_equals_forward(make):
    # B sequences, T tokens each through step(): forward of the T tokens, to 1e-12 in float64;
    # from no state and from a prefill's LayerState, whose layer_state() then is forward's.
    g = torch.Generator().manual_seed(81)
    m, _, cfg = make(g, d=8, W=3) if make in (make_gdn, make_kda) else make(g)
    B, T, P = 3, 7, 4
    x = rand(g, B, T, cfg[0])
    y, final = m(x, output_final_state=True)
    x.requires_grad_()  # step is inference: no gradient, under grad mode too
    st = m.make_state(B)
    assert isinstance(st, lt.LayerDecodeState) and st.batch_size == B
    ys = [m.step(x[:, t], st) for t in range(T)]
    assert ys[0].shape == (B, cfg[0]) and not ys[0].requires_grad
    close(torch.stack(ys, 1), y)
    got = st.layer_state()
    for a, b in zip(*(s.conv_state if isinstance(s.conv_state, tuple) else (s.conv_state,) for s in (got, final))):
        close(a, b)
    close(got.recurrent_state, final.recurrent_state)
    _, prefill = m(x[:, :P].detach(), output_final_state=True)
    st = m.make_state(initial_state=prefill)
    ys = [m.step(x[:, t:t + 1], st) for t in range(P, T)]  # [B, 1, d] tokens
    assert ys[0].shape == (B, 1, cfg[0])
    close(torch.cat(ys, 1), y[:, P:])
    # Back into forward: the decoded state continues the sequence.
    x2 = rand(g, B, 2, cfg[0])
    close(m(x2, initial_state=st.layer_state()), m(torch.cat([x.detach(), x2], 1))[:, T:])


def test_step_in_bfloat16_with_bfloat16_states():
    g = torch.Generator().manual_seed(82)
    m64, sd, cfg = make_gdn(g)
    m = type(m64)(*cfg).to(torch.bfloat16)
    m.load_state_dict({k: v.to(torch.bfloat16) for k, v in sd.items()})
    x = rand(g, 2, 6, cfg[0]).to(torch.bfloat16)
    y = m(x)
    for state_dtype, tol in ((None, 10 * 2.0 ** -8), (torch.bfloat16, 20 * 2.0 ** -8)):
        st = m.make_state(2, state_dtype=state_dtype)
        assert st.decoder.state_dtype == ("float32" if state_dtype is None else "bfloat16")
        ys = torch.stack([m.step(x[:, t], st) for t in range(6)], 1)
        assert ys.dtype == torch.bfloat16 and st.conv_state.dtype == torch.bfloat16
        close(ys.float(), y.float(), tol)


def test_step_errors_name_the_method():
    m = lt.KimiDeltaAttention(8, 2, 2, 2, 3)
    st = m.make_state(2)
    with pytest.raises(ValueError, match=r"KimiDeltaAttention.step: hidden_states must be \[B, hidden_size\].*B = 2.*"
                                         r"got \(3, 8\)"):
        m.step(torch.randn(3, 8), st)
    with pytest.raises(TypeError, match="KimiDeltaAttention.step: state must be a LayerDecodeState"):
        m.step(torch.randn(2, 8), None)
    with pytest.raises(TypeError, match="KimiDeltaAttention.step: hidden_states is torch.float64"):
        m.step(torch.randn(2, 8, dtype=D64), st)
    with pytest.raises(ValueError, match="GatedDeltaNet.make_state: batch_size must be >= 0"):
        lt.GatedDeltaNet(8, 1, 2, 2, 2, 3).make_state()
    _, s = m(torch.randn(1, 2, 8), output_final_state=True)
    with pytest.raises(ValueError, match="KimiDeltaAttention.make_state: batch_size = 2 but initial_state holds 1"):
        m.make_state(2, initial_state=s)


def test_state_dicts_have_the_checkpoint_names_and_load_strictly():
    g = torch.Generator().manual_seed(51)
    gdn = lt.GatedDeltaNet(8, 2, 4, 3, 2, 4)
    assert {k: tuple(v.shape) for k, v in gdn.state_dict().items()} == {
        "in_proj_qkvz.weight": (2 * 6 + 2 * 8, 8), "in_proj_ba.weight": (8, 8), "conv1d.weight": (20, 1, 4),
        "dt_bias": (4,), "A_log": (4,), "norm.weight": (2,), "out_proj.weight": (8, 8)}
    kda = lt.KimiDeltaAttention(8, 2, 3, 2, 4)
    assert set(kda.state_dict()) == set(kda_state_dict(g, 8, 2, 3, 2, 4))
    assert tuple(kda.A_log.shape) == (1, 1, 2, 1)
    bad = gdn_state_dict(g, 8, 2, 4, 3, 2, 4)
    bad["conv1d.weight"] = bad["conv1d.weight"][:, :, :3]
    with pytest.raises(RuntimeError, match="conv1d.weight"):
        gdn.load_state_dict(bad)
    cfg = type("Qwen3NextConfig", (), dict(hidden_size=8, linear_num_key_heads=1, linear_num_value_heads=2,
                                           linear_key_head_dim=4, linear_value_head_dim=2, linear_conv_kernel_dim=3,
                                           rms_norm_eps=1e-6))
    assert tuple(lt.GatedDeltaNet.from_config(cfg).conv1d.weight.shape) == (2 * 4 + 4, 1, 3)
    y = gdn(torch.randn(1, 3, 8))  # float32 parameters by default
    assert y.dtype == torch.float32 and y.shape == (1, 3, 8)


# ---------------------------------------------------------------- against the C++ layers

def read_safetensors(path):
    """A safetensors file of F64 tensors as a state dict (the format: an 8-byte little-endian
    header size, the JSON header, the tensors' bytes)."""
    import json

    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F64", (name, info["dtype"])
        lo, hi = info["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(data[lo:hi], "<f8").copy()).reshape(info["shape"])
    return out


@pytest.fixture(scope="module")
def cpp(tmp_path_factory):
    program = os.environ.get("LINATTN_CPP_REFERENCE")
    if not program:
        pytest.skip("LINATTN_CPP_REFERENCE is not set (run through ctest)")
    import subprocess

    out = tmp_path_factory.mktemp("cpp_layers")
    subprocess.run([program, str(out)], check=True)
    return out


def cpp_values(rows, cols, seed):
    """cpp_reference.cpp's values()."""
    i = np.arange(rows * cols, dtype=np.int64)
    return torch.from_numpy((((i * 7919 + seed * 104729) % 2003) / 1001.0 - 1.0).reshape(1, rows, cols))


def test_modules_equal_the_cpp_layers_on_their_checkpoints(cpp):
    x, cu = cpp_values(23, 12, 15), torch.tensor([0, 9, 23])
    gdn = lt.GatedDeltaNet(12, 2, 4, 4, 3, 4, dtype=D64)
    gdn.load_state_dict(read_safetensors(cpp / "gdn.safetensors"))
    close(gdn(x, cu_seqlens=cu)[0], torch.from_numpy(np.fromfile(cpp / "gdn_f64.bin")).reshape(23, 12))
    kda = lt.KimiDeltaAttention(12, 2, 4, 3, 3, dtype=D64)
    kda.load_state_dict(read_safetensors(cpp / "kda.safetensors"))
    close(kda(x, cu_seqlens=cu)[0], torch.from_numpy(np.fromfile(cpp / "kda_f64.bin")).reshape(23, 12))


# ---------------------------------------------------------------- errors

def test_bad_inputs_name_the_function_and_the_shapes():
    x, w = torch.randn(1, 4, 3, dtype=D64), torch.randn(3, 1, 2, dtype=D64)
    with pytest.raises(ValueError, match=r"short_convolution: weight must be \[C, 1, W\].*weight \(4, 1, 2\)"):
        lt.short_convolution(x, torch.randn(4, 1, 2, dtype=D64))
    with pytest.raises(ValueError, match=r"short_convolution: initial_state must be \[N, C, W\] = \[1, 3, 2\]"):
        lt.short_convolution(x, w, initial_state=torch.zeros(1, 3, 1, dtype=D64))
    with pytest.raises(TypeError, match="short_convolution: x, weight must share one dtype"):
        lt.short_convolution(x, w.float())
    with pytest.raises(ValueError, match="short_convolution: cu_seqlens must run from 0 to 4"):
        lt.short_convolution(x, w, cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="short_convolution: activation"):
        lt.short_convolution(x, w, activation="relu")
    with pytest.raises(ValueError, match=r"gated_rms_norm: z must have o's shape.*z \(2, 6\)"):
        lt.gated_rms_norm(torch.randn(2, 4), torch.randn(2, 6), torch.ones(2))
    with pytest.raises(ValueError, match=r"gated_rms_norm: weight must be \[M\].*weight \(3,\)"):
        lt.gated_rms_norm(torch.randn(2, 4), torch.randn(2, 4), torch.ones(3))
    with pytest.raises(ValueError, match="gated_rms_norm: eps = -1.0"):
        lt.gated_rms_norm(torch.randn(2, 4), torch.randn(2, 4), torch.ones(2), eps=-1)
    with pytest.raises(ValueError, match=r"FusedRMSNormGated: x must be \[..., hidden_size = 4\]"):
        lt.FusedRMSNormGated(4)(torch.randn(2, 8), torch.randn(2, 8))
    gdn = lt.GatedDeltaNet(8, 1, 2, 2, 2, 3)
    with pytest.raises(ValueError, match=r"GatedDeltaNet.forward: hidden_states must be \[B, T, hidden_size = 8\], "
                                         r"got \(1, 3, 7\)"):
        gdn(torch.randn(1, 3, 7))
    with pytest.raises(TypeError, match="GatedDeltaNet.forward: hidden_states is torch.float64"):
        gdn(torch.randn(1, 3, 8, dtype=D64))
    with pytest.raises(ValueError, match="GatedDeltaNet: linear_num_value_heads = 3 must be a multiple"):
        lt.GatedDeltaNet(8, 2, 3, 2, 2, 3)
    kda = lt.KimiDeltaAttention(8, 2, 2, 2, 3)
    _, s = kda(torch.randn(1, 2, 8), output_final_state=True)
    with pytest.raises(ValueError, match=r"KimiDeltaAttention.forward: initial_state's conv_state\[0\] must be "
                                         r"\[2, 4, 3\] \(N = 2 sequences\), got \(1, 4, 3\)"):
        kda(torch.randn(2, 2, 8), initial_state=s)  # one sequence's state for two
    with pytest.raises(ValueError, match=r"GatedDeltaNet.forward: initial_state's recurrent_state must be \[1, 2, 2, 2\]"):
        gdn(torch.randn(1, 2, 8), initial_state=lt.LayerState(torch.zeros(1, 8, 3), torch.zeros(1, 2, 2, 3)))
    with pytest.raises(TypeError, match="KimiDeltaAttention.forward: conv_state must be a tuple of 3"):
        kda(torch.randn(1, 2, 8), initial_state=lt.LayerState(s.conv_state[0], s.recurrent_state))
    with pytest.raises(ValueError, match="KimiDeltaAttention: lower_bound = 1.0 must be finite and < 0"):
        lt.KimiDeltaAttention(8, 2, 2, 2, 3, use_lower_bound=True, lower_bound=1.0)
