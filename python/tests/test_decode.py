"""Decoding from Python (linattn.RecurrentState: prefill, step, save/load, slots), key padding
masks, FLA's kernel names, and reference counts over many calls."""

import gc
import pickle
import sys

import numpy as np
import pytest

import linattn
from test_linattn import TOL, central_difference_worst, head_ref, heads_ref, inputs, phi_np, rel_err, softmax_head_ref

# The fold cadence of the compensated sums (kFoldTokens in the C++ library): resumes are checked
# across it.
FOLD = 128


def positive(name):
    # identity and silu features change sign on [-1, 1]: denominators could cancel.
    return name in ("identity", "silu")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", linattn.FEATURE_MAPS)
def test_prefill_then_steps_match_the_causal_reference(dtype, name):
    rng = np.random.default_rng(20)
    B, T, H, D, M, P = 3, 23, 2, 5, 4, 14
    q, k, v = inputs(rng, (B, T, H, D), (B, T, H, D), M, dtype, positive(name))
    ref = heads_ref(*(x.astype(np.float64) for x in (q, k, v)), lambda a, b, c: head_ref(a, b, c, name, True))
    out, state = linattn.linear_attention(q[:, :P], k[:, :P], v[:, :P], name, causal=True, output_final_state=True)
    assert isinstance(state, linattn.RecurrentState) and state.batch_size == B and state.dtype == dtype
    assert state.feature_map == name and list(state.positions) == [P] * B
    steps = [state.step(q[:, t], k[:, t], v[:, t]) for t in range(P, T)]
    assert steps[0].shape == (B, H, M) and steps[0].dtype == dtype
    assert rel_err(out, ref[:, :P]) <= TOL[dtype]
    assert rel_err(np.stack(steps, axis=1), ref[:, P:]) <= TOL[dtype]
    assert list(state.positions) == [T] * B


def test_initial_state_continues_a_prefill_of_packed_sequences():
    rng = np.random.default_rng(21)
    cu = np.array([0, 9, 9, 30])  # an empty sequence included
    q, k, v = inputs(rng, (30, 2, 6), (30, 2, 6), 3, np.float64)
    first, second = [slice(cu[b], cu[b] + (cu[b + 1] - cu[b]) // 2) for b in range(3)], []
    cu1 = np.concatenate([[0], np.cumsum([s.stop - s.start for s in first])])
    second = [slice(s.stop, cu[b + 1]) for b, s in enumerate(first)]
    cu2 = np.concatenate([[0], np.cumsum([s.stop - s.start for s in second])])
    part = lambda x, ss: np.concatenate([x[s] for s in ss])
    o1, st = linattn.linear_attention(part(q, first), part(k, first), part(v, first), causal=True,
                                      cu_seqlens=cu1, output_final_state=True)
    saved = st.save()
    o2, st2 = linattn.linear_attention(part(q, second), part(k, second), part(v, second), causal=True,
                                       cu_seqlens=cu2, initial_state=st, output_final_state=True)
    assert st.save() == saved  # initial_state is not changed
    full = linattn.linear_attention(q, k, v, causal=True, cu_seqlens=cu)
    for b in range(3):
        assert np.allclose(o1[cu1[b]:cu1[b + 1]], full[first[b]], rtol=0, atol=1e-14)
        assert np.allclose(o2[cu2[b]:cu2[b + 1]], full[second[b]], rtol=0, atol=1e-14)
    assert list(st2.positions) == list(np.diff(cu))
    # A 2-D [N, D] input is one sequence.
    o, s1 = linattn.linear_attention(q[:9, 0], k[:9, 0], v[:9, 0], causal=True, output_final_state=True)
    assert s1.batch_size == 1 and s1.num_heads == 1 and rel_err(o, full[:9, 0]) <= 1e-15


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_batched_steps_equal_separate_states_bit_for_bit(dtype):
    rng = np.random.default_rng(22)
    B, H, D, M, T = 4, 3, 6, 5, 40
    q, k, v = inputs(rng, (B, T, H, D), (B, T, H, D), M, dtype)
    together = linattn.RecurrentState(B, H, D, M, "softmax_split", dtype)
    alone = [linattn.RecurrentState(1, H, D, M, "softmax_split", dtype) for _ in range(B)]
    for t in range(T):
        y = together.step(q[:, t], k[:, t], v[:, t])
        for b in range(B):
            assert np.array_equal(y[b:b + 1], alone[b].step(q[b:b + 1, t], k[b:b + 1, t], v[b:b + 1, t]))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", ["elu", "softmax_split"])
def test_save_load_resumes_bit_for_bit(dtype, name):
    rng = np.random.default_rng(23)
    B, H, D, M, T = 3, 2, 5, 3, 2 * FOLD + 37
    q, k, v = inputs(rng, (B, T, H, D), (B, T, H, D), M, dtype)
    state = linattn.RecurrentState(B, H, D, M, name, dtype)
    # Sequences at different positions and fold phases: sequence 1 skips the first 50 tokens.
    for t in range(FOLD + 20):
        slots = [0, 2] if t < 50 else [0, 1, 2]
        state.step(q[slots, t], k[slots, t], v[slots, t], slots=slots)
    blob = state.save()
    assert isinstance(blob, bytes) and blob[:8] == b"\x89LAS\r\n\x1a\n"
    resumed = linattn.RecurrentState(0, H, D, M, name, dtype)
    resumed.load(blob)
    unpickled = pickle.loads(pickle.dumps(state))
    assert resumed.batch_size == B and list(resumed.positions) == list(state.positions)
    for t in range(FOLD + 20, T):
        y = state.step(q[:, t], k[:, t], v[:, t])
        assert np.array_equal(y, resumed.step(q[:, t], k[:, t], v[:, t]))
        assert np.array_equal(y, unpickled.step(q[:, t], k[:, t], v[:, t]))
    assert resumed.save() == state.save()


def test_load_errors_leave_the_state_unchanged():
    rng = np.random.default_rng(24)
    q, k, v = inputs(rng, (2, 4), (2, 4), 3, np.float32)
    q, k, v = (x.reshape(2, 1, -1) for x in (q, k, v))
    state = linattn.RecurrentState(2, 1, 4, 3)
    state.step(q, k, v)
    blob, before = state.save(), state.save()
    with pytest.raises(RuntimeError, match="load_state: truncated file"):
        state.load(blob[:100])
    flipped = bytearray(blob)
    flipped[90] ^= 1
    with pytest.raises(RuntimeError, match="load_state: corrupted data: checksum mismatch"):
        state.load(bytes(flipped))
    with pytest.raises(RuntimeError, match="load_state: shape mismatch"):
        linattn.RecurrentState(2, 2, 4, 3).load(blob)
    with pytest.raises(RuntimeError, match="wrong scalar type"):
        linattn.RecurrentState(2, 1, 4, 3, dtype=np.float64).load(blob)
    assert state.save() == before


def test_sequences_come_and_go():
    rng = np.random.default_rng(25)
    H, D, M = 2, 4, 4
    q, k, v = inputs(rng, (3, 6, H, D), (3, 6, H, D), M, np.float64)
    state = linattn.RecurrentState(2, H, D, M, dtype=np.float64)
    state.step(q[:2, 0], k[:2, 0], v[:2, 0])
    assert state.add_sequence() == 2 and list(state.positions) == [1, 1, 0]
    state.step(q[:, 1], k[:, 1], v[:, 1])
    last = state.copy()
    state.remove_sequence(0)  # sequence 2 takes number 0
    assert state.batch_size == 2 and list(state.positions) == [1, 2]
    assert np.array_equal(state.step(q[[2, 1], 2], k[[2, 1], 2], v[[2, 1], 2]),
                          last.step(q[:, 2], k[:, 2], v[:, 2])[[2, 1]])
    state.reset(1)
    assert list(state.positions) == [2, 0] and not state.S[1].any() and not state.z[1].any()
    state.resize(3)
    assert state.batch_size == 3 and list(state.positions) == [2, 0, 0]
    state.reset()
    assert not state.positions.any()


def test_state_arrays_are_the_sums():
    rng = np.random.default_rng(26)
    q, k, v = inputs(rng, (1, 7, 2, 3), (1, 7, 2, 3), 4, np.float64)
    _, state = linattn.linear_attention(q, k, v, "elu", causal=True, output_final_state=True)
    phik = np.where(k > 0, k + 1, np.exp(np.minimum(k, 0)))[0]  # [T, H, D]
    assert state.S.shape == (1, 2, 3, 4) and state.z.shape == (1, 2, 3)
    assert np.allclose(state.S[0], np.einsum("thf,thm->hfm", phik, v[0]), rtol=1e-14, atol=0)
    assert np.allclose(state.z[0], phik.sum(0), rtol=1e-14, atol=0)


def test_decode_errors():
    state = linattn.RecurrentState(2, 2, 4, 3)
    x, y = np.zeros((2, 2, 4), np.float32), np.zeros((2, 2, 3), np.float32)
    with pytest.raises(TypeError, match="the state holds float32"):
        state.step(x.astype(np.float64), x.astype(np.float64), y.astype(np.float64))
    with pytest.raises(ValueError, match=r"RecurrentState.step: without slots, q, k, v have one row per sequence "
                                         r"of the state \(B = 2\), got q \(3, 2, 4\)"):
        state.step(np.zeros((3, 2, 4), np.float32), np.zeros((3, 2, 4), np.float32), np.zeros((3, 2, 3), np.float32))
    with pytest.raises(ValueError, match=r"slots\[1\] = 0 is repeated"):
        state.step(x, x, y, slots=[0, 0])
    with pytest.raises(ValueError, match="must be"):
        state.step(x[0], x[0], y[0])
    with pytest.raises(ValueError, match="unknown feature_map 'relu2'"):
        linattn.RecurrentState(1, 1, 4, feature_map="relu2")
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        linattn.RecurrentState(1, 1, 4, dtype=np.int32)
    q = np.zeros((1, 5, 2, 4), np.float32)
    with pytest.raises(ValueError, match="need causal=True"):
        linattn.linear_attention(q, q, q, output_final_state=True)
    with pytest.raises(ValueError, match="initial_state has feature_map 'elu' and dtype float32"):
        linattn.linear_attention(q, q, q, "cosine", causal=True, initial_state=linattn.RecurrentState(1, 2, 4))
    with pytest.raises(ValueError, match="initial_state holds 2 sequences but the input has 1"):
        linattn.linear_attention(q, q, q, causal=True, initial_state=linattn.RecurrentState(2, 2, 4))
    with pytest.raises(TypeError, match="must be a linattn.RecurrentState"):
        linattn.linear_attention(q, q, q, causal=True, initial_state=np.zeros(3))


def masked_ref(q, k, v, keep, fn):
    """fn per sequence and head of [B, T, H, D] arrays over the kept keys (keep [B, S])."""
    return np.stack([heads_ref(q[b], k[b][keep[b]], v[b][keep[b]], fn) for b in range(q.shape[0])])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", ["elu", "softmax_split", "cosine", "softmax"])
def test_key_padding_mask_non_causal(dtype, name):
    rng = np.random.default_rng(27)
    q, k, v = inputs(rng, (2, 9, 2, 5), (2, 13, 2, 5), 3, dtype)
    pad = rng.uniform(size=(2, 13)) < 0.3
    pad[1, :] = True
    pad[1, 4] = False  # one key left in sequence 1
    keep = ~pad
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    if name == "softmax":
        out = linattn.softmax_attention(q, k, v, key_padding_mask=pad)
        ref = masked_ref(*x64, keep, lambda a, b, c: softmax_head_ref(a, b, c, False))
    else:
        out = linattn.linear_attention(q, k, v, name, key_padding_mask=pad)
        ref = masked_ref(*x64, keep, lambda a, b, c: head_ref(a, b, c, name, False))
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("name", ["elu", "cosine"])
def test_key_padding_mask_causal(name):
    rng = np.random.default_rng(28)
    q, k, v = inputs(rng, (31, 2, 4), (31, 2, 4), 3, np.float64)
    pad = rng.uniform(size=31) < 0.4
    out = linattn.linear_attention(q, k, v, name, causal=True, key_padding_mask=pad)
    # A masked key adds nothing: its φ(k) is zero in the causal sums.
    def ref_head(a, b, c):
        w = np.tril(phi_np(name, a) @ (phi_np(name, b) * ~pad[:, None]).T)
        den = w.sum(1, keepdims=True)
        return np.where(den > 0, w @ c / np.where(den > 0, den, 1), 0)  # no key yet: the guard's 0
    assert rel_err(out, heads_ref(q, k, v, ref_head)) <= 1e-12
    # The masked prefill carries the same states as the masked forward.
    o2, st = linattn.linear_attention(q, k, v, name, causal=True, key_padding_mask=pad, output_final_state=True)
    assert np.array_equal(o2, out) and list(st.positions) == [31]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["elu", "softmax"])
def test_key_padding_mask_gradients(causal, name):
    if name == "softmax" and causal:
        pytest.skip("a key padding mask is non-causal only for softmax attention")
    rng = np.random.default_rng(29)
    q, k, v = inputs(rng, (2, 7, 2, 3), (2, 7, 2, 3), 4, np.float64)
    pad = np.zeros((2, 7), bool)
    pad[0, [1, 5]] = pad[1, 6] = True
    if name == "softmax":
        fn = lambda a, b, c: linattn.softmax_attention(a, b, c, key_padding_mask=pad)
        bwd = lambda a, b, c, g: linattn.softmax_attention_backward(a, b, c, g, key_padding_mask=pad)
    else:
        fn = lambda a, b, c: linattn.linear_attention(a, b, c, name, causal, key_padding_mask=pad)
        bwd = lambda a, b, c, g: linattn.linear_attention_backward(a, b, c, g, name, causal, key_padding_mask=pad)
    w = rng.uniform(-1, 1, q.shape[:-1] + (4,))
    grads = bwd(q, k, v, w)
    assert not grads[1][pad].any() and not grads[2][pad].any()
    assert central_difference_worst(fn, grads, [q, k, v], w, rng) < 1e-7


def test_mask_errors():
    q = np.zeros((1, 5, 2, 4))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool array"):
        linattn.linear_attention(q, q, q, key_padding_mask=np.zeros((1, 5)))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(1, 5\)"):
        linattn.linear_attention(q, q, q, key_padding_mask=np.zeros(5, bool))
    with pytest.raises(ValueError, match="causal_softmax_attention: a key padding mask is supported for non-causal"):
        linattn.softmax_attention(q, q, q, causal=True, key_padding_mask=np.zeros((1, 5), bool))


def test_fla_names():
    rng = np.random.default_rng(30)
    B, T, H, K = 2, 11, 2, 4
    q, k, v = inputs(rng, (B, T, H, K), (B, T, H, K), 3, np.float64)
    g = -rng.uniform(0, 0.5, (B, T, H, K))
    beta = rng.uniform(0, 1, (B, T, H))
    o, none = linattn.chunk_gla(q, k, v, g)
    assert none is None and np.array_equal(o, linattn.gated_linear_attention(q, k, v, g))
    assert np.array_equal(linattn.fused_recurrent_simple_gla(q, k, v, g[..., 0], scale=0.5)[0],
                          linattn.gated_linear_attention(q, k, v, g[..., 0], scale=0.5))
    assert np.array_equal(linattn.chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)[0],
                          linattn.delta_rule_attention(q, k, v, beta, None, "l2norm", l2norm_eps=1e-6))
    assert np.array_equal(linattn.chunk_gated_delta_rule(q, k, v, g[..., 0], beta)[0],
                          linattn.delta_rule_attention(q, k, v, beta, g[..., 0], "identity"))
    o2, ht = linattn.chunk_gla(q, k, v, g, output_final_state=True)  # the states: test_fla_states.py
    assert np.array_equal(o2, o) and ht.shape == (B, H, K, 3)


def test_no_reference_leaks_over_many_calls():
    rng = np.random.default_rng(31)
    q, k, v = inputs(rng, (4, 2, 3), (4, 2, 3), 3, np.float32)
    pad = np.zeros(4, bool)
    state = linattn.RecurrentState(4, 2, 3)
    before = [sys.getrefcount(x) for x in (q, k, v, pad, state)]
    gc.collect()
    objects = len(gc.get_objects())
    for _ in range(10000):
        out = linattn.linear_attention(q, k, v, causal=True, key_padding_mask=pad)
        assert sys.getrefcount(out) == 2  # ours and getrefcount's argument: nothing else holds it
        grads = linattn.linear_attention_backward(q, k, v, out, causal=True)
        y = state.step(q, k, v)
    assert sys.getrefcount(y) == 2 and [sys.getrefcount(grads[i]) for i in range(3)] == [2, 2, 2]
    del out, grads, y
    gc.collect()
    assert [sys.getrefcount(x) for x in (q, k, v, pad, state)] == before
    assert len(gc.get_objects()) <= objects + 10
