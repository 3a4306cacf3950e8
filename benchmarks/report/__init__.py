"""The linattn benchmark report: reads the Google Benchmark JSON of benchmarks/run.sh and writes
the summary of the performance targets, the Markdown report, its SVG plots and README.md's
headline table. What the figures mean is in docs/benchmarks.md.

Modules: results (loading), roof and roofline (this core's limits and the kernels under them),
fmt (text tables), svg and plots, splice (README markers), one module per benchmark family
(kernels, layouts, gradients, serving, gated, delta, generation), summary, headline, tables,
machine, document, cli.
"""
