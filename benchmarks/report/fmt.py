"""Text: number formats, Markdown tables and the status cells of the targets."""

from __future__ import annotations

import re
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .results import Run


def fmt_time(s: float | None) -> str:
    if s is None:
        return "–"
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        v = s * 1e3
        return f"{v:.1f} ms" if v >= 10 else f"{v:.2f} ms"
    v = s * 1e6
    return f"{v:.1f} µs" if v >= 10 else f"{v:.2f} µs"


def decade_label(e: int) -> str:
    """10**e seconds as a short axis label: 1 µs, 10 µs, ..., 1 s, 10 s, 100 s."""
    for unit, base in (("s", 0), ("ms", -3), ("µs", -6), ("ns", -9)):
        if e >= base:
            return f"{10 ** (e - base)} {unit}"
    return f"1e{e} s"


def fmt_secs(s: float | None) -> str:
    """Seconds without the unit (it is in the column's header), as precise as fmt_time."""
    if s is None:
        return "–"
    if s >= 1.0:
        return f"{s:.2f}"
    return f"{s:.4f}" if s >= 1e-2 else f"{s:.5f}" if s >= 1e-3 else f"{s:.3g}"


def fmt_ms(s: float | None) -> str:
    return "–" if s is None else f"{s * 1e3:.1f}"


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "–"
    b = float(b)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{int(b)} B"


def fmt_ratio(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def fmt_n(n: int) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or ("l" + "r" * (len(header) - 1))
    sep = ["---:" if a == "r" else ":---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


# What a Markdown line must not start with, lest it become a list item, a quote, a heading, a
# table row or a setext underline.
BLOCK_START = re.compile(r"([-+*>#=|]|\d{1,9}[.)])(\s|$)")
PROSE_WIDTH = 100


def wrap(text: str, width: int = PROSE_WIDTH) -> list[str]:
    """A Markdown paragraph as lines of at most `width` columns (a longer word stays whole)."""
    # A code span stays on one line: its spaces are hidden from textwrap.
    text = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), text)
    lines = [line.replace("\0", " ") for line in
             textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)]
    for i in range(1, len(lines)):
        # Moving the first word up keeps it a paragraph; the line then runs a little over.
        while BLOCK_START.match(lines[i]) and " " in lines[i]:
            word, lines[i] = lines[i].split(" ", 1)
            lines[i - 1] += " " + word
    return lines


def escape_md(s: str) -> str:
    return s.replace("|", "\\|")


def wall_cpu(x: float | None, xc: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.2f} ({xc:.2f})" if xc is not None else f"{x:.2f}"


def speed_ratio(a: Run | None, b: Run | None) -> str:
    """a time ÷ b time, wall (cpu)."""
    if not a or not b or b.wall <= 0 or b.cpu <= 0:
        return "–"
    return f"{a.wall / b.wall:.2f} ({a.cpu / b.cpu:.2f})"


def speedup(base: Run | None, r: Run | None) -> str:
    """base time ÷ r time, wall (cpu)."""
    if not base or not r or r.wall <= 0 or r.cpu <= 0:
        return "–"
    return f"{base.wall / r.wall:.2f}× ({base.cpu / r.cpu:.2f}×)"


def at_most_status(x: float | None, xc: float | None, target: float) -> tuple[str, str]:
    """(status cell, warning text or '') of a ratio that must stay ≤ target, judged on wall time,
    as section 11."""
    if x is None:
        return "not measured", ""
    if x <= target:
        return "met", ""
    if xc is not None and xc <= target:
        return "met on cpu time only", "met on cpu time only"
    return "**missed**", "missed"
