"""The Python package against the C++ library's own entry points on the same inputs: the same
bits where the same kernel runs. python/tests/cpp_reference.cpp (built with the module, same
flags) writes what a C++ user gets; LINATTN_CPP_REFERENCE names that program (ctest sets it)."""

import os
import subprocess

import numpy as np
import pytest

import linattn

PROGRAM = os.environ.get("LINATTN_CPP_REFERENCE")


def values(rows, cols, seed, dtype):
    """cpp_reference.cpp's values(): exact in float64, then rounded once."""
    i = np.arange(rows * cols, dtype=np.int64)
    return (((i * 7919 + seed * 104729) % 2003) / 1001.0 - 1.0).astype(dtype).reshape(rows, cols)


@pytest.fixture(scope="module")
def cpp(tmp_path_factory):
    if not PROGRAM:
        pytest.skip("LINATTN_CPP_REFERENCE is not set (run through ctest)")
    out = tmp_path_factory.mktemp("cpp")
    subprocess.run([PROGRAM, str(out)], check=True)
    return out


def test_same_bits_as_cpp(cpp):
    N, H, D, M = 300, 4, 16, 8
    f32, f64 = np.float32, np.float64

    def heads(x, width):  # [N, H·width] -> [1, N, H, width], the FLA layout
        return x.reshape(1, x.shape[0], H, width)

    q, k, v = heads(values(N, H * D, 1, f32), D), heads(values(N, H * D, 2, f32), D), heads(values(N, H * M, 3, f32), M)
    out = linattn.linear_attention(q, k, v, "elu", causal=True)
    assert np.array_equal(out.reshape(N, H * M), np.fromfile(cpp / "causal_elu_f32.bin", f32).reshape(N, H * M))

    q = values(N, H * D, 4, f64).reshape(N, H, D)  # the packed [N, H, D] layout
    k, v = values(N + 37, H * D, 5, f64).reshape(-1, H, D), values(N + 37, H * M, 6, f64).reshape(-1, H, M)
    out = linattn.linear_attention(q, k, v, "softmax_split")
    assert np.array_equal(out.reshape(N, H * M),
                          np.fromfile(cpp / "linear_softmax_split_f64.bin", f64).reshape(N, H * M))

    q, k, v = heads(values(N, H * D, 7, f32), D), heads(values(N, H * D, 8, f32), D), heads(values(N, H * M, 9, f32), M)
    beta = ((values(N, H, 10, f32) + f32(1)) * f32(0.5)).reshape(1, N, H)
    g = ((values(N, H, 11, f32) - f32(1)) * f32(0.05)).reshape(1, N, H)
    out = linattn.delta_rule_attention(q, k, v, beta, g, "l2norm_silu")
    assert np.array_equal(out.reshape(N, H * M), np.fromfile(cpp / "delta_f32.bin", f32).reshape(N, H * M))

    B, T = 3, 150
    Q, K, V = values(B * T, H * D, 12, f64), values(B * T, H * D, 13, f64), values(B * T, H * M, 14, f64)
    state = linattn.RecurrentState(B, H, D, M, "elu", f64)
    outs = [state.step(Q[t * B:(t + 1) * B].reshape(B, H, D), K[t * B:(t + 1) * B].reshape(B, H, D),
                       V[t * B:(t + 1) * B].reshape(B, H, M)) for t in range(T)]
    assert np.array_equal(np.concatenate(outs).reshape(B * T, H * M),
                          np.fromfile(cpp / "decode_f64.bin", f64).reshape(B * T, H * M))
    assert state.save() == (cpp / "decode_f64.state").read_bytes()
