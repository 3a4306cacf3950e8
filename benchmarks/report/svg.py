"""Writing SVG by hand (no third-party packages): documents, log grids, markers, label placement."""

from __future__ import annotations

import os


def svg_marker(marker: str, cx: float, cy: float, color: str) -> str:
    if marker.endswith("square"):
        fill = "white" if marker.startswith("open") else color
        return (f'<rect x="{cx - 4.5:.1f}" y="{cy - 4.5:.1f}" width="9" height="9" fill="{fill}" '
                f'stroke="{color}" '
                'stroke-width="1.8"/>')
    if marker == "diamond":
        return (f'<path d="M{cx:.1f},{cy - 6:.1f} L{cx + 6:.1f},{cy:.1f} L{cx:.1f},{cy + 6:.1f} '
                f'L{cx - 6:.1f},{cy:.1f} Z" fill="{color}"/>')
    fill = "white" if marker.startswith("open") else color
    return (f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4.5" fill="{fill}" stroke="{color}" '
            'stroke-width="1.8"/>')


def place_labels(points: list[tuple[float, float, str]],
                 obstacles: list[tuple[float, float, float, float]],
                 bounds: tuple[float, float, float, float], char_w: float = 7.0,
                 line_h: float = 15.0) -> list[tuple[float, float, str, str]]:
    """Positions (x, y of the text baseline, anchor, text), in the order given, for labels of
    points (x, y,
    text), placed from the top down: right of the
    point, else moved up or down, else left of it, so that no two labels and no label and marker
    overlap
    (as far as the candidates allow). obstacles: boxes (x0, y0, x1, y1); bounds: the plot area."""
    placed: list[tuple[float, float, float, float]] = []
    out: list[tuple[float, float, str, str]] = [(0.0, 0.0, "start", "")] * len(points)
    bx0, by0, bx1, by1 = bounds

    def free(box):
        x0, y0, x1, y1 = box
        if x0 < bx0 or x1 > bx1 or y0 < by0 or y1 > by1:
            return False
        return all(x1 <= a0 or x0 >= a1 or y1 <= b0 or y0 >= b1 for a0, b0, a1,
                   b1 in placed + obstacles)

    for k in sorted(range(len(points)), key=lambda k: points[k][1]):  # top to bottom
        px, py, text = points[k]
        w = char_w * len(text)
        choice = None
        for dy in [0.0] + [s * k * line_h for k in range(1, 9) for s in (1, -1)]:
            for side in ("start", "end"):
                x0 = px + 9 if side == "start" else px - 9 - w
                box = (x0, py + dy - 10, x0 + w, py + dy + 4)
                if free(box):
                    choice = (px + 9 if side == "start" else px - 9, py + dy + 4, side, box)
                    break
            if choice:
                break
        if choice is None:
            choice = (px + 9, py + 4, "start", (px + 9, py - 10, px + 9 + w, py + 4))
        placed.append(choice[3])
        out[k] = (choice[0], choice[1], choice[2], text)
    return out


def write_svg(path: str, o: list[str]) -> bool:
    """Closes the SVG document of lines o and writes it to path (creating its directory)."""
    o.append("</svg>")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(o) + "\n")
    return True


def svg_log_grid(o: list[str], e0: int, e1: int, pos, horizontal: bool,
                 box: tuple[float, float, float, float]) -> None:
    """One axis of a log-log plot: a labelled line per decade 10^e0 … 10^e1 and lighter lines
    at 2…9 times each decade but the last; pos maps a value to its pixel coordinate."""
    ml, mt, pw, ph = box
    for e in range(e0, e1 + 1):
        lines = [(pos(10.0 ** e), "#cccccc")]
        if e < e1:
            lines += [(pos(m * 10.0 ** e), "#f0f0f0") for m in range(2, 10)]
        for p, colour in lines:
            if horizontal:
                o.append(f'<line x1="{ml}" y1="{p:.1f}" x2="{ml + pw}" y2="{p:.1f}" '
                         f'stroke="{colour}"/>')
            else:
                o.append(f'<line x1="{p:.1f}" y1="{mt}" x2="{p:.1f}" y2="{mt + ph}" '
                         f'stroke="{colour}"/>')
        p = lines[0][0]
        if horizontal:
            o.append(f'<text x="{ml - 9}" y="{p + 4:.1f}" text-anchor="end">{10.0 ** e:g}</text>')
        else:
            o.append(f'<text x="{p:.1f}" y="{mt + ph + 21}" '
                     f'text-anchor="middle">{10.0 ** e:g}</text>')
