#!/usr/bin/env bash
# Runs the linattn benchmark programs, keeps their JSON, and writes the report.
#
#   benchmarks/run.sh [--full | --smoke] [--out DIR] [--build DIR] [--docs] [-- ARGS...]
#
#   (default)   quick profile: N up to 16384, D = M = 64, a few minutes on 2 cores
#   --full      N up to 65536, D = M in {32, 64, 128}, every variant (long)
#   --smoke     smallest sizes only (checks that everything runs)
#   --out DIR   where the JSON goes (default: <build>/results)
#   --build DIR the CMake build directory (default: $LINATTN_BENCH_BUILD_DIR or build/bench)
#   --docs      write the committed pages instead (or LINATTN_BENCH_DOCS=1; not with --smoke):
#               docs/benchmarks.md's generated blocks, docs/benchmark_plot.svg, roofline_plot.svg,
#               generation_plot.svg, docs/feature_maps.md with its plot, README.md's bench:* blocks
#   --no-docs   the default: leave them as they are
#   -- ARGS     passed to every benchmark program (e.g. -- --benchmark_filter=mh_)
#
# Build first (bash .ci/bench does both):
#   cmake -S . -B build/bench -DCMAKE_BUILD_TYPE=Release -DLINATTN_BUILD_BENCHMARKS=ON \
#     -DLINATTN_BUILD_TESTS=OFF -DLINATTN_BUILD_EXAMPLES=OFF && cmake --build build/bench -j2
#
# The report (benchmarks/report.py, the package benchmarks/report/) prints the summary of the
# performance targets and writes the pages and plots under <build>/report/; with --docs, into
# docs/ and README.md instead.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

orig_args=("$@")
profile=quick
out=""
build="${LINATTN_BENCH_BUILD_DIR:-$repo/build/bench}"
docs="${LINATTN_BENCH_DOCS:-0}"
extra=()
while (($# > 0)); do
  case "$1" in
    --full) profile=full ;;
    --smoke) profile=smoke ;;
    --quick) profile=quick ;;
    --out) out="${2:?--out needs a directory}"; shift ;;
    --out=*) out="${1#--out=}" ;;
    --build) build="${2:?--build needs a directory}"; shift ;;
    --build=*) build="${1#--build=}" ;;
    --docs) docs=1 ;;
    --no-docs) docs=0 ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$docs" == 1 ]] || docs=0
if [[ "$profile" == smoke && "$docs" == 1 ]]; then
  echo "run.sh: --smoke leaves the committed figures as they are (no --docs)" >&2
  docs=0
fi

manifest="${LINATTN_BENCH_MANIFEST:-$build/benchmarks/linattn_benchmarks.txt}"
if [[ ! -s "$manifest" ]]; then
  echo "run.sh: no benchmark manifest at $manifest; build the benchmarks first (bash .ci/bench)" >&2
  exit 1
fi
mapfile -t binaries < <(grep -v '^[[:space:]]*$' "$manifest")
if ((${#binaries[@]} == 0)); then
  echo "run.sh: no benchmarks are built (see benchmarks/CMakeLists.txt)" >&2
  exit 1
fi

out="${out:-$build/results}"
mkdir -p "$out"
rm -f "$out"/bench_*.json "$out"/feature_map_*.json

# The command a reader can rerun (recorded in docs/benchmarks.md).
if [[ -n "${LINATTN_BENCH_MANIFEST:-}" ]]; then
  command="bash .ci/bench"
else
  command="bash benchmarks/run.sh"
fi
((${#orig_args[@]} > 0)) && command+=" ${orig_args[*]}"

load_before="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
echo "== linattn benchmarks: profile $profile, results in $out (load average $load_before)"

failed=()
for bin in "${binaries[@]}"; do
  name="$(basename "$bin")"
  if [[ ! -x "$bin" ]]; then
    echo "run.sh: $bin is not built" >&2
    failed+=("$name")
    continue
  fi
  own=()
  # feature_map_quality's study (errors against softmax) goes to a file of its own.
  [[ "$name" == feature_map_quality ]] && own=("--quality_out=$out/feature_map_errors.json")
  echo "== $name --$profile"
  if ! "$bin" "--$profile" "--benchmark_out=$out/$name.json" --benchmark_out_format=json \
    "${own[@]}" "${extra[@]}"; then
    echo "run.sh: $name failed" >&2
    failed+=("$name")
  fi
done

# Where the pages and plots go: <build>/report/, or the committed docs/ and README.md.
if ((docs)); then
  pages="$repo/docs"
else
  pages="$build/report"
fi
mkdir -p "$pages"
report=(python3 "$repo/benchmarks/report.py" --results "$out" --command "$command"
  --load-before "$load_before" --template "$repo/docs/benchmarks.md"
  --md "$pages/benchmarks.md" --svg "$pages/benchmark_plot.svg")
((docs)) && report+=(--readme "$repo/README.md")
echo "== ${report[*]}"
"${report[@]}"

# feature_maps.md and its plot, from feature_map_quality's study and timings.
# Not after a run narrowed by ARGS (a filter would leave the page without its timings).
fm_errors="$out/feature_map_errors.json" fm_timings="$out/feature_map_quality.json"
if ((${#extra[@]} == 0)) && [[ -s "$fm_errors" && -s "$fm_timings" ]]; then
  fm=(python3 "$repo/benchmarks/feature_map_report.py" --errors "$fm_errors"
    --timings "$fm_timings" --md "$pages/feature_maps.md"
    --svg "$pages/feature_maps_plot.svg" --command "$command")
  echo "== ${fm[*]}"
  "${fm[@]}" || failed+=(feature_map_report.py)
fi

echo "== results (JSON): $out"
if ((docs)); then
  echo "== report: $pages/benchmarks.md, its plots and feature_maps.md; README.md's bench:* blocks"
else
  echo "== report: $pages/benchmarks.md, its plots and feature_maps.md (docs/ and README.md left as"
  echo "   they are; --docs or LINATTN_BENCH_DOCS=1 rewrites them)"
fi

if ((${#failed[@]} > 0)); then
  echo "run.sh: failed: ${failed[*]}" >&2
  exit 1
fi
