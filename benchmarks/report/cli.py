"""Summarise the linattn benchmark JSON (Google Benchmark --benchmark_out) files.

    python3 benchmarks/report.py --results build/bench/results \
        [--md build/bench/report/benchmarks.md] [--svg build/bench/report/benchmark_plot.svg] \
        [--readme README.md] [--command "..."]
    (or, from benchmarks/: python3 -m report ...)

Prints the headline figures and the summary of the performance targets (ratios computed from the
JSON). --md writes the report: the text of --template (docs/benchmarks.md) with the blocks between
its bench:<name> markers generated from the results; --svg the log-log plot, with the roofline and
generation plots beside it; --readme rewrites the bench:headline and bench:generation blocks of
README.md. benchmarks/run.sh writes them under build/bench/report/ unless asked for the committed
docs (--docs). docs/benchmarks.md says what is measured and how.
"""

from __future__ import annotations

import argparse
import os
import sys

from .document import write_markdown
from .generation import generation
from .headline import headline
from .gdn_layer import gdn_layer_section
from .kda import batched_decode_section, kda_section
from .kda_layer import kda_layer_section
from .plots import gen_plot, roofline_plot, svg_plot
from .results import Results, contention
from .splice import update_readme
from .summary import summary


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TEMPLATE = os.path.join(REPO, "docs", "benchmarks.md")


def sibling_plot(args, name: str, plot) -> str | None:
    """With --svg, plot(path) writes the plot `name` next to the --svg file; returns its path
    relative to the markdown (for the link), or None when there was nothing to plot."""
    if not args.svg:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(args.svg)), name)
    if not plot(path):
        return None
    print(f"wrote {path}")
    return os.path.relpath(path, os.path.dirname(os.path.abspath(args.md or args.svg)))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="build/bench/results", help="directory of the "
                                                                     "bench_*.json files")
    ap.add_argument("--md", help="write the Markdown report here (e.g. "
                                 "build/bench/report/benchmarks.md)")
    ap.add_argument("--template", default=DEFAULT_TEMPLATE,
                    help="the page whose bench:<name> blocks --md fills (default: "
                         "docs/benchmarks.md)")
    ap.add_argument("--svg", help="write the log-log plot here (e.g. docs/benchmark_plot.svg)")
    ap.add_argument("--command", default="bash .ci/bench", help="the command that produced the "
                                                                "results")
    ap.add_argument("--load-before", default="unknown", help="load average when the run started")
    ap.add_argument("--readme", help="rewrite the headline table between the bench:headline "
                                     "markers of this "
                                     "README.md")
    ap.add_argument("--only", help="comma-separated blocks to fill (e.g. kda,batched_decode or "
                                   "gdn_layer, kda_layer: "
                                   "the results of those programs alone); the template's other "
                                   "blocks are left as they are")
    args = ap.parse_args(argv)
    only = [b.strip() for b in args.only.split(",") if b.strip()] if args.only else None

    if args.md and not os.path.isfile(args.template):
        print(f"report.py: no template {args.template} (the page whose bench:<name> blocks --md "
              "fills)",
              file=sys.stderr)
        return 1
    res = Results(args.results)
    if not res.runs:
        print(f"report.py: no benchmark results in {args.results}", file=sys.stderr)
        return 1
    roof_svg_name = sibling_plot(args, "roofline_plot.svg", lambda path: roofline_plot(res, path))
    lines, warnings = summary(res, roof_svg_name)
    _, noise = contention(res)
    print("== Headline figures")
    print("\n".join(headline(res, args.load_before, "docs/benchmarks.md")))
    print()
    print("== Summary of the performance targets (ratios from " + args.results + ")")
    print("\n".join(lines))
    print()
    own: list[str] = []
    print("== KDA, shared key heads")
    print("\n".join(kda_section(res, own, args.command)))
    print()
    print("== Batched gated / delta decode, extend")
    print("\n".join(batched_decode_section(res, own, args.command)))
    print()
    print("== Gated DeltaNet layer (Qwen3-Next shape)")
    print("\n".join(gdn_layer_section(res, own, args.command)))
    print()
    print("== KDA layer (Kimi Linear shape)")
    print("\n".join(kda_layer_section(res, own, args.command)))
    print()
    for w in warnings + own:
        print("warning:", w)
    if noise:
        print(noise)
    for e in res.errors:
        print("error:", e)

    svg_name = None
    if args.svg:
        if svg_plot(res, args.svg):
            svg_name = os.path.relpath(os.path.abspath(args.svg),
                                       os.path.dirname(os.path.abspath(args.md or args.svg)))
            print(f"wrote {args.svg}")
        else:
            print("report.py: nothing to plot", file=sys.stderr)
    gen_svg_name = sibling_plot(args, "generation_plot.svg", lambda path: gen_plot(res, path))
    print("== Image generation")
    print("\n".join(generation(res)))
    if args.md:
        missing = write_markdown(res, args.md, args.template, svg_name, args.command,
                                 args.load_before, lines,
                                 warnings, noise, gen_svg_name, only)
        if missing:
            print(f"report.py: {args.template} lacks the markers of the blocks "
                  f"{', '.join(missing)} "
                  "(<!-- bench:NAME:begin --> ... <!-- bench:NAME:end -->); nothing "
                  "written", file=sys.stderr)
            return 1
        print(f"wrote {args.md}")
    if args.readme:
        block = headline(res, args.load_before, "[docs/benchmarks.md](docs/benchmarks.md)")
        if update_readme(args.readme, block):
            print(f"wrote the headline table of {args.readme}")
        else:
            print(f"report.py: no bench:headline markers in {args.readme}; left "
                  "unchanged", file=sys.stderr)
        if res.sizes("gen_step", model="img784", attn="linear", batch="1"):
            if update_readme(args.readme, generation(res, table_only=True), "generation"):
                print(f"wrote the generation table of {args.readme}")
    return 0
