#!/usr/bin/env python3
"""linattn from Python against the same formulas written in PyTorch, and the Python overhead.

One thread for both libraries (linattn.set_num_threads(1), torch.set_num_threads(1)); B = 1,
H = 8, D = M = 64, float32, EluPlusOne (elu + 1) for linear attention; best of `--repeats`
wall times per case. Printed as a markdown table:

* linattn (numpy arrays) and linattn.torch, forward and forward + backward, causal and not;
* the PyTorch formula as fast-transformers' Python fallback writes it: non-causal with einsum,
  causal with a cumulative sum of the per-token outer products (memory B·N·H·D·M: up to
  --max-torch-n), autograd for the backward;
* PyTorch softmax attention, softmax(q kᵀ/√D) v with a causal mask (memory B·H·N²: up to
  --max-torch-n);
* the Python overhead: one call at N = 16;
* decoding: linattn.RecurrentState.step for B = 1 and 64 sequences x 8 heads, tokens per second;
* the GIL released: two Python threads running kernels at once against the same calls one
  after the other (1 kernel thread each; 2x is the ideal on two free cores).

Usage: python3 benchmarks/bench_python.py [--quick] with linattn importable: installed
(`pip install --no-build-isolation ./python`, as `bash .ci/bench` does in a venv) or from a
CMake build (PYTHONPATH=build/python). torch is optional: without it only the numpy rows.
"""

from __future__ import annotations

import argparse
import re
import threading
import time

import numpy as np

import linattn

try:
    import torch

    import linattn.torch as lt
except ImportError:  # numpy rows only
    torch = None


def best(fn, repeats: int) -> float:
    fn()  # warm-up: workspaces, first-touch of the outputs
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def torch_blas() -> str:
    """The BLAS torch was built for (BLAS_INFO of torch.__config__.show()) and the BLAS libraries
    this process has loaded: Debian's torch says "generic", which is whatever libblas.so.3 the
    system's alternatives point at (reference BLAS or OpenBLAS), and that sets its einsums'
    speed."""
    m = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    txt = f"BLAS_INFO={m.group(1) if m else '?'}"
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            libs = sorted({line.split()[-1] for line in f
                           if re.search(r"/lib[^/]*(blas|mkl)[^/]*\.so", line, re.I)})
    except OSError:  # not Linux: the build's word only
        libs = []
    return txt + (f", loaded {', '.join(libs)}" if libs else "")


def phi(x):
    return torch.nn.functional.elu(x) + 1


def torch_linear(q, k, v, causal):
    """[B, N, H, D] -> [B, N, H, M], the fast-transformers formula in PyTorch."""
    pq, pk = phi(q), phi(k)
    if not causal:
        kv = torch.einsum("bnhd,bnhm->bhdm", pk, v)
        z = pk.sum(1)
        den = torch.einsum("bnhd,bhd->bnh", pq, z)
        return torch.einsum("bnhd,bhdm->bnhm", pq, kv) / den[..., None]
    kv = torch.cumsum(torch.einsum("bnhd,bnhm->bnhdm", pk, v), dim=1)
    z = torch.cumsum(pk, dim=1)
    den = torch.einsum("bnhd,bnhd->bnh", pq, z)
    return torch.einsum("bnhd,bnhdm->bnhm", pq, kv) / den[..., None]


def torch_softmax(q, k, v, causal):
    s = torch.einsum("bnhd,blhd->bhnl", q, k) / np.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhnl,blhm->bnhm", s.softmax(-1), v)


def fwd_bwd(f, q, k, v):
    def run():
        for t in (q, k, v):
            t.grad = None
        f(q, k, v).sum().backward()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="N up to 4096 (PyTorch up to 1024), 3 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-torch-n", type=int, default=None,
                    help="largest N of the PyTorch formula's causal form and of softmax (default "
                         "4096; 1024 with --quick: Debian's torch takes 41 s per softmax "
                         "forward+backward at 4096)")
    args = ap.parse_args()
    if args.max_torch_n is None:
        args.max_torch_n = 1024 if args.quick else 4096
    ns = [256, 1024, 4096] if args.quick else [256, 1024, 4096, 16384]
    repeats = 3 if args.quick else args.repeats
    linattn.set_num_threads(1)
    if torch is not None:
        torch.set_num_threads(1)
    H, D = 8, 64
    rng = np.random.default_rng(0)
    versions = f"torch {torch.__version__} ({torch_blas()})" if torch else "no torch"
    print(f"linattn {linattn.__version__}, {versions}; B = 1, H = {H}, D = M = {D}, float32, "
          f"1 thread; best of {repeats}; times in ms\n")
    head = ["N", "causal", "linattn numpy fwd", "linattn.torch fwd", "linattn.torch fwd+bwd",
            "torch formula fwd", "torch formula fwd+bwd", "formula ÷ linattn, fwd+bwd",
            "torch softmax fwd+bwd"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for n in ns:
        q, k, v = (rng.uniform(-1, 1, (1, n, H, D)).astype(np.float32) for _ in range(3))
        for causal in (False, True):
            t_np = best(lambda: linattn.linear_attention(q, k, v, "elu", causal), repeats)
            row = [str(n), "yes" if causal else "no", f"{1e3 * t_np:.2f}"]
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
                f = lambda a, b, c: lt.linear_attention(a, b, c, "elu", causal)
                t_fb = best(fwd_bwd(f, tq, tk, tv), repeats)
                row += [f"{1e3 * best(lambda: f(tq, tk, tv), repeats):.2f}", f"{1e3 * t_fb:.2f}"]
                if n <= args.max_torch_n or not causal:
                    g = lambda a, b, c: torch_linear(a, b, c, causal)
                    with torch.no_grad():
                        t_f = best(lambda: g(tq, tk, tv), repeats)
                    t_gb = best(fwd_bwd(g, tq, tk, tv), repeats)
                    row += [f"{1e3 * t_f:.2f}", f"{1e3 * t_gb:.2f}", f"{t_gb / t_fb:.1f}×"]
                else:
                    row += ["–", "–", "–"]
                if n <= args.max_torch_n:
                    s = lambda a, b, c: torch_softmax(a, b, c, causal)
                    row.append(f"{1e3 * best(fwd_bwd(s, tq, tk, tv), repeats):.2f}")
                else:
                    row.append("–")
            print("| " + " | ".join(row) + " |")
    q, k, v = (rng.uniform(-1, 1, (1, 16, H, D)).astype(np.float32) for _ in range(3))
    calls = 2000
    t = best(lambda: [linattn.linear_attention(q, k, v, "elu", True) for _ in range(calls)],
             3) / calls
    line = (f"\nPython overhead, N = 16 causal: {1e6 * t:.1f} µs per linattn.linear_attention call "
            "(numpy)")
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        t2 = best(lambda: [lt.causal_linear_attention(tq, tk, tv) for _ in range(calls)], 3) / calls
        line += f", {1e6 * t2:.1f} µs per linattn.torch call"
    print(line)

    print("\nDecoding, linattn.RecurrentState.step (H = 8, D = M = 64, float32, elu, 1 thread):\n")
    print("| sequences B | µs per step | tokens/s |")
    print("|---:|---:|---:|")
    for B in (1, 64):
        state = linattn.RecurrentState(B, H, D, D, "elu", np.float32)
        q, k, v = (rng.uniform(-1, 1, (B, H, D)).astype(np.float32) for _ in range(3))
        steps = 2000 if B == 1 else 200
        t = best(lambda: [state.step(q, k, v) for _ in range(steps)], 3) / steps
        print(f"| {B} | {1e6 * t:.1f} | {B / t:,.0f} |")

    n = 4096
    q, k, v = (rng.uniform(-1, 1, (1, n, H, D)).astype(np.float32) for _ in range(3))
    call = lambda: linattn.linear_attention(q, k, v, "elu", True)
    serial = best(lambda: (call(), call()), repeats)

    def two_threads():
        threads = [threading.Thread(target=call) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    parallel = best(two_threads, repeats)
    print(f"\nGIL released: two causal forwards (N = {n}) one after the other "
          f"{1e3 * serial:.1f} ms, "
          f"in two Python threads {1e3 * parallel:.1f} ms: {serial / parallel:.2f}x")


if __name__ == "__main__":
    main()
