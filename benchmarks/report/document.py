"""The Markdown report: the generated blocks of docs/benchmarks.md, spliced into its text.

docs/benchmarks.md is the template: its prose (what is measured, how, why) is written by hand
there and only there; this module writes the blocks between its bench:<name> markers.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from .fmt import escape_md, table
from .generation import generation
from .gdn_layer import gdn_layer_section
from .headline import headline
from .kda import batched_decode_section, kda_section
from .kda_layer import kda_layer_section
from .machine import machine_info
from .splice import splice
from .tables import fit_table, full_tables, memory_table

if TYPE_CHECKING:
    from .results import Results


# The blocks of the template, in its order.
BLOCKS = ("run", "machine", "caps", "headline", "kda", "batched_decode", "gdn_layer", "kda_layer",
          "results")


def blocks(res: Results, svg_name: str | None, command: str, load_before: str,
           summary_lines: list[str],
           warnings: list[str], noise: str, gen_svg_name: str | None = None) -> dict[str,
                                                                                     list[str]]:
    """The generated text of each marker pair of the template."""
    ctx_notes = [(p, c.get("linattn_notes", "")) for p, c in sorted(res.contexts.items())]
    out: dict[str, list[str]] = {
        "run": ["```sh", command, "```"],
        "machine": table(["", ""], [[k, escape_md(v)] for k, v in machine_info(res, load_before)],
                         "ll") +
        ["", noise],
        "caps": [f"- `{p}`: {escape_md(n)}" for p, n in ctx_notes if n],
        "headline": headline(res, load_before, "this page"),
        # Sections of their own, each naming the run it came from (report.py --only refreshes
        # them from a run of their programs alone).
        "kda": kda_section(res, [], command),
        "batched_decode": batched_decode_section(res, [], command),
        "gdn_layer": gdn_layer_section(res, [], command),
        "kda_layer": kda_layer_section(res, [], command),
    }
    L = ["## Summary of the performance targets", ""]
    L += summary_lines
    if warnings:
        L += ["", "Warnings:", ""] + [f"- {escape_md(w)}" for w in warnings]
    if svg_name:
        L += ["", "## Time vs N", "", f"![time vs N, log-log]({svg_name})", ""]
    if res.sizes("gen_step", attn="linear", batch="1", model="img784") or \
            res.sizes("gen_step", attn="linear", batch="1", model="img3072"):
        L += ["", "## Image generation (the paper's §4.2)", ""]
        L += generation(res)
        if gen_svg_name:
            L += ["", f"![time per token vs position]({gen_svg_name})", ""]
    L += ["", "## Working memory of every kernel", "",
          "`Workspace::bytes()` after the calls at the smallest and the largest size of each sweep "
          "(decode: position); state_bytes is the recurrent state or KV "
          "cache.", ""] + memory_table(res)
    L += ["", "## Complexity fits", ""] + fit_table(res)
    L += ["", "## All results"] + full_tables(res)
    if res.errors:
        L += ["", "## Errors", ""] + [f"- {escape_md(e)}" for e in res.errors]
    out["results"] = L
    return out


def relink(text: str, src_dir: str, dst_dir: str) -> str:
    """The template's relative Markdown links, made relative to the page's new directory."""
    if os.path.abspath(src_dir) == os.path.abspath(dst_dir):
        return text

    def fix(m: re.Match) -> str:
        target = os.path.relpath(os.path.join(src_dir, m.group(1)), dst_dir).replace(os.sep, "/")
        return f"]({target}{m.group(2) or ''})"

    return re.sub(r"\]\((?!https?:|#|/)([^)\s#]+)(#[^)\s]*)?\)", fix, text)


def write_markdown(res: Results, path: str, template: str, svg_name: str | None, command: str,
                   load_before: str, summary_lines: list[str], warnings: list[str], noise: str,
                   gen_svg_name: str | None = None, only: list[str] | None = None) -> list[str]:
    """Writes the template with its blocks filled to `path` (the template itself with --docs);
    returns the names of the blocks whose markers the template lacks (nothing written then).
    `only`: fill these blocks and leave the others as the template has them."""
    with open(template, encoding="utf-8") as f:
        text = f.read()
    text = relink(text, os.path.dirname(os.path.abspath(template)),
                  os.path.dirname(os.path.abspath(path)))
    missing = []
    for name, block in blocks(res, svg_name, command, load_before, summary_lines, warnings, noise,
                              gen_svg_name).items():
        if only is not None and name not in only:
            continue
        new = splice(text, name, block)
        if new is None:
            missing.append(name)
        else:
            text = new
    if missing:
        return missing
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.rstrip() + "\n")
    return []
