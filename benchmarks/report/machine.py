"""The machine the results came from: CPU, caches, compiler, load."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from typing import TYPE_CHECKING

from .fmt import fmt_bytes

if TYPE_CHECKING:
    from .results import Results


def run_cmd(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    for line in run_cmd(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine_info(res: Results, load_before: str) -> list[tuple[str, str]]:
    ctx = res.context()
    model = cpu_model()
    caches = ", ".join(f"L{c['level']} {c['type'].lower()} {fmt_bytes(c['size'])}"
                       + (f" (shared by {c['num_sharing']})" if c.get("num_sharing", 1) > 1 else "")
                       for c in ctx.get("caches", []))
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            load_after = " ".join(f.read().split()[:3])
    except OSError:
        load_after = "unknown"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    commit = run_cmd(["git", "-C", repo, "rev-parse", "--short", "HEAD"]).strip() or "unknown"
    loads = ", ".join(f"{c.get('executable', p).split('/')[-1]}: "
                      f"{' '.join(f'{x:.2f}' for x in c.get('load_avg', []))}"
                      for p, c in sorted(res.contexts.items()))
    return [
        ("CPU", f"{model} — {ctx.get('num_cpus', '?')} CPUs at {ctx.get('mhz_per_cpu', '?')} MHz "
                f"({platform.machine()}, {platform.system()} {platform.release()})"),
        ("Caches", caches or "unknown"),
        ("Compiler", ctx.get("linattn_compiler", "unknown")),
        ("Flags", f"{ctx.get('linattn_cxx_flags', 'unknown')} "
                  f"(CMAKE_BUILD_TYPE={ctx.get('linattn_build_type', '?')})"),
        ("Eigen", ctx.get("linattn_eigen", "unknown") + "; compiled for "
                                                        "" + ctx.get("linattn_isa", "?") +
         "; Eigen's own GEMM threading off (Eigen::setNbThreads(1))"),
        ("OpenMP", ctx.get("linattn_openmp", "unknown")),
        ("Google Benchmark library build", ctx.get("library_build_type", "unknown") +
         " (the Debian package; it only affects the harness, not the kernels)"),
        ("Profile", ctx.get("linattn_profile", "unknown")),
        ("linattn commit", commit),
        ("Load average", f"before the run {load_before}; at the start of each program: {loads}; "
                         f"after {load_after}"),
        ("Date", ctx.get("date", _dt.datetime.now().isoformat(timespec="seconds"))),
    ]
