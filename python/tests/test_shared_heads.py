"""Shared key heads (GVA) in linattn's plain linear attention: q and k of Hk heads for v's H heads
(Hk dividing H) in linear_attention (causal or not, key padding masks, cu_seqlens, carried
states), linear_attention_backward (the masked path included), RecurrentState and linattn.torch,
against the same calls on q and k repeated to H heads (np.repeat along the heads axis, value
head h reading key head h // (H // Hk)): the outputs bit for bit, as the C++ key_heads option
promises, and to 1e-12 against the float64 reference; the gradients against the repeated call's
summed over each group; decoder steps against the forward; errors naming both head counts.
linattn.torch's GVA calls (gradcheck) are in test_torch.py."""

import pickle

import numpy as np
import pytest

import linattn
from test_linattn import TOL, head_ref, heads_ref, rel_err

# (Hk, G): H = Hk·G value heads over Hk query/key heads.
GROUPS = [(2, 2), (1, 3), (2, 3)]
# The call layouts: B sequences of T tokens; packed sequences (one of a single row) with
# cu_seqlens; the same with a key padding mask; non-causal cross attention (S != T keys).
CASES = ["batch", "packed", "masked", "cross"]
D, M = 5, 3  # D != M


def positive(name):
    # identity and silu features change sign on [-1, 1]: denominators could cancel.
    return name in ("identity", "silu")


def rep(x, G):
    """q or k with each head repeated over its G value heads (transformers' repeat_interleave)."""
    return np.repeat(x, G, axis=-2)


def group_sum(dx, Hk, G):
    """The gradient of a repeated input summed back over each head's G copies, in order."""
    return dx.reshape(dx.shape[:-2] + (Hk, G, dx.shape[-1])).sum(axis=-2)


def make(case, Hk, G, dtype, name, seed=0):
    """q, k [.., Hk, D], v [.., H, M] and the call's keyword arguments for one case."""
    rng = np.random.default_rng(seed)
    lo = 0.1 if positive(name) else -1.0
    H = Hk * G
    if case == "batch":
        lead_q = lead_k = (2, 53)  # 53: not a multiple of the chunk (48)
    elif case == "cross":
        lead_q, lead_k = (2, 11), (2, 17)
    else:
        lead_q = lead_k = (53,)
    q = rng.uniform(lo, 1, lead_q + (Hk, D)).astype(dtype)
    k = rng.uniform(lo, 1, lead_k + (Hk, D)).astype(dtype)
    v = rng.uniform(-1, 1, lead_k + (H, M)).astype(dtype)
    kw = {}
    if case in ("packed", "masked"):
        kw["cu_seqlens"] = np.array([0, 1, 20, 53])
    if case == "masked":
        pad = np.zeros(53, bool)
        pad[[0, 7, 19, 40, 41]] = True
        kw["key_padding_mask"] = pad
    return q, k, v, kw


def every_call(test):
    """test(dtype, causal, name, Hk, G) over both dtypes, causal or not, every map and GROUPS."""
    for mark in (pytest.mark.parametrize("dtype", [np.float64, np.float32]),
                 pytest.mark.parametrize("causal", [False, True]),
                 pytest.mark.parametrize("name", linattn.FEATURE_MAPS),
                 pytest.mark.parametrize("Hk,G", GROUPS)):
        test = mark(test)
    return test


def cases(causal):
    return [c for c in CASES if not (causal and c == "cross")]


def reference(q, k, v, name, causal, kw):
    """The float64 reference of an unmasked call on q, k already repeated to v's heads."""
    fn = lambda a, b, c: head_ref(a, b, c, name, causal)  # noqa: E731
    cu = kw.get("cu_seqlens")
    if cu is None:
        return heads_ref(q, k, v, fn)
    return np.concatenate([heads_ref(q[s:e], k[s:e], v[s:e], fn) for s, e in zip(cu[:-1], cu[1:])])


@every_call
def test_forward_equals_the_repeated_call(dtype, causal, name, Hk, G):
    for case in cases(causal):
        q, k, v, kw = make(case, Hk, G, dtype, name)
        out = linattn.linear_attention(q, k, v, name, causal=causal, **kw)
        want = linattn.linear_attention(rep(q, G), rep(k, G), v, name, causal=causal, **kw)
        assert out.shape == q.shape[:-2] + (Hk * G, M) and out.dtype == dtype, case
        np.testing.assert_array_equal(out, want, err_msg=case)
        if dtype == np.float64 and case != "masked":
            assert rel_err(out, reference(rep(q, G), rep(k, G), v, name, causal, kw)) <= TOL[dtype], case


@every_call
def test_backward_is_the_repeated_backward_summed_over_groups(dtype, causal, name, Hk, G):
    for case in cases(causal):
        q, k, v, kw = make(case, Hk, G, dtype, name, seed=1)
        dout = np.random.default_rng(2).uniform(-1, 1, q.shape[:-2] + (Hk * G, M)).astype(dtype)
        dq, dk, dv = linattn.linear_attention_backward(q, k, v, dout, name, causal=causal, **kw)
        rq, rk, rv = linattn.linear_attention_backward(rep(q, G), rep(k, G), v, dout, name, causal=causal, **kw)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape), case
        np.testing.assert_array_equal(dq, group_sum(rq, Hk, G), err_msg=f"dq, {case}")
        np.testing.assert_array_equal(dk, group_sum(rk, Hk, G), err_msg=f"dk, {case}")
        np.testing.assert_array_equal(dv, rv, err_msg=f"dv, {case}")


def test_masked_backward_matches_central_differences():
    # The masked path sums a shared head's gradients itself (not the library's multi-head
    # backward): checked against the loss's own derivatives, not only the repeated call.
    Hk, G = 2, 3
    q, k, v, kw = make("masked", Hk, G, np.float64, "elu", seed=3)
    dout = np.random.default_rng(4).uniform(-1, 1, (53, Hk * G, M))
    for causal in (False, True):
        grads = linattn.linear_attention_backward(q, k, v, dout, "elu", causal=causal, **kw)
        def loss(a, b, c):
            return float((linattn.linear_attention(a, b, c, "elu", causal=causal, **kw) * dout).sum())
        rng = np.random.default_rng(5)
        for i, x in enumerate((q, k, v)):
            for _ in range(6):
                idx = tuple(int(rng.integers(0, n)) for n in x.shape)
                h = 1e-6
                args = [a.copy() for a in (q, k, v)]
                args[i][idx] += h
                up = loss(*args)
                args[i][idx] -= 2 * h
                fd = (up - loss(*args)) / (2 * h)
                assert abs(grads[i][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (causal, i, idx)
    # A masked key's gradients are zero in every head it serves.
    dq, dk, dv = linattn.linear_attention_backward(q, k, v, dout, "elu", **kw)
    pad = kw["key_padding_mask"]
    assert not dk[pad].any() and not dv[pad].any()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("Hk,G", GROUPS)
def test_carried_states_and_steps(dtype, masked, Hk, G):
    name, B, T, P, H = "elu", 3, 30, 17, Hk * G
    rng = np.random.default_rng(6)
    q = rng.uniform(-1, 1, (B, T, Hk, D)).astype(dtype)
    k = rng.uniform(-1, 1, (B, T, Hk, D)).astype(dtype)
    v = rng.uniform(-1, 1, (B, T, H, M)).astype(dtype)
    pad = None
    if masked:
        pad = np.zeros((B, T), bool)
        pad[0, 3] = pad[2, 10] = pad[1, 20] = True
    mask = lambda a, b: None if pad is None else pad[:, a:b]  # noqa: E731
    full = linattn.linear_attention(q, k, v, name, causal=True, key_padding_mask=pad)
    # A prefill, then the rest continued from its states: both halves against the repeated calls.
    out1, state = linattn.linear_attention(q[:, :P], k[:, :P], v[:, :P], name, causal=True,
                                           key_padding_mask=mask(0, P), output_final_state=True)
    want1, rstate = linattn.linear_attention(rep(q[:, :P], G), rep(k[:, :P], G), v[:, :P], name, causal=True,
                                             key_padding_mask=mask(0, P), output_final_state=True)
    assert (state.num_heads, state.num_key_heads, rstate.num_key_heads) == (H, Hk, H)
    np.testing.assert_array_equal(out1, want1)
    np.testing.assert_array_equal(state.S, rstate.S)
    np.testing.assert_array_equal(state.z, rstate.z)
    out2 = linattn.linear_attention(q[:, P:], k[:, P:], v[:, P:], name, causal=True, key_padding_mask=mask(P, T),
                                    initial_state=state)
    want2 = linattn.linear_attention(rep(q[:, P:], G), rep(k[:, P:], G), v[:, P:], name, causal=True,
                                     key_padding_mask=mask(P, T), initial_state=rstate)
    np.testing.assert_array_equal(out2, want2)
    assert rel_err(np.concatenate([out1, out2], axis=1), full) <= TOL[dtype]
    if masked:
        return
    # Steps after the prefill: the forward's rows, and the repeated decoder's bits.
    blob = pickle.dumps(state)
    steps = []
    for t in range(P, T):
        o = state.step(q[:, t], k[:, t], v[:, t])
        np.testing.assert_array_equal(o, rstate.step(rep(q[:, t], G), rep(k[:, t], G), v[:, t]))
        steps.append(o)
    assert rel_err(np.stack(steps, axis=1), full[:, P:]) <= TOL[dtype]
    # Pickled (save / load) and resumed: the same bits, the key heads kept.
    back = pickle.loads(blob)
    assert back.num_key_heads == Hk and ("num_key_heads" in repr(back)) == (Hk != H)
    for t in range(P, T):
        np.testing.assert_array_equal(back.step(q[:, t], k[:, t], v[:, t]), steps[t - P])
    # A subset of the sequences (slots), FLA's [R, 1, Hk, D] rows.
    sub = back.copy()
    o = sub.step(q[[2, 0], T - 1][:, None], k[[2, 0], T - 1][:, None], v[[2, 0], T - 1][:, None], slots=[2, 0])
    assert o.shape == (2, 1, H, M)


def test_packed_prefill_then_steps():
    Hk, G = 2, 2
    q, k, v, kw = make("packed", Hk, G, np.float64, "softmax_split", seed=7)
    out, state = linattn.linear_attention(q, k, v, "softmax_split", causal=True, output_final_state=True, **kw)
    _, rstate = linattn.linear_attention(rep(q, G), rep(k, G), v, "softmax_split", causal=True,
                                         output_final_state=True, **kw)
    assert state.batch_size == 3 and list(state.positions) == [1, 19, 33]
    np.testing.assert_array_equal(state.S, rstate.S)
    rng = np.random.default_rng(8)
    qt, kt, vt = rng.uniform(-1, 1, (3, Hk, D)), rng.uniform(-1, 1, (3, Hk, D)), rng.uniform(-1, 1, (3, Hk * G, M))
    np.testing.assert_array_equal(state.step(qt, kt, vt), rstate.step(rep(qt, G), rep(kt, G), vt))


def test_errors_name_both_head_counts():
    z = np.zeros
    with pytest.raises(ValueError, match=r"linear_attention: v's heads H must be a positive multiple of q's and "
                                         r"k's heads Hk .* got H = 3, Hk = 2"):
        linattn.linear_attention(z((8, 2, 4)), z((8, 2, 4)), z((8, 3, 4)))
    with pytest.raises(ValueError, match=r"causal_linear_attention_backward: v's heads H .* H = 5, Hk = 2"):
        linattn.linear_attention_backward(z((8, 2, 4)), z((8, 2, 4)), z((8, 5, 4)), z((8, 5, 4)), causal=True)
    with pytest.raises(ValueError, match=r"q and k must have the same number of heads Hk, got Hk = 2 \(q\) and "
                                         r"1 \(k\)"):
        linattn.linear_attention(z((8, 2, 4)), z((8, 1, 4)), z((8, 4, 4)))
    with pytest.raises(ValueError, match=r"dout must have the output's shape \(8, 4, 3\)"):
        linattn.linear_attention_backward(z((8, 2, 4)), z((8, 2, 4)), z((8, 4, 3)), z((8, 2, 3)))
    # The other kernels of this layout keep one head count for all three.
    with pytest.raises(ValueError, match="softmax_attention: q, k and v must have the same number of heads"):
        linattn.softmax_attention(z((8, 2, 4)), z((8, 2, 4)), z((8, 4, 4)))
    # The decoder.
    with pytest.raises(ValueError, match=r"RecurrentState: num_key_heads must be positive and divide num_heads "
                                         r".*num_heads = 4, num_key_heads = 3"):
        linattn.RecurrentState(2, 4, 5, num_key_heads=3)
    st = linattn.RecurrentState(2, 4, 5, 3, dtype=np.float64, num_key_heads=2)
    with pytest.raises(ValueError, match=r"RecurrentState.step: the state has H = 4 value heads over Hk = 2 key "
                                         r"heads of D = 5, M = 3: q and k must end in \(2, 5\)"):
        st.step(z((2, 4, 5)), z((2, 4, 5)), z((2, 4, 3)))
    with pytest.raises(ValueError, match=r"initial_state has H = 4 value heads over Hk = 2 key heads, the call "
                                         r"H = 4 \(v\) over Hk = 4 \(q, k\)"):
        linattn.linear_attention(z((2, 3, 4, 5)), z((2, 3, 4, 5)), z((2, 3, 4, 3)), causal=True, initial_state=st)
    # The extension's own checks, for a caller of linattn._linattn that skips the package's.
    from linattn import _linattn
    q, v = z((8, 4)), z((8, 6))
    with pytest.raises(ValueError, match=r"heads H must be a positive multiple of key_heads Hk \(heads H = 3, "
                                         r"key_heads Hk = 2"):
        _linattn.linear_backward(q, q, v, v, 3, "elu", False, None, None, np.ones(8, bool), key_heads=2)
    with pytest.raises(ValueError, match="key_heads"):
        _linattn.linear_forward(q, q, v, 3, "elu", False, None, None, None, key_heads=2)
