"""The plots: time vs N, the roofline, time per token vs position."""

from __future__ import annotations

import math
from xml.sax.saxutils import escape
from typing import TYPE_CHECKING

from .fmt import decade_label, fmt_n
from .generation import GEN_ATTN, GEN_MODELS, gen_step_times
from .results import TARGET
from .roof import LEVEL_LABEL, ROOF_LEVELS
from .roofline import ROOF_N, kernel_cost, roof_run
from .svg import place_labels, svg_log_grid, svg_marker, write_svg

if TYPE_CHECKING:
    from .results import Results


def svg_plot(res: Results, path: str) -> bool:
    T = TARGET
    series_spec = [
        ("mh_linear", {}, "linear attention", "#1f77b4", "circle", ""),
        ("mh_causal", {}, "causal linear attention (library default)", "#2ca02c", "square", ""),
        ("mh_softmax", {"alg": "tiled"}, "softmax attention (tiled)", "#d62728", "circle", ""),
        ("mh_causal_softmax", {"alg": "tiled"}, "causal softmax attention "
                                                "(tiled)", "#ff7f0e", "square", ""),
        ("mh_gemm_linear", {}, "GEMM reference, linear shapes", "#555555", "none", "6,4"),
        ("mh_gemm_softmax", {}, "GEMM reference, softmax shapes", "#999999", "none", "2,3"),
        ("mh_paper_causal", {"layout": "hnd"}, "paper's causal CPU algorithm (same "
                                               "run)", "#000000", "square", "7,3"),
        ("mh_paper_linear", {"layout": "hnd"}, "paper's non-causal module (same "
                                               "run)", "#000000", "circle", "2,2"),
    ]
    title_cfg = ("float, H = 8 heads, D = M = 64, 1 thread; linattn on column-major packed inputs, "
                 "the paper on [H, N, D]")
    params = dict(T)
    if not res.sizes("mh_linear", **T):  # fall back to the single-head sweep
        series_spec = [(k.replace("mh_", ""), p, lab, c, m, d) for k, p, lab, c, m,
                       d in series_spec]
        params = dict(dtype="f32", D="64")
        title_cfg = "float, one head, D = M = 64, 1 thread"
    series = []
    for kind, p, label, color, marker, dash in series_spec:
        pts = []
        for n in res.sizes(kind, **params, **p):
            r = res.find(kind, n, **params, **p)
            if r and r.wall > 0:
                pts.append((n, r.wall))
        if pts:
            series.append((label, color, marker, dash, pts))
    if not series:
        return False

    W, H = 900, 600
    ml, mr, mt, mb = 90, 30, 60, 70
    pw, ph = W - ml - mr, H - mt - mb
    xs = [x for s in series for x, _ in s[4]]
    ys = [y for s in series for _, y in s[4]]
    x0, x1 = math.log10(min(xs)) - 0.08, math.log10(max(xs)) + 0.08
    y0 = math.floor(math.log10(min(ys)))
    y1 = math.ceil(math.log10(max(ys)))
    if y1 - y0 < 2:
        y1 = y0 + 2

    def X(v):
        return ml + (math.log10(v) - x0) / (x1 - x0) * pw

    def Y(v):
        return mt + ph - (math.log10(v) - y0) / (y1 - y0) * ph

    o: list[str] = []
    o.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} '
             f'{H}" '
             'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="13">')
    o.append(f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>')
    o.append(f'<text x="{W / 2:.0f}" y="28" text-anchor="middle" font-size="17" font-weight="bold">'
             f'linattn: time per call vs sequence length N</text>')
    o.append(f'<text x="{W / 2:.0f}" y="47" text-anchor="middle" font-size="13" fill="#444">'
             f'{escape(title_cfg)} — log-log; wall-clock time</text>')
    # Grid and ticks: y decades with minor ticks at 2..9.
    for e in range(y0, y1 + 1):
        v = 10.0 ** e
        y = Y(v)
        o.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}" stroke="#cccccc" '
                 'stroke-width="1"/>')
        o.append(f'<line x1="{ml - 6}" y1="{y:.1f}" x2="{ml}" y2="{y:.1f}" stroke="black"/>')
        o.append(f'<text x="{ml - 9}" y="{y + 4:.1f}" '
                 f'text-anchor="end">{escape(decade_label(e))}</text>')
        if e < y1:
            for m in range(2, 10):
                ym = Y(m * v)
                o.append(f'<line x1="{ml}" y1="{ym:.1f}" x2="{ml + pw}" y2="{ym:.1f}" '
                         'stroke="#eeeeee" stroke-width="1"/>')
                o.append(f'<line x1="{ml - 3}" y1="{ym:.1f}" x2="{ml}" y2="{ym:.1f}" '
                         'stroke="black"/>')
    # x: every power of two in range.
    n = 1
    while n <= max(xs):
        if n >= min(xs):
            x = X(n)
            o.append(f'<line x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{mt + ph}" stroke="#dddddd" '
                     'stroke-width="1"/>')
            o.append(f'<line x1="{x:.1f}" y1="{mt + ph}" x2="{x:.1f}" y2="{mt + ph + 6}" '
                     'stroke="black"/>')
            o.append(f'<text x="{x:.1f}" y="{mt + ph + 21}" text-anchor="middle">{fmt_n(n)}</text>')
        n *= 2
    o.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
    o.append(f'<text x="{ml + pw / 2:.0f}" y="{H - 22}" text-anchor="middle" font-size="14">'
             'sequence length N (= L; log scale)</text>')
    o.append(f'<text transform="translate(22,{mt + ph / 2:.0f}) rotate(-90)" text-anchor="middle" '
             'font-size="14">time per call (log scale)</text>')
    # Series.
    for label, color, marker, dash, pts in series:
        d = " ".join(f"{'M' if i == 0 else 'L'}{X(x):.1f},{Y(y):.1f}" for i,
                     (x, y) in enumerate(pts))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        o.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="2.2"{dash_attr}/>')
        for x, y in pts:
            cx, cy = X(x), Y(y)
            if marker == "circle":
                o.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{color}"/>')
            elif marker == "square":
                o.append(f'<rect x="{cx - 4:.1f}" y="{cy - 4:.1f}" width="8" height="8" '
                         f'fill="{color}"/>')
    legend_extra: list[tuple[str, str]] = []
    # Legend (top left, where the curves are not).
    items = [(lab, c, m, d) for lab, c, m, d, _ in series]
    lx, ly = ml + 14, mt + 14
    lw = 330
    lh = 22 * (len(items) + len(legend_extra)) + 12
    o.append(f'<rect x="{lx}" y="{ly}" width="{lw}" height="{lh}" fill="white" fill-opacity="0.92" '
             'stroke="#888888"/>')
    yy = ly + 20
    for lab, c, m, d in items:
        dash_attr = f' stroke-dasharray="{d}"' if d else ""
        o.append(f'<line x1="{lx + 10}" y1="{yy - 4}" x2="{lx + 44}" y2="{yy - 4}" stroke="{c}" '
                 f'stroke-width="2.2"{dash_attr}/>')
        if m == "circle":
            o.append(f'<circle cx="{lx + 27}" cy="{yy - 4}" r="4" fill="{c}"/>')
        elif m == "square":
            o.append(f'<rect x="{lx + 23}" y="{yy - 8}" width="8" height="8" fill="{c}"/>')
        o.append(f'<text x="{lx + 52}" y="{yy}">{escape(lab)}</text>')
        yy += 22
    for m, lab in legend_extra:
        if m == "cross":
            o.append(f'<path d="M{lx + 21},{yy - 10} L{lx + 33},{yy + 2} M{lx + 21},{yy + 2} '
                     f'L{lx + 33},{yy - 10}" '
                     'stroke="black" stroke-width="2.5"/>')
        else:
            o.append(f'<line x1="{lx + 13}" y1="{yy - 4}" x2="{lx + 41}" y2="{yy - 4}" '
                     'stroke="black" stroke-width="2.5"/>')
        o.append(f'<text x="{lx + 52}" y="{yy}">{escape(lab)}</text>')
        yy += 22
    return write_svg(path, o)


# Points of the roofline plot: label, cost (kernel_cost), kind, layout, colour, marker.
ROOF_POINTS = (
    ("non-causal", "fwd", "mh_linear", "col", "#1f77b4", "circle"),
    ("causal", "fwd", "mh_causal", "col", "#2ca02c", "square"),
    ("non-causal, row-major", "fwd", "mh_linear", "row", "#1f77b4", "open-circle"),
    ("causal, row-major", "fwd", "mh_causal", "row", "#2ca02c", "open-square"),
    ("backward, non-causal", "bwd", "mh_train_linear", "col", "#9467bd", "circle"),
    ("backward, causal", "bwd", "mh_train_causal", "col", "#9467bd", "square"),
    ("decode step, B = 1", "decode", "serve_batched", "col", "#d62728", "diamond"),
    ("decode step, B = 64", "decode", "serve_batched", "col", "#ff7f0e", "diamond"),
)
ROOF_LINE_STYLE = {("L1", False): ("#444444", ""), ("L2", False): ("#777777", ""),
                   ("L3", False): ("#8c564b", ""),
                   ("mem", False): ("#aaaaaa", ""), ("L1", True): ("#444444", "6,4"),
                   ("L2", True): ("#777777", "6,4"),
                   ("L3", True): ("#8c564b", "6,4"), ("mem", True): ("#aaaaaa", "6,4")}


def roof_legend_height(roofs: list[tuple]) -> int:
    """Height of roof_legend's block: a title and a row per roof of the longer column."""
    return 22 * max(sum(1 for r in roofs if not r[3]), sum(1 for r in roofs if r[3]), 1) + 34


def roof_legend(o: list[str], roofs: list[tuple], x: float, y: float, width: float) -> None:
    """The legend of the roofs (label, bandwidth, colour, dash) from (x, y) down: below the plot, in
    a column per kind of bandwidth (read left, read + write dashed right), so that it covers no
    point or label wherever the kernels land."""
    o.append(f'<text x="{x}" y="{y}" font-weight="bold">bandwidth roofs (GFLOP/s = I × '
             'GB/s)</text>')
    for col, rw in enumerate((False, True)):
        yy = y + 24
        lx = x + col * (width // 2)
        for lab, _, color, dash in [r for r in roofs if bool(r[3]) == rw]:
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            o.append(f'<line x1="{lx}" y1="{yy - 4}" x2="{lx + 34}" y2="{yy - 4}" stroke="{color}" '
                     f'stroke-width="2.2"{dash_attr}/>')
            o.append(f'<text x="{lx + 42}" y="{yy}">{escape(lab)}</text>')
            yy += 22


def roofline_plot(res: Results, path: str) -> bool:
    """docs/roofline_plot.svg: log-log GFLOP/s against arithmetic intensity, the roofs measured by
    bench_roofline (FMA peak, float; read bandwidth of L1, L2, L3 and memory, read + write of the
    same levels dashed) and a point per kernel (H = 8, D = M = 64, float, one thread,
    N = ROOF_N). False without
    bench_roofline's float peak."""
    roof = res.roof
    peak = roof.gflops("f32")
    if not peak:
        return False
    pts = []
    for label, cost, kind, layout, color, marker in ROOF_POINTS:
        r = roof_run(res, label, kind, 64, layout)
        g = r.gflops() if r else None
        if g:
            flops, nbytes = kernel_cost(cost, 64, 64)
            at = f", N = {fmt_n(r.size)}" if cost != "decode" and r.size != ROOF_N else ""
            pts.append((f"{label}: {g:.1f}{at}", flops / nbytes, g, color, marker))
    roofs = []  # (label, bandwidth in bytes/s, colour, dash)
    for rw in (False, True):
        for lv in ROOF_LEVELS:
            if (lv, rw) in ROOF_LINE_STYLE and lv in (roof.rw if rw else roof.read):
                bw = roof.bandwidth(lv, rw)
                color, dash = ROOF_LINE_STYLE[(lv, rw)]
                roofs.append((f"{'read + write' if rw else 'read'}, {LEVEL_LABEL[lv]}: "
                              f"{bw / 1e9:.1f} GB/s", bw, color,
                              dash))

    legend_h = roof_legend_height(roofs)
    W, H = 900, 620 + legend_h
    ml, mr, mt, mb = 90, 30, 60, 70 + legend_h
    pw, ph = W - ml - mr, H - mt - mb
    xs = [p[1] for p in pts] + [peak * 1e9 / bw for _, bw, _, _ in roofs]
    if not xs:
        return False
    ys = [p[2] for p in pts] + [peak]
    x0, x1 = math.floor(math.log10(min(xs) / 2)), math.ceil(math.log10(max(xs) * 3))
    y0, y1 = math.floor(math.log10(min(ys) / 2)), math.ceil(math.log10(peak * 1.5))
    if x1 - x0 < 2:
        x1 = x0 + 2
    if y1 - y0 < 2:
        y0 = y1 - 2

    def X(v):
        return ml + (math.log10(v) - x0) / (x1 - x0) * pw

    def Y(v):
        return mt + ph - (math.log10(v) - y0) / (y1 - y0) * ph

    o: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="13">',
        f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2:.0f}" y="28" text-anchor="middle" font-size="17" font-weight="bold">'
        'linattn under the roofline of one core</text>',
        f'<text x="{W / 2:.0f}" y="47" text-anchor="middle" fill="#444">float, H = 8, D = M = 64, '
        f'N = {fmt_n(ROOF_N)}, '
        'one thread; roofs from bench_roofline, same run (wall time) — log-log</text>']
    box = (ml, mt, pw, ph)
    svg_log_grid(o, y0, y1, Y, True, box)
    svg_log_grid(o, x0, x1, X, False, box)
    o.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
    o.append(f'<text x="{ml + pw / 2:.0f}" y="{mt + ph + 48}" text-anchor="middle" '
             'font-size="14">arithmetic intensity '
             '(useful flop per byte of compulsory traffic; log scale)</text>')
    o.append(f'<text transform="translate(22,{mt + ph / 2:.0f}) rotate(-90)" text-anchor="middle" '
             'font-size="14">GFLOP/s (useful flops; log scale)</text>')
    # Roofs: each bandwidth's slope up to its ridge point, then the FMA peak.
    lo_i, hi_i = 10.0 ** x0, 10.0 ** x1
    for _, bw, color, dash in roofs:
        ridge = peak * 1e9 / bw
        a = max(lo_i, 10.0 ** y0 * 1e9 / bw)
        if a < ridge:
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            o.append(f'<line x1="{X(a):.1f}" y1="{Y(a * bw * 1e-9):.1f}" x2="{X(ridge):.1f}" '
                     f'y2="{Y(peak):.1f}" '
                     f'stroke="{color}" stroke-width="2.2"{dash_attr}/>')
    left = min([peak * 1e9 / bw for _, bw, _, _ in roofs] or [lo_i])
    o.append(f'<line x1="{X(max(left, lo_i)):.1f}" y1="{Y(peak):.1f}" x2="{X(hi_i):.1f}" '
             f'y2="{Y(peak):.1f}" '
             'stroke="black" stroke-width="2.5"/>')
    o.append(f'<text x="{ml + pw - 6}" y="{Y(peak) - 7:.1f}" text-anchor="end">FMA peak, float '
             f'({escape(roof.isa_of("f32"))}): {peak:.1f} GFLOP/s</text>')
    # Points and their labels.
    markers = [(X(i) - 6, Y(g) - 6, X(i) + 6, Y(g) + 6) for _, i, g, _, _ in pts]
    for _, i, g, color, marker in pts:
        o.append(svg_marker(marker, X(i), Y(g), color))
    peak_label = (ml + pw - 6 - 7.0 * 48, Y(peak) - 20, ml + pw, Y(peak) - 3)
    labels = place_labels([(X(i), Y(g), text) for text, i, g, _, _ in pts], markers + [peak_label],
                          (ml + 2, mt + 2, ml + pw - 2, mt + ph - 2), char_w=6.6)
    for (tx, ty, anchor, text), (_, i, g, color, _) in zip(labels, pts):
        px, py = X(i), Y(g)
        if abs(ty - 4 - py) > 6:
            o.append(f'<line x1="{px:.1f}" y1="{py:.1f}" '
                     f'x2="{tx + (-3 if anchor == "start" else 3):.1f}" '
                     f'y2="{ty - 4:.1f}" stroke="{color}" stroke-width="0.8"/>')
        o.append(f'<text x="{tx:.1f}" y="{ty:.1f}" text-anchor="{anchor}" font-size="12" '
                 f'fill="{color}">'
                 f'{escape(text)}</text>')
    roof_legend(o, roofs, ml, mt + ph + 76, pw)
    return write_svg(path, o)


GEN_LINE_MIN_POINTS = 5


def gen_plot(res: Results, path: str) -> bool:
    """docs/generation_plot.svg: time per token against position (batch 1, the largest model),
    log y."""
    models = [m for m, _ in GEN_MODELS if res.sizes("gen_step", model=m, attn="linear", batch="1")]
    if not models:
        return False
    m = "img3072" if "img3072" in models else models[0]
    colors = {"linear": "#2ca02c", "kv": "#ff7f0e", "softmax": "#d62728"}
    series = [(t, colors[a], gen_step_times(res, m, a, 1)) for a, t in GEN_ATTN]
    series = [s for s in series if s[2]]
    # The legend sits below the plot (no point hides behind it, wherever the steps land).
    legend_h = 22 * len(series) + 12
    W, H = 900, 560 + legend_h
    ml, mr, mt, mb = 90, 30, 60, 70 + legend_h
    pw, ph = W - ml - mr, H - mt - mb
    xs = [x for _, _, p in series for x, _ in p]
    ys = [y for _, _, p in series for _, y in p]
    x1 = max(xs)
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    if y1 - y0 < 2:
        y1 = y0 + 2

    pad = 0.015 * x1  # so that the markers at the first and last positions clear the frame

    def X(v):
        return ml + (v + pad) / (x1 + 2 * pad) * pw

    def Y(v):
        return mt + ph - (math.log10(v) - y0) / (y1 - y0) * ph

    lab = dict(GEN_MODELS)[m]
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
         'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="13">',
         f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2:.0f}" y="28" text-anchor="middle" font-size="17" font-weight="bold">'
         f'Generating an image: time per token vs position</text>',
         f'<text x="{W / 2:.0f}" y="47" text-anchor="middle" fill="#444">{escape(lab)}, d_model '
         '256, 8 heads, '
         'batch 1, float, one thread — log y</text>']
    for e in range(y0, y1 + 1):
        y = Y(10.0 ** e)
        o.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}" stroke="#cccccc"/>')
        o.append(f'<text x="{ml - 9}" y="{y + 4:.1f}" '
                 f'text-anchor="end">{escape(decade_label(e))}</text>')
    for k in range(0, 9):
        v = x1 * k / 8
        x = X(v)
        o.append(f'<line x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{mt + ph}" stroke="#eeeeee"/>')
        o.append(f'<text x="{x:.1f}" y="{mt + ph + 21}" '
                 f'text-anchor="middle">{int(round(v))}</text>')
    o.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
    o.append(f'<text x="{ml + pw / 2:.0f}" y="{mt + ph + 48}" text-anchor="middle" '
             'font-size="14">position of the '
             'token</text>')
    o.append(f'<text transform="translate(22,{mt + ph / 2:.0f}) rotate(-90)" text-anchor="middle" '
             'font-size="14">time per token (log scale)</text>')
    # A series sampled at a few positions (the recomputed prefix: its steps are slow) is drawn as
    # its points alone: a straight segment between far-apart samples on a log axis would draw a kink
    # and a shape that was not measured.
    sparse = {t for t, _, pts in series if len(pts) < GEN_LINE_MIN_POINTS}
    for t, c, pts in series:
        if t not in sparse:
            d = " ".join(f"{'M' if i == 0 else 'L'}{X(x):.1f},{Y(y):.1f}" for i,
                         (x, y) in enumerate(pts))
            o.append(f'<path d="{d}" fill="none" stroke="{c}" stroke-width="2.2"/>')
        for x, y in pts:
            o.append(svg_marker("square" if t in sparse else "circle", X(x), Y(y), c))
    lx, yy = ml - 10, mt + ph + 80
    for t, c, pts in series:
        if t in sparse:
            o.append(svg_marker("square", lx + 27, yy - 4, c))
            t += f" (measured at {len(pts)} positions)"
        else:
            o.append(f'<line x1="{lx + 10}" y1="{yy - 4}" x2="{lx + 44}" y2="{yy - 4}" '
                     f'stroke="{c}" '
                     'stroke-width="2.2"/>')
            o.append(svg_marker("circle", lx + 27, yy - 4, c))
        o.append(f'<text x="{lx + 52}" y="{yy}">{escape(t)}</text>')
        yy += 22
    return write_svg(path, o)
