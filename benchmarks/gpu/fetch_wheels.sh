#!/usr/bin/env bash
# Download, here (with network), the wheels the GPU machine lacks, for its Python 3.12 on manylinux x86_64, then
# check that the carried tree fits the device tool's limit:
#
#     benchmarks/gpu/fetch_wheels.sh DIR            then carry DIR to the GPU machine and run
#     benchmarks/gpu/run.sh RESULTS_DIR DIR         there (it installs them with --no-index from DIR)
#     benchmarks/gpu/fetch_wheels.sh --check DIR    the size check alone (no download)
#
# The list is benchmarks/gpu/requirements-gpu.txt (what the table's steps import that the machine's image lacks:
# tests/unit/test_gpu_table_imports.py keeps it complete). Only binary wheels (the GPU machine builds nothing); the
# platform tags cover manylinux2014 to manylinux_2_34. DIR should be inside the repository and ignored by git
# (`echo /.whl/ >> .git/info/exclude`), named in the call's `carry`.
#
# The size check: what git would carry (tracked files and untracked ones it does not ignore, as they are in the
# working tree) plus DIR's files that git does not already count, against CARRY_LIMIT_MIB (default 64, the device
# tool's limit). Over it: one line on stderr naming both sizes, exit 3. Otherwise one line on stdout; exit 0 (or
# pip's status when the download failed).
set -euo pipefail
CHECK_ONLY=0
if [ "${1:-}" = --check ]; then
    CHECK_ONLY=1
    shift
fi
DIR=${1:?usage: benchmarks/gpu/fetch_wheels.sh [--check] DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
LIMIT_MIB=${CARRY_LIMIT_MIB:-64}
mkdir -p "$DIR"
if [ $CHECK_ONLY -eq 0 ]; then
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
        --platform any -r "$HERE/requirements-gpu.txt" -d "$DIR"
    echo "fetch_wheels: $(ls "$DIR"/*.whl | wc -l) wheels in $DIR"
fi

# bytes of the files NUL-separated on stdin (relative to the current directory); missing ones count 0
sum_bytes() { xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
repo_bytes=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | sum_bytes)
DIR_ABS=$(cd "$DIR" && pwd)
case "$DIR_ABS/" in
    "$REPO"/*) in_git=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard -- "$DIR_ABS" | sum_bytes) ;;
    *) in_git=0 ;;
esac
dir_bytes=$(find "$DIR_ABS" -type f -print0 | sum_bytes)
extra=$((dir_bytes - in_git))
total=$((repo_bytes + extra))
limit=$((LIMIT_MIB * 1048576))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
line="repository $(mib "$repo_bytes") MiB + $DIR $(mib "$extra") MiB = $(mib "$total") MiB"
if [ "$total" -gt "$limit" ]; then
    hint="move bulky files out of git's view (raw runs in docs/runs/, say) or carry fewer wheels"
    echo "fetch_wheels: the carried tree would be over the ${LIMIT_MIB} MiB limit: $line ($hint)" >&2
    exit 3
fi
echo "fetch_wheels: carried tree $line, within ${LIMIT_MIB} MiB"
