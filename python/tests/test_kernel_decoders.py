"""The gated and delta-rule decoders (linattn.GatedDecoder, linattn.DeltaRuleDecoder): a prefill's
final_state continued token by token against FLA's names over the whole sequence, shared key
heads, KDA's per-channel decays, slots, extend, rollback, save/load/pickle/copy and errors; states
kept in bfloat16 / float16 against a float32 decoder rounded after every token."""

import copy
import os
import pickle

import numpy as np
import pytest

import linattn

TOL = {np.float64: 1e-12, np.float32: 1e-5}


def rel_err(x, ref):
    return np.abs(np.asarray(x, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-300)


def tokens(rng, kernel, B, T, H, Hk, K, V, dtype):
    """q, k [B, T, Hk, K], v [B, T, H, V], g (per head or per channel by kernel), beta."""
    q = rng.uniform(-1, 1, (B, T, Hk, K))
    k = rng.uniform(-1, 1, (B, T, Hk, K))
    if kernel == "delta":  # unit keys: without a decay or a map, |1 - β|k|²| <= 1 keeps S bounded
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.uniform(-1, 1, (B, T, H, V))
    if kernel in ("kda", "gla"):
        g = -rng.uniform(0.01, 0.3, (B, T, H, K))
    elif kernel == "delta":
        g = None
    else:
        g = -rng.uniform(0.01, 0.3, (B, T, H))
    beta = rng.uniform(0.1, 1.0, (B, T, H)) if kernel in ("gdn", "kda", "delta") else None
    cast = lambda a: None if a is None else a.astype(dtype)
    return cast(q), cast(k), cast(v), cast(g), cast(beta)


def fla(kernel, q, k, v, g, beta, **kw):
    """The FLA-named call of each kernel (o, final_state)."""
    if kernel == "gdn":
        return linattn.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw)
    if kernel == "kda":
        return linattn.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw)
    if kernel == "delta":
        return linattn.fused_recurrent_delta_rule(q, k, v, beta, **kw)
    if kernel == "gla":
        return linattn.chunk_gla(q, k, v, g, **kw)
    return linattn.chunk_simple_gla(q, k, v, g, **kw)


def decoder(kernel, B, H, Hk, K, V, dtype, **kw):
    if kernel in ("gla", "simple_gla"):
        return linattn.GatedDecoder(B, H, K, V, num_key_heads=Hk, dtype=dtype, **kw)
    return linattn.DeltaRuleDecoder(B, H, K, V, num_key_heads=Hk, use_qk_l2norm_in_kernel=kernel != "delta",
                                    dtype=dtype, **kw)


def step(dec, q, k, v, g, beta, **kw):
    if isinstance(dec, linattn.GatedDecoder):
        return dec.step(q, k, v, g, **kw)
    return dec.step(q, k, v, g, beta, **kw)


def extend(dec, q, k, v, g, beta, **kw):
    if isinstance(dec, linattn.GatedDecoder):
        return dec.extend(q, k, v, g, **kw)
    return dec.extend(q, k, v, g, beta, **kw)


def at(a, t):
    return None if a is None else a[:, t]


KERNELS = ["gdn", "kda", "delta", "gla", "simple_gla"]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kernel", KERNELS)
def test_prefill_then_steps_match_the_fla_call(kernel, dtype):
    # GVA (2 key heads for 4 value heads), K != V, a prefill's final_state continued.
    rng = np.random.default_rng(7)
    B, T, P, H, Hk, K, V = 2, 13, 6, 4, 2, 5, 3
    q, k, v, g, beta = tokens(rng, kernel, B, T, H, Hk, K, V, dtype)
    ref, ref_state = fla(kernel, q, k, v, g, beta, output_final_state=True)
    cut = lambda a: None if a is None else a[:, :P]
    _, ht = fla(kernel, cut(q), cut(k), cut(v), cut(g), cut(beta), output_final_state=True)
    cls = linattn.GatedDecoder if kernel in ("gla", "simple_gla") else linattn.DeltaRuleDecoder
    opts = {} if cls is linattn.GatedDecoder else dict(use_qk_l2norm_in_kernel=kernel != "delta")
    dec = cls.from_final_state(ht, num_key_heads=Hk, positions=P, **opts)
    assert dec.dtype == dtype and dec.num_key_heads == Hk and list(dec.positions) == [P] * B
    out = [step(dec, q[:, t], k[:, t], v[:, t], at(g, t), at(beta, t)) for t in range(P, T)]
    assert out[0].shape == (B, H, V) and out[0].dtype == dtype
    assert rel_err(np.stack(out, 1), ref[:, P:].astype(np.float64)) <= TOL[dtype]
    assert rel_err(dec.states, ref_state.astype(np.float64)) <= TOL[dtype]
    assert list(dec.positions) == [T] * B
    # From no state: the whole sequence token by token.
    fresh = decoder(kernel, B, H, Hk, K, V, dtype)
    out = [step(fresh, q[:, t], k[:, t], v[:, t], at(g, t), at(beta, t)) for t in range(T)]
    assert rel_err(np.stack(out, 1), ref.astype(np.float64)) <= TOL[dtype]


def test_fla_token_shapes_and_options():
    # [R, 1, ...] tokens, beta None (1), g None (DeltaNet), a scale, the l2norm_silu map.
    rng = np.random.default_rng(8)
    B, T, H, K, V = 2, 5, 2, 4, 4
    q, k, v, _, beta = tokens(rng, "delta", B, T, H, H, K, V, np.float64)
    ref, _ = linattn.fused_recurrent_delta_rule(q, k, v, scale=0.3)
    dec = linattn.DeltaRuleDecoder(B, H, K, scale=0.3, dtype=np.float64)
    out = np.concatenate([dec.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(T)], 1)
    assert rel_err(out, ref) <= 1e-12
    ref = linattn.delta_rule_attention(q, k, v, beta, feature_map="l2norm_silu", scale=0.5)
    dec = linattn.DeltaRuleDecoder(B, H, K, scale=0.5, feature_map="l2norm_silu", l2norm_eps=0.0, dtype=np.float64)
    assert rel_err(dec.extend(q, k, v, beta=beta), ref) <= 1e-12


def test_normalized_gated_decoder_with_elu_and_z():
    rng = np.random.default_rng(9)
    B, T, H, K, V = 2, 9, 2, 3, 4
    q, k, v, g, _ = tokens(rng, "simple_gla", B, T, H, H, K, V, np.float64)
    ref = linattn.gated_linear_attention(q, k, v, g, feature_map="elu", normalize=True)
    dec = linattn.GatedDecoder(B, H, K, V, normalize=True, feature_map="elu", dtype=np.float64)
    out = [dec.step(q[:, t], k[:, t], v[:, t], g[:, t]) for t in range(5)]
    # The states with their normalisers continue elsewhere.
    other = linattn.GatedDecoder(B, H, K, V, normalize=True, feature_map="elu", dtype=np.float64)
    other.set_states(dec.states, positions=dec.positions, z=dec.z)
    assert list(other.positions) == [5, 5] and np.array_equal(other.z, dec.z)
    out += [other.step(q[:, t], k[:, t], v[:, t], g[:, t]) for t in range(5, T)]
    assert rel_err(np.stack(out, 1), ref) <= 1e-12


@pytest.mark.parametrize("kernel", ["kda", "gla"])
def test_slots_step_a_subset_as_separate_decoders(kernel):
    rng = np.random.default_rng(10)
    B, H, Hk, K, V = 3, 4, 2, 4, 3
    q, k, v, g, beta = tokens(rng, kernel, B, 4, H, Hk, K, V, np.float32)
    dec = decoder(kernel, B, H, Hk, K, V, np.float32)
    step(dec, q[:, 0], k[:, 0], v[:, 0], at(g, 0), at(beta, 0))
    singles = []
    for b in range(B):
        s = decoder(kernel, 1, H, Hk, K, V, np.float32)
        s.states = dec.states[b:b + 1]
        singles.append(s)
    before = dec.states
    slots = [2, 0]
    rows = lambda a: None if a is None else a[slots, 1]
    out = step(dec, rows(q), rows(k), rows(v), rows(g), rows(beta), slots=slots)
    for r, b in enumerate(slots):
        one = lambda a: None if a is None else a[b:b + 1, 1]
        assert np.array_equal(out[r], step(singles[b], one(q), one(k), one(v), one(g), one(beta))[0])
        assert np.array_equal(dec.states[b], singles[b].states[0])
    assert np.array_equal(dec.states[1], before[1])  # not in slots: unchanged
    assert list(dec.positions) == [2, 1, 2]


@pytest.mark.parametrize("kernel", ["gdn", "simple_gla"])
def test_extend_is_steps_bit_for_bit(kernel):
    rng = np.random.default_rng(11)
    B, H, Hk, K, V = 3, 2, 1, 4, 5
    q, k, v, g, beta = tokens(rng, kernel, 1, 8, H, Hk, K, V, np.float32)
    dec = decoder(kernel, B, H, Hk, K, V, np.float32)
    ref = dec.copy()
    cu, slots = np.array([0, 3, 8]), np.array([2, 0])  # 3 tokens of sequence 2, 5 of sequence 0
    out = extend(dec, q, k, v, g, beta, cu_seqlens=cu, slots=slots)
    assert out.shape == v.shape
    for i, b in enumerate(slots):
        for t in range(cu[i], cu[i + 1]):
            row = lambda a: None if a is None else a[0, t:t + 1]
            assert np.array_equal(out[0, t], step(ref, row(q), row(k), row(v), row(g), row(beta), slots=[b])[0])
    assert dec.save() == ref.save() and list(dec.positions) == [5, 0, 3]
    # [B, T, ...]: sequence b takes row b's T tokens.
    q, k, v, g, beta = tokens(rng, kernel, B, 4, H, Hk, K, V, np.float32)
    out = extend(dec, q, k, v, g, beta)
    steps = np.stack([step(ref, q[:, t], k[:, t], v[:, t], at(g, t), at(beta, t)) for t in range(4)], 1)
    assert np.array_equal(out, steps) and dec.save() == ref.save()


def test_the_same_bits_for_any_thread_count():
    # Large enough for the decoder to split the (sequence, head) pairs over 2 threads.
    rng = np.random.default_rng(15)
    B, T, H, K, V = 4, 8, 4, 48, 48
    q, k, v, g, beta = tokens(rng, "kda", B, T, H, H, K, V, np.float32)
    before = linattn.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            linattn.set_num_threads(n)
            dec = decoder("kda", B, H, H, K, V, np.float32)
            results.append((extend(dec, q, k, v, g, beta), step(dec, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]),
                            dec.save()))
    finally:
        linattn.set_num_threads(before)
    assert all(np.array_equal(a, b) for a, b in zip(results[0][:2], results[1][:2]))
    assert results[0][2] == results[1][2]


@pytest.mark.parametrize("kernel", ["kda", "gla"])
def test_rollback_restores_the_snapshot_exactly(kernel):
    rng = np.random.default_rng(12)
    B, H, Hk, K, V = 2, 2, 2, 3, 4
    q, k, v, g, beta = tokens(rng, kernel, 1, 9, H, Hk, K, V, np.float64)
    dec = decoder(kernel, B, H, Hk, K, V, np.float64)
    dec.keep_snapshots(4)
    partial = dec.copy()
    cu, slots = np.array([0, 6, 9]), np.array([1, 0])  # sequence 1: 6 draft tokens, sequence 0: 3
    extend(dec, q, k, v, g, beta, cu_seqlens=cu, slots=slots)
    assert dec.snapshots(1) == 4 and dec.snapshots(0) == 3 and dec.kept_snapshots == 4
    dec.rollback(1, 4)  # sequence 1 accepts 4 of its 6
    # What extending by only those tokens leaves.
    keep = np.r_[0:4, 6:9]
    sel = lambda a: None if a is None else a[:, keep]
    extend(partial, sel(q), sel(k), sel(v), sel(g), sel(beta), cu_seqlens=[0, 4, 7], slots=slots)
    assert np.array_equal(dec.states, partial.states) and list(dec.positions) == [3, 4]
    assert dec.save() == partial.save()
    with pytest.raises(ValueError, match=r"rollback.*sequence 1.*got 1"):
        dec.rollback(1, 1)  # before the first kept snapshot
    q2, k2, v2, g2, b2 = tokens(rng, kernel, B, 1, H, Hk, K, V, np.float64)
    a = step(dec, q2[:, 0], k2[:, 0], v2[:, 0], at(g2, 0), at(b2, 0))
    assert np.array_equal(a, step(partial, q2[:, 0], k2[:, 0], v2[:, 0], at(g2, 0), at(b2, 0)))
    assert dec.snapshots(0) == 0  # a step leaves no rollback point


@pytest.mark.parametrize("kernel", ["gdn", "gla"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_save_load_pickle_copy_continue_bit_for_bit(kernel, dtype):
    rng = np.random.default_rng(13)
    B, H, Hk, K, V = 3, 4, 2, 4, 3
    q, k, v, g, beta = tokens(rng, kernel, B, 6, H, Hk, K, V, dtype)
    dec = decoder(kernel, B, H, Hk, K, V, dtype)
    for t in range(3):
        step(dec, q[:, t], k[:, t], v[:, t], at(g, t), at(beta, t))
    blob = dec.save()
    loaded = decoder(kernel, 1, H, Hk, K, V, dtype)  # takes the file's number of sequences
    loaded.load(blob)
    copies = [loaded, pickle.loads(pickle.dumps(dec)), dec.copy(), copy.deepcopy(dec)]
    assert all(c.batch_size == B and list(c.positions) == [3] * B for c in copies)
    assert repr(copies[1]) == repr(dec)
    for t in range(3, 6):
        ref = step(dec, q[:, t], k[:, t], v[:, t], at(g, t), at(beta, t))
        for c in copies:
            assert np.array_equal(step(c, q[:, t], k[:, t], v[:, t], at(g, t), at(beta, t)), ref)
    assert all(c.save() == dec.save() for c in copies)
    # A bad file changes nothing.
    before = loaded.save()
    with pytest.raises(RuntimeError):
        loaded.load(blob[:-4])
    with pytest.raises(RuntimeError):
        loaded.load(blob[:-1] + bytes([blob[-1] ^ 1]))
    for other in (decoder(kernel, 1, H, Hk, K + 1, V, dtype), decoder(kernel, 1, H, Hk, V, K, dtype)):
        with pytest.raises(RuntimeError):
            other.load(blob)
    assert loaded.save() == before


def test_sequences_added_removed_and_states_set():
    rng = np.random.default_rng(14)
    B, H, K, V = 3, 2, 3, 2
    dec = linattn.DeltaRuleDecoder(B, H, K, V, dtype=np.float64)
    q, k, v, g, beta = tokens(rng, "gdn", B, 2, H, H, K, V, np.float64)
    dec.step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    S = dec.states
    assert S.shape == (B, H, K, V)
    assert dec.add_sequence() == 3 and dec.batch_size == 4 and not dec.states[3].any()
    dec.remove_sequence(0)  # the last (empty) one takes number 0
    assert np.array_equal(dec.states[1:], S[1:]) and not dec.states[0].any()
    dec.resize(2)
    assert dec.batch_size == 2 and list(dec.positions) == [0, 1]
    new = rng.uniform(-1, 1, (2, H, K, V)).astype(np.float32)  # cast to the decoder's dtype
    dec.set_states(new, positions=[4, 7])
    assert np.array_equal(dec.states, new.astype(np.float64)) and list(dec.positions) == [4, 7]
    dec.states = S[:2]
    assert np.array_equal(dec.states, S[:2]) and list(dec.positions) == [0, 0]
    dec.reset(1)
    assert not dec.states[1].any() and np.array_equal(dec.states[0], S[0])
    empty = linattn.GatedDecoder(0, H, K, V)  # no sequences: steps of no rows
    z = lambda *shape: np.zeros(shape, np.float32)
    assert empty.step(z(0, H, K), z(0, H, K), z(0, H, V), z(0, H)).shape == (0, H, V)
    assert empty.states.shape == (0, H, K, V) and empty.save() == b""


def test_errors_name_the_function_and_shapes():
    B, H, Hk, K, V = 2, 4, 2, 3, 5
    dec = linattn.DeltaRuleDecoder(B, H, K, V, num_key_heads=Hk, dtype=np.float32)
    q = np.zeros((B, Hk, K), np.float32)
    v = np.zeros((B, H, V), np.float32)
    beta = np.full((B, H), 0.5, np.float32)
    with pytest.raises(ValueError, match=r"DeltaRuleDecoder.step: .*q and k must be \(2, 2, 3\).*q \(2, 4, 3\)"):
        dec.step(np.zeros((B, H, K), np.float32), q, v, None, beta)
    with pytest.raises(TypeError, match="DeltaRuleDecoder.step: the decoder holds float32"):
        dec.step(q.astype(np.float64), q.astype(np.float64), v.astype(np.float64))
    with pytest.raises(ValueError, match=r"DeltaRuleDecoder.step: beta\[1, 2\] = 3.0: beta must be in \[0, 2\]"):
        dec.step(q, q, v, None, np.where(np.arange(B * H).reshape(B, H) == 6, 3, beta))
    with pytest.raises(ValueError, match=r"DeltaRuleDecoder.step: g\[0, 1\] = 0.5"):
        dec.step(q, q, v, np.where(np.arange(B * H).reshape(B, H) == 1, 0.5, -0.1).astype(np.float32), beta)
    with pytest.raises(ValueError, match=r"DeltaRuleDecoder.step: g must be \(2, 4\).*or \(2, 4, 3\)"):
        dec.step(q, q, v, np.zeros((B, H, V), np.float32), beta)
    with pytest.raises(ValueError, match="DeltaRuleDecoder.step: without slots"):
        dec.step(q[:1], q[:1], v[:1], None, beta[:1])
    with pytest.raises(ValueError, match=r"DeltaRuleDecoder.step: .*slot"):
        dec.step(q, q, v, None, beta, slots=[1, 1])
    with pytest.raises(ValueError, match=r"DeltaRuleDecoder.step: .*slot"):
        dec.step(q, q, v, None, beta, slots=[0, 2])
    with pytest.raises(TypeError, match="DeltaRuleDecoder.step: slots must be a 1-D integer array"):
        dec.step(q, q, v, None, beta, slots=[0.0, 1.0])
    with pytest.raises(ValueError, match=r"DeltaRuleDecoder.extend: cu_seqlens must run from 0 to 4"):
        dec.extend(np.zeros((4, Hk, K), np.float32), np.zeros((4, Hk, K), np.float32),
                   np.zeros((4, H, V), np.float32), cu_seqlens=[0, 3])
    with pytest.raises(ValueError, match="DeltaRuleDecoder.extend: slots must have one entry per sequence"):
        dec.extend(np.zeros((4, Hk, K), np.float32), np.zeros((4, Hk, K), np.float32),
                   np.zeros((4, H, V), np.float32), cu_seqlens=[0, 1, 4], slots=[0])
    with pytest.raises(ValueError, match=r"DeltaRuleDecoder.set_states: the states must have shape \(2, 4, 3, 5\)"):
        dec.set_states(np.zeros((B, H, V, K)))
    with pytest.raises(ValueError, match="DeltaRuleDecoder.rollback: .*no snapshot"):
        dec.rollback(0, 1)
    with pytest.raises(ValueError, match="DeltaRuleDecoder.remove_sequence: .*5"):
        dec.remove_sequence(5)
    with pytest.raises(ValueError, match="DeltaRuleDecoder: num_key_heads must divide num_heads"):
        linattn.DeltaRuleDecoder(1, 4, 3, num_key_heads=3)
    with pytest.raises(TypeError, match="GatedDecoder: dtype must be float32 or float64"):
        linattn.GatedDecoder(1, 2, 3, dtype=np.int32)
    with pytest.raises(ValueError, match="GatedDecoder: unknown feature_map 'l2norm'"):
        linattn.GatedDecoder(1, 2, 3, feature_map="l2norm")
    gated = linattn.GatedDecoder(B, 2, K, V)
    with pytest.raises(ValueError, match="GatedDecoder.step: .*g .*required"):
        gated.step(np.zeros((B, 2, K), np.float32), np.zeros((B, 2, K), np.float32),
                   np.zeros((B, 2, V), np.float32), None)
    assert not dec.positions.any()  # nothing above moved a state


# --- states kept in bfloat16 / float16 (state_dtype=) ----------------------------------------------


def round_to(state_dtype, x):
    """float32 x rounded to the nearest bfloat16 / float16 (ties to even), widened back: what
    the C++ decoder with that StateScalar keeps. bf16 by its bits (numpy has no bfloat16)."""
    x = np.ascontiguousarray(x, np.float32)
    if state_dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def round_states(dec, state_dtype):
    """The float32 reference's states rounded, as the low-state decoder keeps its own."""
    z = {"z": dec.z} if isinstance(dec, linattn.GatedDecoder) else {}
    dec.set_states(round_to(state_dtype, dec.states), positions=dec.positions, **z)


LOW_STATES = ["bfloat16", "float16"]


@pytest.mark.parametrize("state_dtype", LOW_STATES)
@pytest.mark.parametrize("kernel", KERNELS + ["gla_normalized"])
def test_low_states_are_a_float_decoder_rounded_after_every_token(kernel, state_dtype):
    # GVA, K != V; every third token through step(slots) in reverse; then extend of all the
    # tokens against the steps, and rollback onto the state before the last.
    rng = np.random.default_rng(21)
    B, T, H, Hk, K, V = 3, 10, 4, 2, 5, 3
    opts = dict(normalize=True, feature_map="elu") if kernel == "gla_normalized" else {}
    kernel = "gla" if kernel == "gla_normalized" else kernel
    q, k, v, g, beta = tokens(rng, kernel, B, T, H, Hk, K, V, np.float32)
    low = decoder(kernel, B, H, Hk, K, V, np.float32, state_dtype=state_dtype, **opts)
    ref = decoder(kernel, B, H, Hk, K, V, np.float32, **opts)
    unrounded = ref.copy()
    assert low.state_dtype == state_dtype and ref.state_dtype == "float32" and low.dtype == np.float32
    by_extend = low.copy()
    outs = []
    for t in range(T):
        if t == T - 1:
            before_last = low.states
        slots = [2, 1, 0] if t % 3 == 1 else None
        rows = lambda a: None if a is None else (a[slots, t] if slots else a[:, t])
        kw = {"slots": slots} if slots else {}
        out = step(low, rows(q), rows(k), rows(v), rows(g), rows(beta), **kw)
        want = step(ref, rows(q), rows(k), rows(v), rows(g), rows(beta), **kw)
        step(unrounded, rows(q), rows(k), rows(v), rows(g), rows(beta), **kw)
        round_states(ref, state_dtype)
        assert out.dtype == np.float32 and np.array_equal(out, want), t
        S = low.states
        assert S.dtype == np.float32 and np.array_equal(S, ref.states), t
        assert np.array_equal(round_to(state_dtype, S), S)  # every entry a bf16 / half value
        if isinstance(low, linattn.GatedDecoder):
            assert np.array_equal(low.z, ref.z)  # z kept in float
        outs.append(out[::-1] if slots else out)
    # The rounding is there (the test can fail) and costs what the storage's precision allows.
    assert not np.array_equal(low.states, unrounded.states)
    assert rel_err(low.states, unrounded.states.astype(np.float64)) < (5e-2 if state_dtype == "bfloat16" else 5e-3)
    by_extend.keep_snapshots(3)
    ext = extend(by_extend, q, k, v, g, beta)
    assert np.array_equal(ext, np.stack(outs, 1)) and np.array_equal(by_extend.states, low.states)
    for b in range(B):
        by_extend.rollback(b, T - 1)
    assert np.array_equal(by_extend.states, before_last) and list(by_extend.positions) == [T - 1] * B


@pytest.mark.parametrize("kernel", ["gdn", "gla"])
def test_low_state_save_load_pickle_copy_and_the_storage_check(kernel):
    rng = np.random.default_rng(22)
    B, H, Hk, K, V = 2, 4, 2, 4, 3
    q, k, v, g, beta = tokens(rng, kernel, B, 6, H, Hk, K, V, np.float32)
    dec = decoder(kernel, B, H, Hk, K, V, np.float32, state_dtype="bfloat16")
    for t in range(3):
        step(dec, q[:, t], k[:, t], v[:, t], at(g, t), at(beta, t))
    blob = dec.save()
    loaded = decoder(kernel, 1, H, Hk, K, V, np.float32, state_dtype="bfloat16")
    loaded.load(blob)
    copies = [loaded, pickle.loads(pickle.dumps(dec)), dec.copy(), copy.deepcopy(dec)]
    assert all(c.state_dtype == "bfloat16" and c.batch_size == B for c in copies)
    assert repr(copies[1]) == repr(dec) and "state_dtype='bfloat16'" in repr(dec)
    assert all(np.array_equal(c.states, dec.states) for c in copies)
    for t in range(3, 6):
        want = step(dec, q[:, t], k[:, t], v[:, t], at(g, t), at(beta, t))
        for c in copies:
            assert np.array_equal(step(c, q[:, t], k[:, t], v[:, t], at(g, t), at(beta, t)), want)
    assert all(c.save() == dec.save() for c in copies)
    # Recorded in float32 (S widened), the storage in the file: a float32 or float16 decoder
    # refuses it, and a bf16 one a float32 file, each unchanged.
    f32 = decoder(kernel, 1, H, Hk, K, V, np.float32)
    half = decoder(kernel, 1, H, Hk, K, V, np.float32, state_dtype=np.float16)
    for other, name in ((f32, "float32"), (half, "float16")):
        with pytest.raises(RuntimeError, match=r"Decoder.load: storage type mismatch: .*bf16.*\(state_dtype " + name):
            other.load(blob)
        assert other.batch_size == 1 and not other.positions.any()
    f32.resize(B)
    f32.set_states(dec.states, positions=dec.positions)
    assert len(f32.save()) == len(blob)
    with pytest.raises(RuntimeError, match="storage type mismatch"):
        loaded.load(f32.save())
    assert loaded.save() == dec.save()


def test_low_state_from_final_state_and_options():
    rng = np.random.default_rng(23)
    B, H, K, V = 2, 2, 4, 3
    ht = rng.uniform(-1, 1, (B, H, K, V))
    dec = linattn.DeltaRuleDecoder.from_final_state(ht.astype(np.float16), positions=4)
    assert dec.state_dtype == "float16" and dec.dtype == np.float32 and list(dec.positions) == [4, 4]
    assert np.array_equal(dec.states, ht.astype(np.float16).astype(np.float32))
    # A float state set into a low one is rounded once (ties to even), as the C++ set_state.
    dec = linattn.GatedDecoder.from_final_state(ht.astype(np.float32), state_dtype="bfloat16")
    assert np.array_equal(dec.states, round_to("bfloat16", ht.astype(np.float32)))
    dec.states = ht.astype(np.float32)
    assert np.array_equal(dec.states, round_to("bfloat16", ht.astype(np.float32)))
    with pytest.raises(TypeError, match="GatedDecoder: state_dtype must be the token dtype .*float64.*bfloat16"):
        linattn.GatedDecoder(1, 2, 3, dtype=np.float64, state_dtype="bfloat16")
    with pytest.raises(TypeError, match="DeltaRuleDecoder: state_dtype must be .*got state_dtype=int8"):
        linattn.DeltaRuleDecoder(1, 2, 3, state_dtype=np.int8)
    assert linattn.DeltaRuleDecoder(1, 2, 3, dtype=np.float64, state_dtype=np.float64).state_dtype == "float64"


def test_low_state_torch_dtypes():
    if os.environ.get("LINATTN_REQUIRE_TORCH") == "1":
        import torch
    else:
        torch = pytest.importorskip("torch")
    rng = np.random.default_rng(24)
    ht = torch.from_numpy(rng.uniform(-1, 1, (2, 2, 4, 3))).to(torch.bfloat16)
    dec = linattn.DeltaRuleDecoder.from_final_state(ht, use_qk_l2norm_in_kernel=True, positions=3)
    assert dec.state_dtype == "bfloat16" and dec.dtype == np.float32
    assert torch.equal(torch.from_numpy(dec.states).to(torch.bfloat16), ht)  # widened exactly
    assert torch.equal(torch.from_numpy(dec.states), ht.float())
    gated = linattn.GatedDecoder(2, 2, 4, 3, state_dtype=torch.float16)
    assert gated.state_dtype == "float16"
    gated.set_states(ht)  # a bf16 tensor: widened, then rounded to half
    assert np.array_equal(gated.states, ht.float().numpy().astype(np.float16).astype(np.float32))
