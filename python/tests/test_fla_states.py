"""flash-linear-attention's names with their states (initial_state, output_final_state), shared
key heads (GVA) and KDA, against FLA's recurrences written out token by token in float64."""

import numpy as np
import pytest

import linattn

TOL = {np.float64: 1e-12, np.float32: 3e-5}


def l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def sequences(B, T, cu):
    """(batch row, first token, end) of each sequence."""
    if cu is None:
        return [(b, 0, T) for b in range(B)]
    return [(0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]


def reference(q, k, v, scale, h0=None, beta=None, g=None, gk=None, delta=False, qk_l2norm=False, cu=None):
    """FLA's forms per token: S ← exp(g_t) S (per head) and diag(exp(gk_t)) S (per key channel),
    then S += k_t v_tᵀ (GLA), or S += k_t (β_t (v_t − Sᵀ k_t))ᵀ (the delta rule); o_t = scale·Sᵀ q_t.
    q, k [B, T, Hk, K], v [B, T, H, V] (head h reads key head h // (H // Hk)). Returns (o, ht)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, Hk, K = q.shape
    H, V = v.shape[2:]
    seqs = sequences(B, T, cu)
    o = np.zeros((B, T, H, V))
    ht = np.zeros((len(seqs), H, K, V))
    for n, (b, s, e) in enumerate(seqs):
        for h in range(H):
            c = h // (H // Hk)
            S = np.zeros((K, V)) if h0 is None else np.array(h0[n, h], np.float64)
            for t in range(s, e):
                qt, kt = q[b, t, c], k[b, t, c]
                if qk_l2norm:
                    qt, kt = l2norm(qt), l2norm(kt)
                if g is not None:
                    S = np.exp(float(g[b, t, h])) * S
                if gk is not None:
                    S = np.exp(np.asarray(gk[b, t, h], np.float64))[:, None] * S
                if delta:
                    S = S + np.outer(kt, float(beta[b, t, h]) * (v[b, t, h] - kt @ S))
                else:
                    S = S + np.outer(kt, v[b, t, h])
                o[b, t, h] = scale * (qt @ S)
            ht[n, h] = S
    return o, ht


KINDS = ("gla", "simple_gla", "delta_rule", "gated_delta_rule", "kda")


def inputs(rng, kind, dtype, B=2, T=21, Hk=1, H=2, K=4, V=3):
    q = rng.uniform(-1, 1, (B, T, Hk, K))
    k = l2norm(rng.uniform(-1, 1, (B, T, Hk, K)))  # unit keys keep the delta rule's state bounded
    v = rng.uniform(-1, 1, (B, T, H, V))
    beta = rng.uniform(0, 1, (B, T, H))
    g = {"gla": -rng.uniform(0, 0.5, (B, T, H, K)), "simple_gla": -rng.uniform(0, 0.5, (B, T, H)),
         "gated_delta_rule": -rng.uniform(0, 0.3, (B, T, H)), "kda": -rng.uniform(0, 0.5, (B, T, H, K))}.get(kind)
    cast = lambda a: None if a is None else a.astype(dtype)
    return cast(q), cast(k), cast(v), cast(beta), cast(g)


def call(kind, q, k, v, beta, g, **kw):
    """The FLA name of `kind`, positional as FLA's callers pass them."""
    if kind == "gla":
        return linattn.chunk_gla(q, k, v, g, **kw)
    if kind == "simple_gla":
        return linattn.chunk_simple_gla(q, k, v, g, **kw)
    if kind == "delta_rule":
        return linattn.chunk_delta_rule(q, k, v, beta, **kw)
    if kind == "gated_delta_rule":
        return linattn.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    return linattn.chunk_kda(q, k, v, g, beta, **kw)


def ref_of(kind, q, k, v, beta, g, h0, cu=None, qk_l2norm=False):
    scale = 1 / np.sqrt(q.shape[-1])
    per_head = kind in ("simple_gla", "gated_delta_rule")
    return reference(q, k, v, scale, h0, beta, g if per_head else None, g if kind in ("gla", "kda") else None,
                     delta=kind in ("delta_rule", "gated_delta_rule", "kda"), qk_l2norm=qk_l2norm, cu=cu)


def rel(a, b):
    return np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-300)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("layout", ["batch", "varlen"])
@pytest.mark.parametrize("heads", [(2, 2), (1, 2), (2, 4)])
@pytest.mark.parametrize("kind", KINDS)
def test_states_and_heads_match_the_recurrence(kind, heads, layout, dtype):
    rng = np.random.default_rng(100 + KINDS.index(kind))
    Hk, H = heads
    cu = None
    if layout == "batch":
        q, k, v, beta, g = inputs(rng, kind, dtype, Hk=Hk, H=H)
        N = 2
    else:
        q, k, v, beta, g = inputs(rng, kind, dtype, B=1, T=31, Hk=Hk, H=H)
        cu = np.array([0, 7, 7, 20, 31])  # an empty sequence passes its state through
        N = 4
    h0 = rng.uniform(-1, 1, (N, H, q.shape[-1], v.shape[-1])).astype(dtype)
    o, ht = call(kind, q, k, v, beta, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    want_o, want_ht = ref_of(kind, q, k, v, beta, g, h0, cu)
    assert o.dtype == dtype and ht.dtype == dtype and ht.shape == h0.shape
    assert rel(o, want_o) < TOL[dtype] and rel(ht, want_ht) < TOL[dtype]
    if layout == "varlen":
        assert np.array_equal(ht[1], h0[1])
    # Without output_final_state: (o, None), the same o.
    o2, none = call(kind, q, k, v, beta, g, initial_state=h0, cu_seqlens=cu)
    assert none is None and np.array_equal(o2, o)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_two_pieces_with_the_state_carried_are_one_call(kind, dtype):
    rng = np.random.default_rng(200 + KINDS.index(kind))
    q, k, v, beta, g = inputs(rng, kind, dtype, T=70, Hk=1, H=2)  # longer than a chunk
    h0 = rng.uniform(-1, 1, (2, 2, q.shape[-1], v.shape[-1])).astype(dtype)
    whole, h_end = call(kind, q, k, v, beta, g, initial_state=h0, output_final_state=True)
    cut = lambda a, s: None if a is None else np.ascontiguousarray(a[:, s])
    first, h_mid = call(kind, *(cut(a, slice(0, 33)) for a in (q, k, v, beta, g)), initial_state=h0,
                        output_final_state=True)
    second, h_two = call(kind, *(cut(a, slice(33, None)) for a in (q, k, v, beta, g)), initial_state=h_mid,
                         output_final_state=True)
    tol = {np.float64: 1e-13, np.float32: 2e-6}[dtype]
    assert rel(np.concatenate([first, second], axis=1), whole.astype(np.float64)) < tol
    assert rel(h_two, h_end.astype(np.float64)) < tol


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", ["gated_delta_rule", "kda", "gla"])
def test_two_pieces_of_packed_sequences(kind, dtype):
    rng = np.random.default_rng(300)
    lengths, cuts = [9, 30, 14], [4, 17, 14]  # the last sequence's second piece is empty
    q, k, v, beta, g = inputs(rng, kind, dtype, B=1, T=sum(lengths), Hk=2, H=2)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    h0 = rng.uniform(-1, 1, (3, 2, q.shape[-1], v.shape[-1])).astype(dtype)
    whole, h_end = call(kind, q, k, v, beta, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    rows1 = np.concatenate([np.arange(cu[n], cu[n] + cuts[n]) for n in range(3)])
    rows2 = np.concatenate([np.arange(cu[n] + cuts[n], cu[n + 1]) for n in range(3)])
    cu1 = np.concatenate([[0], np.cumsum(cuts)])
    cu2 = np.concatenate([[0], np.cumsum(np.array(lengths) - cuts)])
    take = lambda a, r: None if a is None else np.ascontiguousarray(a[:, r])
    first, h_mid = call(kind, *(take(a, rows1) for a in (q, k, v, beta, g)), initial_state=h0,
                        output_final_state=True, cu_seqlens=cu1)
    second, h_two = call(kind, *(take(a, rows2) for a in (q, k, v, beta, g)), initial_state=h_mid,
                         output_final_state=True, cu_seqlens=cu2)
    joined = np.empty_like(whole)
    joined[:, rows1], joined[:, rows2] = first, second
    tol = {np.float64: 1e-13, np.float32: 2e-6}[dtype]
    assert rel(joined, whole.astype(np.float64)) < tol and rel(h_two, h_end.astype(np.float64)) < tol


def test_recurrent_names_and_fla_options():
    rng = np.random.default_rng(400)
    q, k, v, beta, g = inputs(rng, "kda", np.float64, Hk=1, H=2)
    h0 = rng.uniform(-1, 1, (2, 2, 4, 3))
    gh = -rng.uniform(0, 0.3, beta.shape)
    # fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, beta, ...): a per-head and a
    # per-channel decay together are their sum.
    o, ht = linattn.fused_recurrent_gated_delta_rule(q, k, v, g=gh, gk=g, beta=beta, initial_state=h0,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_o, want_ht = reference(q, k, v, 0.5, h0, beta, gh, g, delta=True, qk_l2norm=True)
    assert rel(o, want_o) < 1e-12 and rel(ht, want_ht) < 1e-12
    # beta None: 1.
    o, _ = linattn.fused_recurrent_delta_rule(q, k, v, scale=0.3)
    assert rel(o, reference(q, k, v, 0.3, beta=np.ones(beta.shape), delta=True)[0]) < 1e-12
    # chunk_simple_gla's g_gamma: one log decay per head for every token.
    gamma = np.array([-0.1, -0.4])
    o, ht = linattn.chunk_simple_gla(q, k, v, g_gamma=gamma, initial_state=h0, output_final_state=True)
    want = reference(q, k, v, 0.5, h0, g=np.broadcast_to(gamma, beta.shape))
    assert rel(o, want[0]) < 1e-12 and rel(ht, want[1]) < 1e-12
    assert np.array_equal(linattn.fused_recurrent_simple_gla(q, k, v, g_gamma=gamma)[0],
                          linattn.chunk_simple_gla(q, k, v, g_gamma=gamma)[0])
    assert np.array_equal(linattn.fused_recurrent_gla(q, k, v, g)[0], linattn.chunk_gla(q, k, v, g)[0])
    # state_v_first: states [N, HV, V, K].
    a, ha = linattn.chunk_gated_delta_rule(q, k, v, gh, beta, initial_state=h0, output_final_state=True)
    b, hb = linattn.chunk_gated_delta_rule(q, k, v, gh, beta, initial_state=h0.swapaxes(-1, -2).copy(),
                                           output_final_state=True, state_v_first=True)
    assert np.array_equal(a, b) and np.array_equal(ha, hb.swapaxes(-1, -2))
    # use_beta_sigmoid_in_kernel: beta holds logits (× 2 with allow_neg_eigval).
    logits = rng.standard_normal(beta.shape)
    a, _ = linattn.chunk_gated_delta_rule(q, k, v, gh, logits, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    b, _ = linattn.chunk_gated_delta_rule(q, k, v, gh, 2 / (1 + np.exp(-logits)))
    assert rel(a, b) < 1e-14
    # Arguments of FLA's GPU kernels change nothing.
    a, _ = linattn.chunk_kda(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None, chunk_size=64,
                             disable_recompute=True)
    assert np.array_equal(a, linattn.chunk_kda(q, k, v, g, beta)[0])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("with_A_log", [True, False])
def test_kda_gate_in_kernel(lower_bound, with_A_log):
    if lower_bound is None and not with_A_log:
        return  # FLA needs A_log without a lower bound (an error, tested below)
    rng = np.random.default_rng(500)
    q, k, v, beta, _ = inputs(rng, "kda", np.float64, Hk=1, H=2)
    raw = rng.standard_normal(q.shape[:2] + (2, 4))
    A_log = rng.uniform(-1, 1, 2) if with_A_log else None
    dt_bias = rng.uniform(-1, 1, 2 * 4)
    x = raw + dt_bias.reshape(2, 4)
    rate = np.exp(A_log)[:, None] if with_A_log else 1.0
    if lower_bound is None:
        gk = -rate * np.log1p(np.exp(x))
    else:
        gk = lower_bound / (1 + np.exp(-rate * x))
    h0 = rng.uniform(-1, 1, (2, 2, 4, 3))
    o, ht = linattn.chunk_kda(q, k, v, raw, beta, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=lower_bound,
                              A_log=A_log, dt_bias=dt_bias)
    want_o, want_ht = reference(q, k, v, 0.5, h0, beta, gk=gk, delta=True, qk_l2norm=True)
    assert rel(o, want_o) < 1e-12 and rel(ht, want_ht) < 1e-12
    # fused_recurrent_kda takes A_log and dt_bias positionally, after beta.
    o2, ht2 = linattn.fused_recurrent_kda(q, k, v, raw, beta, A_log, dt_bias, None, h0, True, True, True,
                                          lower_bound=lower_bound)
    assert np.array_equal(o2, o) and np.array_equal(ht2, ht)


def test_errors_name_the_function_and_shapes():
    rng = np.random.default_rng(600)
    q, k, v, beta, g = inputs(rng, "gated_delta_rule", np.float64, Hk=1, H=2)
    with pytest.raises(ValueError, match=r"linattn.chunk_gated_delta_rule: initial_state must have shape "
                                         r"\(2, 2, 4, 3\) \(\[N, HV, K, V\], N = 2 sequences\), got \(1, 2, 4, 3\)"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=np.zeros((1, 2, 4, 3)))
    with pytest.raises(ValueError, match=r"chunk_gated_delta_rule: v's heads HV = 3 must be a positive multiple of "
                                         r"q's and k's H = 2"):
        linattn.chunk_gated_delta_rule(np.zeros((1, 5, 2, 4)), np.zeros((1, 5, 2, 4)), np.zeros((1, 5, 3, 3)),
                                       np.zeros((1, 5, 3)), np.zeros((1, 5, 3)))
    with pytest.raises(ValueError, match=r"with cu_seqlens, B must be 1"):
        linattn.chunk_delta_rule(q, k, v, beta, cu_seqlens=np.array([0, 3, 21]))
    with pytest.raises(ValueError, match=r"linattn.chunk_kda: g must be \[B, T, HV, K\]"):
        linattn.chunk_kda(q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"g must have shape \(2, 21, 2\)"):
        linattn.chunk_gated_delta_rule(q, k, v, g[:, :, :1], beta)
    with pytest.raises(ValueError, match=r"beta\[0, 0, 0\] = 3.0: beta must be in \[0, 2\]"):
        linattn.chunk_gated_delta_rule(q, k, v, g, np.full(beta.shape, 3.0))
    with pytest.raises(ValueError, match="use_gate_in_kernel=True needs A_log"):
        linattn.chunk_kda(q, k, v, np.zeros(q.shape[:2] + (2, 4)), beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"A_log must have HV = 2 entries"):
        linattn.fused_recurrent_kda(q, k, v, np.zeros(q.shape[:2] + (2, 4)), beta, np.zeros(3),
                                    use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match=r"linattn.fused_recurrent_gla: gv .* is not offered"):
        linattn.fused_recurrent_gla(q, k, v, gv=np.zeros(v.shape))
    with pytest.raises(ValueError, match=r"linattn.chunk_gla: head_first=True is not offered"):
        linattn.chunk_gla(q, k, v, np.zeros(v.shape[:3] + (4,)), head_first=True)
    with pytest.raises(ValueError, match="pass g or g_gamma, not both"):
        linattn.chunk_simple_gla(q, k, v, g, g_gamma=np.zeros(2))
    with pytest.raises(TypeError, match="must all be float32 or all float64"):
        linattn.chunk_delta_rule(q.astype(np.float32), k, v, beta)
