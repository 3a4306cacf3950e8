"""linattn's decoders of the gated kernels and of the delta rule: ``GatedDecoder`` (RetNet,
Mamba-2, simple GLA, GLA; the C++ BatchedRecurrentGatedAttention) and ``DeltaRuleDecoder``
(DeltaNet, Gated DeltaNet, KDA; the C++ BatchedRecurrentDeltaRule), B sequences of H heads
decoded one token at a time, in flash-linear-attention's per-token layout and state layout."""

from __future__ import annotations

import re

import numpy as np

from . import _linattn as _ext
from . import _FLOATS, _Shapes, _arrays, _check_beta, _check_log_gates, _kernel, _offsets_of
from ._fla import FLA_L2NORM_EPS


class _Named:
    """A constructor's arguments as an error message names them (``_kernel``'s shapes)."""

    def __init__(self, **named):
        self.named = named

    def __str__(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in self.named.items())


# What a decoder may keep S in besides its token dtype: bf16 / half, for float32 tokens.
_LOW_STATES = ("bfloat16", "float16")


def _dtype_name(x) -> str:
    """A dtype's name, 'bfloat16' for torch.bfloat16 (numpy has none) and np.float16 alike."""
    if isinstance(x, str):
        return x[len("torch."):] if x.startswith("torch.") else x
    if type(x).__module__.startswith("torch"):
        return str(x)[len("torch."):]
    return np.dtype(x).name


def _float_array(x) -> np.ndarray:
    """x as a numpy array; a torch bfloat16 tensor (numpy has no bfloat16) widened to float32,
    exactly."""
    if type(x).__module__.startswith("torch") and str(getattr(x, "dtype", "")) == "torch.bfloat16":
        return x.detach().cpu().float().numpy()
    return np.asarray(x)


def _call(fn: str, f, *args):
    """f(*args) (a member of the C++ decoder that takes no tokens), its ValueError raised again
    under the Python method's name."""
    try:
        return f(*args)
    except ValueError as e:
        m = re.match(r"(linattn::)?[\w:.]+: ", str(e))
        raise ValueError(f"{fn}: {str(e)[m.end():] if m else e}") from None


class _KernelDecoder:
    """What GatedDecoder and DeltaRuleDecoder share: sequences, states, steps, extend,
    snapshots, save/load. Subclasses set ``_name`` and ``_options``."""

    _name = ""

    def _build(self, new, batch_size, num_heads, key_dim, value_dim, num_key_heads, dtype, state_dtype, *args):
        fn = self._name
        dtype = np.dtype(dtype)
        if dtype not in _FLOATS:
            raise TypeError(f"{fn}: dtype must be float32 or float64, got {dtype}")
        state = dtype.name if state_dtype is None else _dtype_name(state_dtype)
        if state != dtype.name and (state not in _LOW_STATES or dtype != np.float32):
            raise TypeError(f"{fn}: state_dtype must be the token dtype ({dtype.name}), or bfloat16 / float16 "
                            f"with float32 tokens, got state_dtype={state} with dtype={dtype.name}")
        V = key_dim if value_dim is None else value_dim
        Hk = 0 if num_key_heads is None else int(num_key_heads)
        named = _Named(batch_size=batch_size, num_heads=num_heads, key_dim=key_dim, value_dim=V,
                       num_key_heads=num_key_heads)
        if int(batch_size) < 0 or int(num_heads) <= 0 or int(key_dim) <= 0 or int(V) <= 0 or Hk < 0:
            raise ValueError(f"{fn}: batch_size must be >= 0 and num_heads, key_dim, value_dim (and num_key_heads) "
                             f"> 0, got {named}")
        if Hk and int(num_heads) % Hk != 0:
            raise ValueError(f"{fn}: num_key_heads must divide num_heads (value head h reads key head "
                             f"h // (num_heads // num_key_heads)), got {named}")
        f = new[0] if dtype == np.float32 else new[1]
        low = (state,) if state in _LOW_STATES else ()
        if low:
            f = new[2]
        self._d = _kernel(fn, named, f, int(batch_size), int(num_heads), int(key_dim), int(V), Hk, *args, *low)
        self.dtype = dtype

    @property
    def state_dtype(self) -> str:
        """What S is kept in between tokens, by name: the token dtype's ('float32', 'float64'),
        or 'bfloat16' / 'float16' (float32 tokens; each token computed in float32 from the kept
        state, its new state rounded once, as the C++ decoder with that StateScalar)."""
        return self._d.state_dtype

    # --- shapes -------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """B, the number of sequences."""
        return self._d.sequences

    @property
    def num_heads(self) -> int:
        """H, the value heads of every sequence (and of v, g, beta)."""
        return self._d.heads

    @property
    def num_key_heads(self) -> int:
        """H_k, the query/key heads (H without shared key heads)."""
        return self._d.key_heads

    @property
    def key_dim(self) -> int:
        """K, one head's query and key width (the rows of its state)."""
        return self._d.key_dim

    @property
    def value_dim(self) -> int:
        """V, one head's value width (the columns of its state)."""
        return self._d.value_dim

    @property
    def feature_map(self) -> str:
        return self._d.feature_map

    @property
    def positions(self) -> np.ndarray:
        """Tokens consumed by each sequence (int64, B entries)."""
        return np.asarray(self._d.positions(), dtype=np.int64)

    # --- states -------------------------------------------------------------------------------

    @property
    def states(self) -> np.ndarray:
        """The states S, ``[B, H, K, V]`` (FLA's layout: ``states[b, h]`` is head h's K x V
        matrix, what ``output_final_state=True`` returns and ``initial_state`` takes), a copy,
        in the token dtype: a bfloat16 / float16 state widened to float32, exactly (numpy has no
        bfloat16; ``torch.from_numpy(dec.states).to(torch.bfloat16)`` loses nothing).
        Assigning an array sets every sequence's state (``set_states``, positions 0)."""
        S, _ = self._d.states()
        return S

    @states.setter
    def states(self, value) -> None:
        self.set_states(value)

    def _set_states(self, S, positions, z):
        fn = f"{self._name}.set_states"
        a = _float_array(S)
        if not np.issubdtype(a.dtype, np.floating):
            raise TypeError(f"{fn}: the states must be a float array, got {a.dtype}")
        B, H, K, V = self.batch_size, self.num_heads, self.key_dim, self.value_dim
        if a.shape != (B, H, K, V):
            raise ValueError(f"{fn}: the states must have shape {(B, H, K, V)} ([B, H, K, V], FLA's final_state), "
                             f"got {a.shape}")
        zs = None
        if z is not None:
            zs = _float_array(z)
            if not np.issubdtype(zs.dtype, np.floating) or zs.shape != (B, H, K):
                raise ValueError(f"{fn}: z must be a float array of shape {(B, H, K)}, got {zs.dtype} {zs.shape}")
            zs = np.ascontiguousarray(zs, dtype=self.dtype)
        p = np.broadcast_to(np.asarray(0 if positions is None else positions), (B,))
        if not np.issubdtype(p.dtype, np.integer) or (p < 0).any():
            raise ValueError(f"{fn}: positions must be integers >= 0 (one, or one per sequence), got {positions!r}")
        _call(fn, self._d.set_states, np.ascontiguousarray(a, dtype=self.dtype), zs, [int(x) for x in p])

    # --- tokens -------------------------------------------------------------------------------

    def _pack(self, fn, q, k, v, g, beta, lead_ndim):
        """q, k, v, g, beta checked against the decoder and one another, as the packed rows the
        C++ decoder takes (g None: no decay; beta None: 1 for the delta rule); their shapes."""
        q, k, v = _arrays(fn, q=q, k=k, v=v)
        shapes = _Shapes("qkv", (q, k, v)).with_(g=g, beta=beta)
        if q.dtype != self.dtype:
            raise TypeError(f"{fn}: the decoder holds {self.dtype}, the tokens are {q.dtype}")
        H, Hk, K, V = self.num_heads, self.num_key_heads, self.key_dim, self.value_dim
        lead = q.shape[:lead_ndim]
        if q.ndim != lead_ndim + 2 or q.shape != lead + (Hk, K) or k.shape != q.shape or v.shape != lead + (H, V):
            raise ValueError(f"{fn}: the decoder has H = {H} value heads over H_k = {Hk} key heads of K = {K}, "
                             f"V = {V}: q and k must be {lead + (Hk, K)} and v {lead + (H, V)}, got {shapes}")
        rows = int(np.prod(lead, dtype=np.int64))

        def flat(a):  # rows x the rest, also for no rows (reshape(0, -1) is ambiguous)
            return np.ascontiguousarray(a).reshape(rows, int(np.prod(a.shape[lead_ndim:], dtype=np.int64)))

        packed = [flat(a) for a in (q, k, v)]
        G = None
        if g is not None:
            ga = np.asarray(g)
            if not np.issubdtype(ga.dtype, np.floating):
                raise TypeError(f"{fn}: g must be a float array, got {ga.dtype}")
            if ga.shape not in (lead + (H,), lead + (H, K)):
                raise ValueError(f"{fn}: g must be {lead + (H,)} (a log decay per head) or {lead + (H, K)} "
                                 f"(per key channel), got {shapes}")
            ga = ga.astype(self.dtype, copy=False)
            _check_log_gates(fn, ga, shapes)
            G = flat(ga)
        Bt = None
        if beta is not None:
            ba = np.asarray(beta)
            if not np.issubdtype(ba.dtype, np.floating):
                raise TypeError(f"{fn}: beta must be a float array, got {ba.dtype}")
            if ba.shape != lead + (H,):
                raise ValueError(f"{fn}: beta must be {lead + (H,)} (one per token and value head), got {shapes}")
            ba = ba.astype(self.dtype, copy=False)
            _check_beta(fn, ba, shapes)
            Bt = flat(ba)
        return packed, G, Bt, shapes, v.shape

    @staticmethod
    def _indices(fn, name, x):
        a = np.asarray(x)
        if a.ndim != 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
            raise TypeError(f"{fn}: {name} must be a 1-D integer array, got {a.dtype} of shape {a.shape}")
        return np.ascontiguousarray(a, dtype=np.int64)

    def _step(self, q, k, v, g, beta, slots):
        fn = f"{self._name}.step"
        lead = 2 if np.ndim(q) == 4 else 1
        if lead == 2 and np.shape(q)[1] != 1:
            raise ValueError(f"{fn}: q must be [R, H_k, K] (or [R, 1, H_k, K]: one token per row), got "
                             f"{np.shape(q)}")
        (Q, K, V), G, Bt, shapes, out_shape = self._pack(fn, q, k, v, g, beta, lead)
        idx = None
        if slots is None:
            if Q.shape[0] != self.batch_size:
                raise ValueError(f"{fn}: without slots, q, k, v have one row per sequence of the decoder "
                                 f"(B = {self.batch_size}), got {shapes}")
        else:
            idx = self._indices(fn, "slots", slots)
            if idx.shape[0] != Q.shape[0]:
                raise ValueError(f"{fn}: slots must have one entry per row of q (R = {Q.shape[0]}), got "
                                 f"{idx.shape[0]} (with {shapes})")
        out = _kernel(fn, shapes, self._d.step, Q, K, V, G, Bt, idx)
        return out.reshape(out_shape)

    def _extend(self, q, k, v, g, beta, cu_seqlens, slots):
        fn = f"{self._name}.extend"
        nd = np.ndim(q)
        if nd not in (3, 4):
            raise ValueError(f"{fn}: q must be [B, T, H_k, K] (B sequences of T tokens), [1, T, H_k, K] or "
                             f"[T, H_k, K] (packed rows, with cu_seqlens), got {np.shape(q)}")
        (Q, K, V), G, Bt, shapes, out_shape = self._pack(fn, q, k, v, g, beta, nd - 2)
        if cu_seqlens is not None:
            if nd == 4 and np.shape(q)[0] != 1:
                raise ValueError(f"{fn}: with cu_seqlens, B must be 1 (the T rows are the packed sequences), "
                                 f"got {shapes}")
            offsets = _offsets_of(fn, cu_seqlens, Q.shape[0], shapes)
        elif nd == 4:
            offsets = np.arange(np.shape(q)[0] + 1, dtype=np.int64) * np.shape(q)[1]
        else:
            offsets = np.array([0, Q.shape[0]], dtype=np.int64)
        n = offsets.shape[0] - 1
        idx = np.arange(n, dtype=np.int64) if slots is None else self._indices(fn, "slots", slots)
        if idx.shape[0] != n:
            raise ValueError(f"{fn}: slots must have one entry per sequence of the call ({n}), got {idx.shape[0]} "
                             f"(with {shapes})")
        out = _kernel(fn, shapes, self._d.extend, idx, offsets, Q, K, V, G, Bt)
        return out.reshape(out_shape)

    # --- snapshots ----------------------------------------------------------------------------

    def keep_snapshots(self, count: int) -> None:
        """From now on, keep the states after each sequence's last ``count`` tokens of every
        ``extend`` (the rollback points of speculative decoding); 0 keeps none."""
        fn = f"{self._name}.keep_snapshots"
        _call(fn, self._d.keep_snapshots, int(count))

    @property
    def kept_snapshots(self) -> int:
        """K of the last ``keep_snapshots(K)`` (0: none)."""
        return self._d.kept_snapshots

    def snapshots(self, b: int) -> int:
        """The rollback points sequence b's last ``extend`` kept: its last tokens' states,
        min(K, its tokens), 0 after a ``step``, ``reset`` or state change."""
        fn = f"{self._name}.snapshots"
        return _call(fn, self._d.snapshots, int(b))

    def rollback(self, b: int, tokens: int) -> None:
        """Sets sequence b back to its state after the first ``tokens`` tokens of its last
        ``extend`` (the accepted prefix of a draft), exactly: the state, its bits and
        ``positions[b]``. ``tokens`` runs from T − snapshots(b) + 1 to T (T: that call's tokens;
        T undoes nothing); another raises ValueError and changes nothing."""
        fn = f"{self._name}.rollback"
        _call(fn, self._d.rollback, int(b), int(tokens))

    # --- sequences ----------------------------------------------------------------------------

    def reset(self, b: int | None = None) -> None:
        """Every sequence (or sequence b) back to no tokens."""
        fn = f"{self._name}.reset"
        _call(fn, self._d.reset, None if b is None else int(b))

    def add_sequence(self) -> int:
        """Appends an empty sequence; returns its number."""
        return self._d.add_sequence()

    def remove_sequence(self, b: int) -> None:
        """Removes sequence b; the last sequence takes its number."""
        fn = f"{self._name}.remove_sequence"
        _call(fn, self._d.remove_sequence, int(b))

    def resize(self, batch_size: int) -> None:
        """batch_size sequences: the first keep their states, new ones are empty."""
        fn = f"{self._name}.resize"
        _call(fn, self._d.resize, int(batch_size))

    # --- save, load, copy ---------------------------------------------------------------------

    def save(self) -> bytes:
        """The exact decoding position of every sequence and head: the B·H records the C++
        ``save_state`` writes (docs/serving.md), each checksummed. The snapshots of
        ``keep_snapshots`` are not saved."""
        return self._d.save()

    def load(self, data: bytes) -> None:
        """Restores what ``save()`` wrote, from a decoder of the same heads, K, V, dtype and
        state_dtype (built with the same options: they are not in the file; a bfloat16 / float16
        state is recorded in float32 with its storage type, and only a decoder of that
        state_dtype takes it); the number of sequences becomes the file's and stepping on gives
        the bits the saved decoder gives. Raises RuntimeError naming the problem (truncated,
        corrupted, another shape, "storage type mismatch") and leaves the decoder unchanged
        then."""
        try:
            self._d.load(bytes(data))
        except RuntimeError as e:
            m = re.match(r"(linattn::)?[\w:.]+: ", str(e))
            body = str(e)[m.end():] if m else str(e)
            raise RuntimeError(f"{self._name}.load: {body} (state_dtype {self.state_dtype})") from None

    def copy(self):
        """An independent copy (states, positions, options and snapshots)."""
        c = type(self).__new__(type(self))
        c.__dict__.update(self.__dict__)
        c._d = self._d.clone()
        return c

    __copy__ = copy

    def __deepcopy__(self, memo):
        return self.copy()

    def __reduce__(self):
        return (_restore, (type(self), self._options(), self.kept_snapshots, self.save()))

    def __repr__(self) -> str:
        opts = ", ".join(f"{n}={v!r}" for n, v in self._options().items())
        return f"linattn.{self._name}(batch_size={self.batch_size}, {opts})"


class GatedDecoder(_KernelDecoder):
    """B sequences of H gated heads decoded together (RetNet, Mamba-2, simple GLA, GLA): per
    token, S_t = diag(exp(g_t)) S_{t−1} + k_t v_tᵀ and o_t = scale·S_tᵀ q_t (with
    ``normalize=True``, o_t = S_tᵀ φ(q_t) / φ(q_t)ᵀ z_t instead). The C++ library's
    BatchedRecurrentGatedAttention: each head computes what a single-head C++ decoder with the
    same history computes, bit for bit, for any thread count.

    Per-token layout (FLA's, one row per sequence): q, k ``[B, H_k, K]``, v ``[B, H, V]``, g
    ``[B, H]`` (a log decay per head: simple GLA) or ``[B, H, K]`` (per key channel: GLA), all
    log decays finite and <= 0; the output is ``[B, H, V]``. H_k = num_key_heads < H shares key
    heads (value head h reads key head h // (H // H_k)). States ``[B, H, K, V]`` are what
    ``chunk_gla`` / ``chunk_simple_gla`` take and return (``initial_state``,
    ``output_final_state=True``).

    >>> o, ht = linattn.chunk_simple_gla(q, k, v, g, output_final_state=True)     # prefill
    >>> dec = linattn.GatedDecoder.from_final_state(ht, positions=q.shape[1])
    >>> y = dec.step(q_t, k_t, v_t, g_t)        # [B, H_k, K], [B, H, V], [B, H] -> [B, H, V]
    >>> blob = dec.save()
    """

    _name = "GatedDecoder"

    def __init__(self, batch_size: int, num_heads: int, key_dim: int, value_dim: int | None = None,
                 num_key_heads: int | None = None, scale: float | None = None, normalize: bool = False,
                 feature_map: str = "identity", dtype=np.float32, state_dtype=None):
        """batch_size sequences of num_heads value heads over num_key_heads query/key heads
        (None: as many) of key_dim K, values of value_dim V (None: K). scale: None is FLA's
        1/sqrt(K). feature_map: identity (FLA's) or elu, applied to q and k. state_dtype: what
        S is kept in between tokens (None: dtype; torch.bfloat16 / torch.float16, 'bfloat16' /
        'float16' or np.float16 with float32 tokens: half the bytes, rounded once per token)."""
        self._scale = float(1.0 / np.sqrt(key_dim)) if scale is None else float(scale)
        self._normalize = bool(normalize)
        self._build((_ext.new_gated_decoder_f32, _ext.new_gated_decoder_f64, _ext.new_gated_decoder_low), batch_size,
                    num_heads, key_dim, value_dim, num_key_heads, dtype, state_dtype, str(feature_map), self._scale,
                    self._normalize)

    @classmethod
    def from_final_state(cls, final_state, num_key_heads: int | None = None, positions=None, **options):
        """A decoder continuing a prefill's ``final_state`` ``[B, H, K, V]`` (of ``chunk_gla``,
        ``chunk_simple_gla`` and their ``fused_recurrent_`` forms), in its dtype (float32
        unless float64; a bfloat16 / float16 state, a torch tensor or numpy float16, is kept so,
        with float32 tokens); positions: the tokens each sequence consumed (one, or B). options:
        those of the constructor (scale, normalize, feature_map, dtype, state_dtype)."""
        return _from_final_state(cls, final_state, num_key_heads, positions, options)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def normalize(self) -> bool:
        return self._normalize

    @property
    def z(self) -> np.ndarray:
        """The normalisers Σ exp(…) φ(k), ``[B, H, K]`` (a copy; used with normalize=True)."""
        _, z = self._d.states()
        return z

    def set_states(self, states, positions=None, z=None) -> None:
        """Every sequence continues from ``states`` ``[B, H, K, V]`` (a prefill's final_state, in
        any float dtype; cast to the decoder's), with normalisers z ``[B, H, K]`` (None: zero,
        what an unnormalised decoder needs) after ``positions`` tokens (an int or one per
        sequence; None: 0). All are checked before any changes."""
        self._set_states(states, positions, z)

    def step(self, q, k, v, g, slots=None) -> np.ndarray:
        """One token of every sequence (or of the sequences ``slots``, row r belonging to
        sequence slots[r]): q, k ``[R, H_k, K]``, v ``[R, H, V]``, g ``[R, H]`` or ``[R, H, K]``
        (FLA's ``[R, 1, …]`` forms too); returns ``[R, H, V]`` (or ``[R, 1, H, V]``)."""
        return self._step(q, k, v, g, None, slots)

    def extend(self, q, k, v, g, cu_seqlens=None, slots=None) -> np.ndarray:
        """Several tokens of several sequences, exactly as that many ``step`` calls: q, k
        ``[B, T, H_k, K]``, v ``[B, T, H, V]``, g ``[B, T, H]`` or ``[B, T, H, K]`` (sequence
        slots[b], default b, takes the T tokens of row b), or packed rows ``[1, T, …]`` /
        ``[T, …]`` with ``cu_seqlens`` (sequence slots[i] takes rows cu_seqlens[i] …
        cu_seqlens[i+1]; ``[T, …]`` without: one sequence). Returns v's shape. With
        ``keep_snapshots(K)``, the states after each sequence's last K tokens are kept for
        ``rollback``."""
        return self._extend(q, k, v, g, None, cu_seqlens, slots)

    def _options(self) -> dict:
        return dict(num_heads=self.num_heads, key_dim=self.key_dim, value_dim=self.value_dim,
                    num_key_heads=self.num_key_heads, scale=self._scale, normalize=self._normalize,
                    feature_map=self.feature_map, dtype=self.dtype.name, state_dtype=self.state_dtype)


class DeltaRuleDecoder(_KernelDecoder):
    """B sequences of H delta-rule heads decoded together (DeltaNet, Gated DeltaNet, KDA): per
    token, S' = diag(exp(g_t)) S_{t−1}, S_t = S' + k_t (β_t (v_t − S'ᵀ k_t))ᵀ and
    o_t = scale·S_tᵀ q_t, with q and k mapped by FLA's l2norm first when
    ``use_qk_l2norm_in_kernel=True``. The C++ library's BatchedRecurrentDeltaRule: each head
    computes what a single-head C++ decoder with the same history computes, bit for bit, for
    any thread count.

    Per-token layout (FLA's, one row per sequence): q, k ``[B, H_k, K]``, v ``[B, H, V]``, beta
    ``[B, H]`` in [0, 2] (None: 1), g None (DeltaNet), ``[B, H]`` (Gated DeltaNet, Qwen3-Next)
    or ``[B, H, K]`` (KDA, per key channel), log decays finite and <= 0; the output is
    ``[B, H, V]``. H_k = num_key_heads < H shares key heads (Qwen3-Next's 16 for 32). States
    ``[B, H, K, V]`` are what ``chunk_gated_delta_rule``, ``chunk_kda``, ``chunk_delta_rule``
    and their ``fused_recurrent_`` forms take and return.

    >>> o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
    ...                                        output_final_state=True)          # prefill
    >>> dec = linattn.DeltaRuleDecoder.from_final_state(ht, use_qk_l2norm_in_kernel=True)
    >>> y = dec.step(q_t, k_t, v_t, g_t, beta_t)   # [B, H_k, K], [B, H, V], [B, H] -> [B, H, V]
    """

    _name = "DeltaRuleDecoder"

    def __init__(self, batch_size: int, num_heads: int, key_dim: int, value_dim: int | None = None,
                 num_key_heads: int | None = None, scale: float | None = None,
                 use_qk_l2norm_in_kernel: bool = False, feature_map: str | None = None,
                 l2norm_eps: float = FLA_L2NORM_EPS, dtype=np.float32, state_dtype=None):
        """batch_size sequences of num_heads value heads over num_key_heads query/key heads
        (None: as many) of key_dim K, values of value_dim V (None: K). scale: None is FLA's
        1/sqrt(K). use_qk_l2norm_in_kernel: q and k mapped by x / sqrt(|x|² + l2norm_eps), FLA's
        (feature_map 'l2norm'); feature_map: identity, l2norm or l2norm_silu (None: by
        use_qk_l2norm_in_kernel). state_dtype: what S is kept in between tokens (None: dtype;
        torch.bfloat16 / torch.float16, 'bfloat16' / 'float16' or np.float16 with float32
        tokens: half the bytes, rounded once per token)."""
        fn = self._name
        if feature_map is None:
            feature_map = "l2norm" if use_qk_l2norm_in_kernel else "identity"
        elif use_qk_l2norm_in_kernel and feature_map == "identity":
            raise ValueError(f"{fn}: use_qk_l2norm_in_kernel=True contradicts feature_map='identity'")
        eps = 0.0 if feature_map == "identity" else float(l2norm_eps)
        self._scale = float(1.0 / np.sqrt(key_dim)) if scale is None else float(scale)
        self._eps = eps
        self._build((_ext.new_delta_decoder_f32, _ext.new_delta_decoder_f64, _ext.new_delta_decoder_low), batch_size,
                    num_heads, key_dim, value_dim, num_key_heads, dtype, state_dtype, str(feature_map), self._scale,
                    eps)

    @classmethod
    def from_final_state(cls, final_state, num_key_heads: int | None = None, positions=None, **options):
        """A decoder continuing a prefill's ``final_state`` ``[B, H, K, V]`` (of
        ``chunk_gated_delta_rule``, ``chunk_kda``, ``chunk_delta_rule`` and their
        ``fused_recurrent_`` forms), in its dtype (float32 unless float64; a bfloat16 / float16
        state, a torch tensor or numpy float16, is kept so, with float32 tokens); positions: the
        tokens each sequence consumed (one, or B). options: those of the constructor (scale,
        use_qk_l2norm_in_kernel, feature_map, l2norm_eps, dtype, state_dtype) — the prefill's."""
        return _from_final_state(cls, final_state, num_key_heads, positions, options)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def l2norm_eps(self) -> float:
        return self._eps

    def set_states(self, states, positions=None) -> None:
        """Every sequence continues from ``states`` ``[B, H, K, V]`` (a prefill's final_state, in
        any float dtype; cast to the decoder's) after ``positions`` tokens (an int or one per
        sequence; None: 0). All are checked before any changes."""
        self._set_states(states, positions, None)

    def step(self, q, k, v, g=None, beta=None, slots=None) -> np.ndarray:
        """One token of every sequence (or of the sequences ``slots``, row r belonging to
        sequence slots[r]): q, k ``[R, H_k, K]``, v ``[R, H, V]``, g None, ``[R, H]`` or
        ``[R, H, K]``, beta ``[R, H]`` (None: 1) (FLA's ``[R, 1, …]`` forms too); returns
        ``[R, H, V]`` (or ``[R, 1, H, V]``)."""
        return self._step(q, k, v, g, self._beta(v, beta), slots)

    def extend(self, q, k, v, g=None, beta=None, cu_seqlens=None, slots=None) -> np.ndarray:
        """Several tokens of several sequences, exactly as that many ``step`` calls: q, k
        ``[B, T, H_k, K]``, v ``[B, T, H, V]``, g None, ``[B, T, H]`` or ``[B, T, H, K]``, beta
        ``[B, T, H]`` (None: 1) (sequence slots[b], default b, takes the T tokens of row b), or
        packed rows ``[1, T, …]`` / ``[T, …]`` with ``cu_seqlens`` (sequence slots[i] takes rows
        cu_seqlens[i] … cu_seqlens[i+1]; ``[T, …]`` without: one sequence). Returns v's shape.
        With ``keep_snapshots(K)``, the states after each sequence's last K tokens are kept for
        ``rollback`` (speculative decoding: verify 1 + T draft tokens, roll back to the
        accepted ones)."""
        return self._extend(q, k, v, g, self._beta(v, beta), cu_seqlens, slots)

    def _beta(self, v, beta):
        if beta is not None:
            return beta
        return np.ones(np.shape(v)[:-1], self.dtype)

    def _options(self) -> dict:
        fmap = self.feature_map
        return dict(num_heads=self.num_heads, key_dim=self.key_dim, value_dim=self.value_dim,
                    num_key_heads=self.num_key_heads, scale=self._scale, feature_map=fmap,
                    l2norm_eps=self._eps if fmap != "identity" else FLA_L2NORM_EPS, dtype=self.dtype.name,
                    state_dtype=self.state_dtype)


def _from_final_state(cls, final_state, num_key_heads, positions, options):
    fn = f"{cls._name}.from_final_state"
    stored = _dtype_name(getattr(final_state, "dtype", np.float64))
    s = _float_array(final_state)
    if s.ndim != 4 or not np.issubdtype(s.dtype, np.floating):
        raise ValueError(f"{fn}: final_state must be a float array [B, H, K, V] (FLA's layout), got "
                         f"{s.dtype} of shape {s.shape}")
    options.setdefault("dtype", s.dtype if s.dtype in _FLOATS else np.float32)
    if stored in _LOW_STATES:
        options.setdefault("state_dtype", stored)
    B, H, K, V = s.shape
    dec = cls(B, H, K, V, num_key_heads=num_key_heads, **options)
    dec.set_states(s, positions)
    return dec


def _restore(cls, options, kept, data):
    dec = cls(0, **options)
    if kept:
        dec.keep_snapshots(kept)
    dec.load(data)
    return dec
