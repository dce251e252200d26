#!/usr/bin/env bash
# Download, here (with network), the wheels the GPU machine lacks, for its Python 3.12 on manylinux x86_64:
#
#     benchmarks/gpu/fetch_wheels.sh DIR        then carry DIR to the GPU machine and run
#     benchmarks/gpu/run.sh RESULTS_DIR DIR     there (it installs them with --no-index from DIR)
#
# The list is benchmarks/gpu/requirements-gpu.txt. Only binary wheels (the GPU machine builds nothing); the
# platform tags cover manylinux2014 and the newer manylinux_2_28 some packages publish. Exit status: pip's.
set -euo pipefail
DIR=${1:?usage: benchmarks/gpu/fetch_wheels.sh DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$DIR"
python -m pip download --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    --platform any -r "$HERE/requirements-gpu.txt" -d "$DIR"
echo "fetch_wheels: $(ls "$DIR"/*.whl | wc -l) wheels in $DIR"
