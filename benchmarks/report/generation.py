"""Image generation (bench_generation: the paper's section 4.2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .fmt import fmt_bytes, fmt_secs, fmt_time, table, wrap

if TYPE_CHECKING:
    from .results import Results


# The paper's speed-ups of linear attention over plain softmax (images per second, GPU), Table 3
# and Table 4 of Katharopoulos et al. 2020: constants of the paper, not measurements.
PAPER_GEN_SPEEDUP = {"img784": 317.0, "img3072": 4462.0}
GEN_MODELS = (("img784", "784 tokens (28×28), 8 "
                         "layers"), ("img3072", "3072 tokens (32×32×3), 16 layers"),
              ("tiny", "64 tokens, 2 layers (smoke)"))
GEN_ATTN = (("linear", "linear (recurrent state)"), ("kv", "softmax, KV cache"),
            ("softmax", "softmax, recomputed prefix (the paper's)"))


def gen_step_times(res: Results, model: str, attn: str, batch: int) -> list[tuple[int, float]]:
    """(position, seconds per step of the whole batch) of gen_step, by position."""
    q = dict(model=model, attn=attn, batch=str(batch))
    pts = []
    for n in res.sizes("gen_step", **q):
        r = res.find("gen_step", n, **q)
        if r:
            pts.append((n, r.wall / float(r.get("steps_per_iteration", 1.0))))
    return pts


def integrate_steps(pts: list[tuple[int, float]], tokens: int) -> float | None:
    """Σ_{p=1}^{tokens} t(p) from the step times at the measured positions: composite Simpson's rule
    where the knots allow it (odd count; exact for the quadratic cost of recomputation), trapezoids
    otherwise. The first knot (position 1) stands for position 0."""
    if not pts:
        return None
    if len(pts) == 1:
        return pts[0][1] * tokens
    xs = [0.0] + [float(x) for x, _ in pts[1:]]
    ys = [y for _, y in pts]
    if xs[-1] <= 0:
        return None
    scale = tokens / xs[-1]
    h = [xs[i + 1] - xs[i] for i in range(len(xs) - 1)]
    even = max(h) - min(h) <= 0.02 * max(h)
    if len(pts) % 2 == 1 and even:
        step = (xs[-1] - xs[0]) / (len(xs) - 1)
        total = ys[0] + ys[-1] + sum((4 if i % 2 else 2) * ys[i] for i in range(1, len(ys) - 1))
        return total * step / 3 * scale
    return sum((ys[i] + ys[i + 1]) / 2 * h[i] for i in range(len(h))) * scale


def seconds_per_image(res: Results, model: str, batch: int) -> dict[str, float | None]:
    """Seconds per image of one sequence of the batch, by attention (None where not measured): the
    step times integrated over the model's tokens (integrate_steps), divided by the batch."""
    ns = res.sizes("gen_step", model=model, attn="linear", batch="1")
    if not ns:
        return {}
    tokens = int(res.find("gen_step", ns[0], model=model, attn="linear", batch="1").get("tokens",
                                                                                        0))
    out: dict[str, float | None] = {}
    for a, _ in GEN_ATTN:
        total = integrate_steps(gen_step_times(res, model, a, batch), tokens)
        out[a] = total / batch if total else None
    return out


@dataclass
class GenRow:
    """One row of the images-per-second table (None: not measured)."""
    model: str
    batch: int
    per_second: dict[str, float | None]  # images per second by attention (GEN_ATTN)
    vs_softmax: float | None  # seconds per image, softmax recomputing its prefix ÷ linear
    paper: float | None  # the paper's speed-up for this model (a constant of the paper)
    vs_kv: float | None  # seconds per image, softmax with a KV cache ÷ linear
    end_to_end: float | None  # seconds per image of linear, generated whole (gen_seq)
    integrated: float  # seconds per image of linear, integrated from gen_step


def gen_figures(res: Results) -> list[GenRow]:
    """The rows of the images-per-second table."""
    rows = []
    for m, lab in GEN_MODELS:
        if not res.sizes("gen_step", model=m, attn="linear", batch="1"):
            continue
        for batch in (1, 8):
            t = seconds_per_image(res, m, batch)
            lin = t.get("linear")
            if not lin:
                continue
            seq = res.find("gen_seq", 0, model=m, attn="linear", batch=str(batch))
            per_second = {a: 1.0 / t[a] if t.get(a) else None for a, _ in GEN_ATTN}
            rows.append(GenRow(lab, batch, per_second,
                               t["softmax"] / lin if t.get("softmax") else None,
                               PAPER_GEN_SPEEDUP.get(m), t["kv"] / lin if t.get("kv") else None,
                               seq.wall / batch if seq else None, lin))
    return rows


def gen_table(figures: list[GenRow]) -> list[str]:
    """The images-per-second table and its note (README.md's generation block)."""
    def ips(x):
        return f"{x:.3g}" if x else "–"

    def vs(x):
        return "–" if not x else f"{x:.0f}×" if x >= 10 else f"{x:.1f}×"

    rows = [[g.model, str(g.batch), ips(g.per_second.get("linear")), ips(g.per_second.get("kv")),
             ips(g.per_second.get("softmax")), vs(g.vs_softmax),
             f"{g.paper:.0f}×" if g.paper else "–", vs(g.vs_kv),
             f"{fmt_secs(g.end_to_end)} / {fmt_secs(g.integrated)}" if g.end_to_end else "–"]
            for g in figures]
    L = table(["model", "batch", "img/s linear", "img/s KV cache", "img/s recompute",
               "vs recompute", "paper (GPU)", "vs KV cache", "end to end / integrated, s"], rows,
              "lrrrrrrrr")
    L += [""] + wrap(
        "Images per second are per sequence of the batch, integrated from the step times at the "
        "measured positions (Simpson's rule; `gen_step`); vs: the other attention's time per image "
        "÷ linear attention's. The last column checks the integration: linear attention's seconds "
        "per image generated end to end (`gen_seq`) against the integrated figure. The paper's "
        "ratios are for plain softmax (recomputed prefix) on a GPU with its largest batch; here "
        "one CPU thread.") + [""]
    return L


def generation(res: Results, table_only: bool = False) -> list[str]:
    """Section 12: images per second with each attention, the ratios next to the paper's, the time
    per token against position, and the memory a sequence keeps (table_only: the first table and
    its note, for README.md)."""
    models = [(m, lab) for m,
              lab in GEN_MODELS if res.sizes("gen_step", model=m, attn="linear", batch="1")]
    if not models:
        return ["(no gen_step runs in these results)"]
    L = gen_table(gen_figures(res))
    if table_only:
        return L
    # Time per token against position, batch 1.
    for m, lab in models:
        series = {a: dict(gen_step_times(res, m, a, 1)) for a, _ in GEN_ATTN}
        positions = sorted(set().union(*[set(v) for v in series.values()]))
        rows = []
        for pos in positions:
            rows.append([str(pos)] + [fmt_time(series[a].get(pos)) if series[a].get(pos) else "–"
                                        for a, _ in GEN_ATTN])
        L += wrap(f"Time per generated token against position, {lab}, batch 1:") + [""]
        L += table(["position"] + [t for _, t in GEN_ATTN], rows, "rrrr")
        L.append("")
    # Memory kept per sequence at the last position.
    rows = []
    for m, lab in models:
        for a, t in GEN_ATTN:
            ns = res.sizes("gen_step", model=m, attn=a, batch="1")
            if ns:
                r = res.find("gen_step", ns[-1], model=m, attn=a, batch="1")
                rows.append([lab, t, fmt_bytes(r.get("state_bytes")),
                             fmt_bytes(r.get("step_bytes"))])
    L += wrap("Memory of one sequence at the last position: what it keeps between steps, and the "
              "largest buffers of a step (computed from their shapes):") + [""]
    L += table(["model", "attention", "kept between steps", "buffers of a step"], rows, "llrr")
    return L
