"""This core's limits measured by bench_roofline, and the cache sizes that place a working set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fmt import fmt_bytes

if TYPE_CHECKING:
    from .results import Run


ROOF_LEVELS = ("L1", "L2", "L3", "mem")
CACHE_LEVELS = ("L1", "L2", "L3")
LEVEL_LABEL = {"L1": "L1", "L2": "L2", "L3": "L3", "mem": "memory"}

# Sizes that place a working set in a level when the JSON's context does not list that cache (Google
# Benchmark finds none in this VM): one core's L1D and L2, 48 KiB and 1 MiB, and the L3 its cores
# share, 32 MiB, as on AMD Zen 4/5 (one CCD). Anything larger than L3 is taken to come from memory.
DEFAULT_CACHE_BYTES = {"L1": 48 << 10, "L2": 1 << 20, "L3": 32 << 20}


def cache_sizes(contexts: dict[str, dict]) -> tuple[dict[str, int], str]:
    """L1D, L2 and L3 sizes (bytes) from the first context that lists caches (Google Benchmark's
    `caches`: one entry per level and type, the size of one cache, L3 the whole of one shared
    L3), the levels it lacks from DEFAULT_CACHE_BYTES; and where they came from, naming what was
    assumed. A context that lists L1 and L2 but no L3 describes a core without one: no L3 level."""
    for c in contexts.values():
        found = {}
        for cache in c.get("caches", []):
            if cache.get("type", "").lower() in ("data", "unified") and cache.get("level") in (1, 2,
                                                                                               3) \
                    and cache.get("size"):
                found[f"L{cache['level']}"] = int(cache["size"])
        if not found:
            continue
        if "L1" in found and "L2" in found and "L3" not in found:
            return found, "the caches in the JSON's context, which lists no L3"
        missing = [lv for lv in CACHE_LEVELS if lv not in found]
        sizes = {lv: found.get(lv, DEFAULT_CACHE_BYTES[lv]) for lv in CACHE_LEVELS}
        if not missing:
            return sizes, "the caches in the JSON's context"
        return sizes, ("the caches in the JSON's context; assumed " +
                       ", ".join(f"{lv} {fmt_bytes(DEFAULT_CACHE_BYTES[lv])}" for lv in missing)
                       + ", not listed")
    return dict(DEFAULT_CACHE_BYTES), ("assumed, as on AMD Zen 4/5: L1D 48 KiB and L2 1 MiB per "
                                       "core, L3 32 MiB "
                                       "shared; the JSON's context lists no caches")


class Roofline:
    """This core's limits measured by bench_roofline (falsy when it did not run): the FMA peak per
    scalar type and per ISA, read and read + write bandwidths per level; and the cache sizes that
    say in which level a working set lives."""

    def __init__(self, runs: list[Run], contexts: dict[str, dict]):
        self.peak: dict[str, Run] = {}              # dtype -> roofline_fma_peak_<dtype>
        self.isa: dict[tuple[str, str], Run] = {}   # (dtype, isa) -> roofline_fma_isa
        self.read: dict[str, Run] = {}              # level -> roofline_read_bw/<level>
        self.rw: dict[str, Run] = {}                # level -> roofline_rw_bw/<level>
        for r in runs:
            parts = r.name.split("/")
            if r.kind.startswith("roofline_fma_peak_"):
                self.peak[r.kind.rsplit("_", 1)[1]] = r
            elif r.kind == "roofline_fma_isa":
                self.isa[(r.params.get("dtype", "?"), r.params.get("isa", "?"))] = r
            elif r.kind in ("roofline_read_bw", "roofline_rw_bw") and len(parts) > 1:
                (self.read if r.kind == "roofline_read_bw" else self.rw)[parts[1]] = r
        self.cache_bytes, self.cache_source = cache_sizes(contexts)

    def __bool__(self) -> bool:
        return bool(self.peak or self.read or self.rw)

    def peak_run(self, dtype: str = "f32", cpu: bool = False) -> Run | None:
        """The fastest FMA run of `dtype`: roofline_fma_peak_<dtype> or one of the per-ISA runs
        roofline_fma_isa/dtype:<dtype> (the same kernels; another process on the core can only
        slow a run down, so the fastest is the best estimate of the peak)."""
        runs = [r for r in [self.peak.get(dtype)] + [r for (d, _),
                                                     r in self.isa.items() if d == dtype]
                if r is not None and r.gflops(cpu)]
        return max(runs, key=lambda r: r.gflops(cpu)) if runs else None

    def gflops(self, dtype: str = "f32", cpu: bool = False) -> float | None:
        """The FMA peak of one core (GFLOP/s) for `dtype`."""
        r = self.peak_run(dtype, cpu)
        return r.gflops(cpu) if r else None

    def isa_of(self, dtype: str = "f32") -> str:
        """The ISA the peak was timed with: the first word of its label."""
        r = self.peak_run(dtype)
        return r.label.split(" ", 1)[0] if r and r.label else "?"

    def bandwidth(self, level: str, rw: bool = False, cpu: bool = False) -> float | None:
        """Bytes per second of one core at `level`: read, or read + write (rw). Where the results
        hold no read + write measurement of the level (older bench_roofline runs: none at L3 and
        memory), its read bandwidth stands in."""
        r = (self.rw.get(level) if rw else None) or self.read.get(level)
        if r is None:
            return None
        t = r.cpu if cpu else r.wall
        return bw_bytes(r) / t if t > 0 else None

    def level_of(self, nbytes: float, threads: int = 1) -> str:
        """The level a working set of `nbytes` (all threads together) lives in: the first cache it
        fits, else memory. L1D and L2 are private: each thread's share (nbytes ÷ threads) must fit
        one; L3 is shared by the cores: the whole must fit it."""
        for lv in CACHE_LEVELS:
            size = self.cache_bytes.get(lv)
            if size and (nbytes if lv == "L3" else nbytes / max(threads, 1)) <= size:
                return lv
        return "mem"

    def rw_fallback(self) -> list[str]:
        """The levels measured for read but not for read + write (their read bandwidth stands
        in)."""
        return [lv for lv in ROOF_LEVELS if lv in self.read and lv not in self.rw]

    def ridge(self, level: str, rw: bool = False, dtype: str = "f32") -> float | None:
        """Peak ÷ bandwidth (flop/byte): above it, a kernel whose data lives at `level` is
        compute-bound."""
        p, b = self.gflops(dtype), self.bandwidth(level, rw)
        return p * 1e9 / b if p and b else None


def bw_bytes(r: Run) -> float:
    """Bytes one iteration of a bandwidth benchmark moves (as it counts them: the buffer times the
    sweeps, twice for read + write)."""
    buf, sweeps = r.get("buffer_bytes"), r.get("sweeps")
    if buf and sweeps:
        return float(buf) * float(sweeps) * (2.0 if r.kind == "roofline_rw_bw" else 1.0)
    return float(r.get("GBps", 0.0)) * 1e9 * r.wall  # GBps: a rate over wall time
