"""linattn's decoder: RecurrentState, B sequences of H heads decoded one token at a time (the
C++ BatchedRecurrentLinearAttention), with save/load through the C++ state file."""

from __future__ import annotations

import numpy as np

from . import _linattn as _ext
from . import _FLOATS, _Shapes, _arrays, _kernel


class RecurrentState:
    """The decoding state of B sequences of H heads: one token of every sequence per
    ``step``, O(H·F·M) memory per sequence whatever its length (the C++ library's
    BatchedRecurrentLinearAttention; each head computes exactly what a single-head decoder with
    the same history computes, bit for bit, for any thread count).

    Sequences are numbered 0 … B−1 and own row b of every step. ``add_sequence`` appends one,
    ``remove_sequence(b)`` gives number b to the last one; ``step(..., slots=[...])`` advances a
    subset. ``save()`` returns the exact decoding position as bytes (the C++ ``save_state``
    file, checksummed); ``load(data)`` restores it into a state of the same heads, dimensions,
    map and dtype, taking the file's number of sequences, and stepping on gives the bits an
    uninterrupted state gives. Pickling goes through the same bytes.

    Shared key heads (GVA): num_key_heads = Hk < H (dividing H) query/key heads serve the H value
    heads, value head h reading key head h // (H // Hk); q and k then have Hk heads, v and the
    output H, and the states stay one per value head ([B, H, F, M]).

    >>> out, state = linattn.linear_attention(q, k, v, causal=True, output_final_state=True)
    >>> y = state.step(q_t, k_t, v_t)      # q_t, k_t: [B, H, D], v_t: [B, H, M] -> [B, H, M]
    >>> blob = state.save()                # park the conversations
    >>> gva = linattn.RecurrentState(B, 8, 64, num_key_heads=2)   # q_t, k_t [B, 2, 64], v_t [B, 8, 64]
    """

    def __init__(self, batch_size: int, num_heads: int, key_dim: int, value_dim: int | None = None,
                 feature_map: str = "elu", dtype=np.float32, num_key_heads: int | None = None):
        fn = "RecurrentState"
        dtype = np.dtype(dtype)
        if dtype not in _FLOATS:
            raise TypeError(f"{fn}: dtype must be float32 or float64, got {dtype}")
        new = _ext.new_decoder_f32 if dtype == np.float32 else _ext.new_decoder_f64
        M = key_dim if value_dim is None else value_dim
        Hk = 0 if num_key_heads is None else int(num_key_heads)
        if num_key_heads is not None and (Hk <= 0 or int(num_heads) % Hk != 0):
            raise ValueError(f"{fn}: num_key_heads must be positive and divide num_heads (value head h reads key "
                             f"head h // (num_heads // num_key_heads)), got num_heads = {num_heads}, "
                             f"num_key_heads = {num_key_heads}")
        self._d = new(int(batch_size), int(num_heads), int(key_dim), int(M), str(feature_map), Hk)
        self.dtype = dtype

    @property
    def batch_size(self) -> int:
        """B, the number of sequences."""
        return self._d.sequences

    @property
    def num_heads(self) -> int:
        """H, the value heads of every sequence (of v, the output and the states)."""
        return self._d.heads

    @property
    def num_key_heads(self) -> int:
        """Hk, the query/key heads (H without shared key heads)."""
        return self._d.key_heads

    @property
    def key_dim(self) -> int:
        return self._d.key_dim

    @property
    def value_dim(self) -> int:
        return self._d.value_dim

    @property
    def feature_dim(self) -> int:
        """F, the feature map's output size per head."""
        return self._d.feature_dim

    @property
    def feature_map(self) -> str:
        return self._d.feature_map

    @property
    def positions(self) -> np.ndarray:
        """Tokens consumed by each sequence (int64, B entries)."""
        return np.asarray(self._d.positions(), dtype=np.int64)

    @property
    def S(self) -> np.ndarray:
        """The states Σ φ(k) vᵀ, [B, H, F, M] (a copy, the compensated low parts folded in)."""
        S, _ = self._d.states()
        return S.reshape(self.batch_size, self.num_heads, self.feature_dim, self.value_dim)

    @property
    def z(self) -> np.ndarray:
        """The normalisers Σ φ(k), [B, H, F] (a copy)."""
        _, z = self._d.states()
        return z.reshape(self.batch_size, self.num_heads, self.feature_dim)

    def step(self, q, k, v, slots=None) -> np.ndarray:
        """One token of every sequence (or of the sequences listed in slots, row r belonging to
        sequence slots[r]): q, k [R, Hk, D] (or FLA's [R, 1, Hk, D]; Hk = num_key_heads, H
        without shared key heads), v [R, H, M]; returns [R, H, M] (or [R, 1, H, M])."""
        fn = "RecurrentState.step"
        q, k, v = _arrays(fn, q=q, k=k, v=v)
        if q.dtype != self.dtype:
            raise TypeError(f"{fn}: the state holds {self.dtype}, the tokens are {q.dtype}")
        shapes = _Shapes("qkv", (q, k, v))
        if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim or (q.ndim == 4 and q.shape[1] != 1):
            raise ValueError(f"{fn}: q, k, v must be [R, H, D] (or [R, 1, H, D]), got {shapes}")
        H, Hk, D, M, B = self.num_heads, self.num_key_heads, self.key_dim, self.value_dim, self.batch_size
        if q.shape[-2:] != (Hk, D) or k.shape[-2:] != (Hk, D) or v.shape[-2:] != (H, M):
            heads = f"H = {H} heads" if Hk == H else f"H = {H} value heads over Hk = {Hk} key heads"
            raise ValueError(f"{fn}: the state has {heads} of D = {D}, M = {M}: q and k must end in ({Hk}, {D}) "
                             f"and v in ({H}, {M}), got {shapes}")
        R = q.shape[0]
        if k.shape[0] != R or v.shape[0] != R:
            raise ValueError(f"{fn}: q, k and v must have the same rows R (one token per sequence), got {shapes}")
        idx = None
        if slots is None:
            if R != B:
                raise ValueError(f"{fn}: without slots, q, k, v have one row per sequence of the state (B = {B}), "
                                 f"got {shapes}")
        else:
            idx = np.ascontiguousarray(slots, dtype=np.int64)
            if idx.ndim != 1 or idx.shape[0] != R:
                raise ValueError(f"{fn}: slots must be 1-D with one entry per row of q (R = {R}), got slots of shape "
                                 f"{idx.shape} (with {shapes})")
            bad = (idx < 0) | (idx >= B)
            if bad.any():
                r = int(np.argmax(bad))
                raise ValueError(f"{fn}: slots[{r}] = {idx[r]}: slots must be in [0, {B}) (the state's sequences)")
            uniq, first = np.unique(idx, return_index=True)
            if uniq.size != R:
                r = int(np.setdiff1d(np.arange(R), first)[0])
                raise ValueError(f"{fn}: slots[{r}] = {idx[r]} is repeated: each sequence takes one token per step")
        rows = [np.ascontiguousarray(a).reshape(a.shape[0], -1) for a in (q, k, v)]
        out = _kernel(fn, shapes, self._d.step, *rows, idx)
        return out.reshape(q.shape[:-2] + (self.num_heads, self.value_dim))

    def reset(self, b: int | None = None) -> None:
        """Every sequence (or sequence b) back to no tokens."""
        self._d.reset(None if b is None else int(b))

    def add_sequence(self) -> int:
        """Appends an empty sequence; returns its number."""
        return self._d.add_sequence()

    def remove_sequence(self, b: int) -> None:
        """Removes sequence b; the last sequence takes its number."""
        self._d.remove_sequence(int(b))

    def resize(self, batch_size: int) -> None:
        """batch_size sequences: the first keep their states, new ones are empty."""
        self._d.resize(int(batch_size))

    def save(self) -> bytes:
        """The exact decoding position of every sequence and head, as the C++ save_state()
        writes it (docs/SPEC.md §8)."""
        return self._d.save()

    def load(self, data: bytes) -> None:
        """Restores what save() wrote (of the same heads, D, M, map and dtype); the number of
        sequences becomes the file's. Raises RuntimeError naming the problem (truncated,
        corrupted, another shape) and leaves the state unchanged then."""
        self._d.load(bytes(data))

    def copy(self) -> "RecurrentState":
        c = RecurrentState.__new__(RecurrentState)
        c._d, c.dtype = self._d.clone(), self.dtype
        return c

    def __reduce__(self):
        return (_restore, (self.num_heads, self.key_dim, self.value_dim, self.feature_map, self.dtype.str,
                           self.save(), self.num_key_heads))

    def __repr__(self) -> str:
        shared = "" if self.num_key_heads == self.num_heads else f", num_key_heads={self.num_key_heads}"
        return (f"linattn.RecurrentState(batch_size={self.batch_size}, num_heads={self.num_heads}, "
                f"key_dim={self.key_dim}, value_dim={self.value_dim}, feature_map='{self.feature_map}', "
                f"dtype={self.dtype}{shared})")


def _restore(heads, key_dim, value_dim, feature_map, dtype, data, key_heads=None):
    # key_heads: None in what a pickle of an older linattn holds (no shared key heads then).
    state = RecurrentState(0, heads, key_dim, value_dim, feature_map, np.dtype(dtype), num_key_heads=key_heads)
    state.load(data)
    return state
