"""The full tables of every result, the working memory and the complexity fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import fmt_bytes, fmt_n, fmt_ratio, fmt_time, table
from .results import DEFAULTS, SHORT_LAYOUT, UNIT_S, frac_of_gemm
from .roofline import fmt_frac_peak

if TYPE_CHECKING:
    from .results import Results, Run


KIND_TITLES = {
    "gemm_linear": "GEMM reference for linear attention (Kᵀ V and Q S)",
    "linear": "Non-causal linear attention",
    "causal": "Causal linear attention",
    "gemm_softmax": "GEMM reference for softmax attention (QKᵀ and PV, in blocks of 256 × 512)",
    "softmax": "Softmax attention",
    "causal_softmax": "Causal softmax attention",
    "mh_gemm_linear": "Multi-head GEMM reference, linear shapes",
    "mh_linear": "Multi-head non-causal linear attention",
    "mh_causal": "Multi-head causal linear attention",
    "mh_gemm_softmax": "Multi-head GEMM reference, softmax shapes",
    "mh_softmax": "Multi-head softmax attention",
    "mh_causal_softmax": "Multi-head causal softmax attention",
    "mh_paper_linear": "The paper's non-causal module (baseline, [H, N, D] memory)",
    "mh_paper_causal": "The paper's causal CPU algorithm (baseline, [H, N, D] memory)",
    "mh_gemm_linear_bwd": "Multi-head GEMM reference, linear attention's backward (Qᵀ G, G Sᵀ, K "
                          "R, V Rᵀ)",
    "mh_train_linear": "Multi-head linear attention: forward, backward, forward + backward",
    "mh_train_causal": "Multi-head causal linear attention: forward, backward, forward + backward",
    "mh_gemm_softmax_bwd": "Multi-head GEMM reference, softmax's backward (five products, blocks "
                           "of 256 × 512)",
    "mh_train_softmax": "Multi-head tiled softmax: forward, backward, forward + backward",
    "mh_train_causal_softmax": "Multi-head causal tiled softmax: forward, backward, forward + "
                               "backward",
    "gt_gemm_linear": "Gated attention's GEMM reference (bench_gated: Kᵀ V and Q S, 8 heads)",
    "gt_causal": "Plain multi-head causal linear attention (bench_gated's reference, EluPlusOne)",
    "gt_gated": "Multi-head gated linear attention (Identity, normalize = false)",
    "gt_pair": "Gated vs plain causal call by call (time of all three calls)",
    "gt_train": "Gated and plain causal gradients, returning forms",
    "gt_decode_pair": "Gated vs plain decode step (time of the three blocks of steps)",
    "dl_gemm_linear": "The delta rule's GEMM reference (bench_delta: Kᵀ V and Q S, 8 heads)",
    "dl_causal": "Plain multi-head causal linear attention (bench_delta's reference, EluPlusOne)",
    "dl_delta": "Multi-head delta rule (L2Normalize<Silu>, scale 1/√D)",
    "dl_pair": "Delta rule (chunked, recurrent) vs plain causal call by call (time of all three "
               "calls)",
    "dl_decode_pair": "Delta-rule vs plain decode step (time of the two blocks of steps)",
    "dl_naive_pair": "The token-by-token recurrence in Eigen vs the delta rule Chunked and Auto "
                     "(one head)",
    "decode_recurrent": "Decode step, recurrent (RNN) form",
    "decode_softmax": "Decode step, softmax over a KV cache",
    "fm_linear": "Every feature map, non-causal (feature_map_quality; errors in "
                 "docs/feature_maps.md)",
    "fm_causal": "Every feature map, causal (feature_map_quality; errors in docs/feature_maps.md)",
}
KIND_ORDER = list(KIND_TITLES)
# Kinds whose every figure is in a section of their own (kda.py, gdn_layer.py, kda_layer.py), not
# repeated in the full tables.
OWN_SECTION = ("kda_", "bdec_", "gdn_")

# Columns of a table; every other param makes a table.
VARIANT_KEYS = {"causal": ("alg", "chunk", "layout", "form"),
                **{k: ("pass", "layout") for k in ("mh_train_linear", "mh_train_causal",
                                                   "mh_train_softmax",
                                                   "mh_train_causal_softmax")},
                "gt_gated": ("alg", "chunk", "layout"),
                "dl_delta": ("alg", "chunk", "layout"),
                "gt_train": ("gate", "phi", "pass", "layout")}
PASS_ORDER = {"fwd": 0, "bwd": 1, "fwdbwd": 2}


def variant_keys(kind: str) -> tuple:
    return VARIANT_KEYS.get(kind, ("phi", "alg", "chunk", "layout", "form"))


def variant_label(kind: str, p: dict) -> str:
    parts = []
    for k in variant_keys(kind):
        if k not in p or p[k] == DEFAULTS.get(k):
            continue
        if k == "chunk":
            parts.append(f"chunk {p[k]}")
        elif k == "layout":
            parts.append(SHORT_LAYOUT.get(p[k], p[k]))
        elif k == "form":
            parts.append("returning form" if p[k] == "ret" else p[k])
        elif k == "pass":
            parts.append({"fwd": "forward", "bwd": "backward", "fwdbwd": "fwd + bwd"}.get(p[k],
                                                                                          p[k]))
        else:
            parts.append(p[k])
    if "chunk" in p and p.get("alg") == "chunked":
        parts = [f"chunked, C = {p['chunk']}"]
    return ", ".join(parts) or "time"


def full_tables(res: Results) -> list[str]:
    """One table per (kind, shape): rows N, a column per variant; cells wall time · GFLOP/s ·
    frac_of_gemm ·
    frac_of_peak."""
    L: list[str] = ["", "Cells: wall time · useful GFLOP/s · frac_of_gemm (– where there is no "
                        "GEMM reference) · "
                        "frac_of_peak (– without bench_roofline's runs or a flop count)."]
    groups: dict[tuple, dict[tuple, dict[int, Run]]] = {}
    for r in res.runs:
        if r.kind.startswith(OWN_SECTION):
            continue
        vk = variant_keys(r.kind)
        gkey = (r.kind,) + tuple(sorted((k, v) for k, v in r.params.items() if k not in vk))
        vkey = tuple(sorted((k, v) for k, v in r.params.items() if k in vk))
        groups.setdefault(gkey, {}).setdefault(vkey, {})[r.size] = r

    def vsort(v):
        d = dict(v)
        return (d.get("phi", ""), d.get("alg", ""), int(d.get("chunk", 0) or 0),
                PASS_ORDER.get(d.get("pass"), -1),
                d.get("layout", ""))

    order = sorted(groups, key=lambda g: (KIND_ORDER.index(g[0]) if g[0] in KIND_ORDER else 99, g))
    for g in order:
        kind, p = g[0], dict(g[1:])
        variants = sorted(groups[g], key=vsort)
        desc = ", ".join(f"{k} = {v}" for k, v in p.items())
        L += ["", f"#### {KIND_TITLES.get(kind, kind)} — {desc}", ""]
        sizes = sorted({n for v in variants for n in groups[g][v]})
        header = (["position" if kind.startswith("decode") else "N"]
                  + [variant_label(kind, dict(v)) for v in variants])
        rows = []
        for n in sizes:
            row = [fmt_n(n)]
            for v in variants:
                r = groups[g][v].get(n)
                row.append("–" if r is None else
                           f"{fmt_time(r.wall)} · {fmt_ratio(r.gflops(), 1)} · "
                           f"{fmt_ratio(frac_of_gemm(res, r))} · "
                           f"{fmt_frac_peak(res, r)}")
            rows.append(row)
        L += table(header, rows)
    return L


def memory_table(res: Results) -> list[str]:
    """Working memory of every kernel family at its smallest and largest size."""
    fams: dict[tuple, list[Run]] = {}
    for r in res.runs:
        if r.get("ws_bytes") is not None:
            fams.setdefault(r.family(), []).append(r)
    rows = []
    for fam in sorted(fams,
                      key=lambda f: (KIND_ORDER.index(f[0]) if f[0] in KIND_ORDER else 99, f)):
        runs = sorted(fams[fam], key=lambda r: r.size)
        a, b = runs[0], runs[-1]
        name = fam[0] + "/" + "/".join(f"{k}:{v}" for k, v in fam[1:])
        rows.append([name, fmt_n(a.size), fmt_bytes(a.get("ws_bytes")), fmt_n(b.size),
                     fmt_bytes(b.get("ws_bytes")),
                     fmt_bytes(b.get("state_bytes"))])
    if not rows:
        return ["(no ws_bytes counters in these results)"]
    return table(["kernel", "smallest N", "ws_bytes", "largest N", "ws_bytes", "state_bytes "
                                                                               "(largest)"], rows,
                 "lrrrrr")


def fit_table(res: Results) -> list[str]:
    by: dict[str, dict] = {}
    for e in res.fits:
        by.setdefault(e["run_name"], {})[e["aggregate_name"]] = e
    rows = []
    for name in sorted(by,
                       key=lambda n: (KIND_ORDER.index(n.split("/")[0])
                                      if n.split("/")[0] in KIND_ORDER else 99, n)):
        big = by[name].get("BigO")
        rms = by[name].get("RMS")
        if not big:
            continue
        unit = UNIT_S[big.get("time_unit", "ns")]
        order = big.get("big_o", "?")
        coef = big.get("real_coefficient", 0.0) * unit
        rows.append([name.replace("/real_time", ""),
                     "O(" + ("1" if order in ("(1)", "1") else order) + ")",
                     f"{coef:.3g} s", f"{rms['rms'] * 100:.0f} %" if rms else "–"])
    if not rows:
        return ["(no complexity fits: every family had a single size)"]
    return table(["family", "fit", "coefficient (wall)", "RMS error"], rows, "llrr")
