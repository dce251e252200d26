#!/usr/bin/env bash
# The GPU machine's torch 2.11 / Triton 3.6 / transformers 5.17, checked here on the CPU (not in CI: several GB of
# wheels):
#
#     benchmarks/gpu/check_torch211.sh ENV_DIR [RESULTS_DIR]        (RESULTS_DIR defaults to ENV_DIR/results)
#
# 1. ENV_DIR: a venv of this machine's Python 3.11 (reused when it exists) with PyPI's default torch 2.11 build (the
#    CUDA 13 one: it imports and runs on a CPU), Triton 3.6, transformers 5.17, torchvision 0.26 and the rest of
#    benchmarks/gpu/gpu-image.txt, plus the project's other runtime and test dependencies
#    (benchmarks/gpu/torch211.py requirements). pip runs without this machine's configuration (its local wheel
#    folders, extra indexes and version caps) so every wheel comes from pip's default index; the install is skipped
#    when ENV_DIR/requirements.txt already equals what would be installed.
# 2. With that env's python and PYTHONPATH=REPO (firsttoken is not installed), each step logged to RESULTS_DIR:
#      versions     what the env holds, into versions.json
#      select       the CUDA path's test files, from an import walk (torch211.py select)
#      names        each torch / triton / transformers / torchvision name those modules use, and the keywords
#                   of each call, looked up in the env (torch211.py names; torch.cuda.* included); then the
#                   loan's own files (tests/gpu, benchmarks/gpu) imported
#      cuda_path    pytest on those files (junit XML cuda_path.xml)
#      interpreter  TRITON_INTERPRET=1 pytest on the files that run the Triton kernels (interpreter.xml)
#      smoke        benchmarks/gpu/run.sh --smoke RESULTS_DIR/smoke, where this checkout's run.sh has --smoke
# 3. RESULTS_DIR/summary.json: the versions, each step's exit status and seconds, each test group's passed / failed /
#    skipped counts and failing node ids, and the smoke run's own summary.
# It checks torch's, Triton's and transformers' APIs, not Python 3.12 (the GPU machine's; not on this machine).
# Exit status: 0 when every step passed, else 1 (2: usage, or the env could not be made).
set -u
ENV_DIR=${1:?usage: benchmarks/gpu/check_torch211.sh ENV_DIR [RESULTS_DIR]}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HELPER="$REPO/benchmarks/gpu/torch211.py"
mkdir -p "$ENV_DIR"
ENV_DIR=$(cd "$ENV_DIR" && pwd)
RESULTS=${2:-$ENV_DIR/results}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
PY="$ENV_DIR/bin/python"
STEPS="$RESULTS/steps.tsv"
: > "$STEPS"

# step NAME NOTE CMD...: run CMD with its output in RESULTS/NAME.log, one line to steps.tsv
step() {
    local name=$1 note=$2
    shift 2
    local t0=$SECONDS rc
    "$@" > "$RESULTS/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%d\t%s\n' "$name" "$rc" $((SECONDS - t0)) "$note" >> "$STEPS"
    echo "check_torch211: $name: exit $rc in $((SECONDS - t0)) s (log: $RESULTS/$name.log)" >&2
    return $rc
}

# pip with none of this machine's settings: no config files (local indexes, find-links, the torch cap), no
# PIP_* overrides of the index; so pip's default index serves every wheel.
side_pip() {
    env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_NO_INDEX \
        PIP_CONFIG_FILE=/dev/null "$PY" -m pip "$@"
}

make_env() {
    [ -x "$PY" ] || python3.11 -m venv "$ENV_DIR" || return 2
    python3.11 "$HELPER" requirements "$RESULTS/requirements.txt" || return 2
    if cmp -s "$RESULTS/requirements.txt" "$ENV_DIR/requirements.txt"; then
        echo "ENV_DIR already holds $RESULTS/requirements.txt; nothing installed"
        return 0
    fi
    side_pip install -q --upgrade pip || return 2
    side_pip install --report "$ENV_DIR/install-report-$(date +%s).json" -r "$RESULTS/requirements.txt" || return 2
    cp "$RESULTS/requirements.txt" "$ENV_DIR/requirements.txt"
}

# Triton 3.6's interpreter converts loaded scalars with int() on 1-element arrays, which numpy 2.4 refuses (a
# TypeError in every kernel with a loop over a loaded bound); the GPU machine compiles the kernels and never
# interprets them, so the interpreter group alone runs over this numpy, put ahead of the env's on PYTHONPATH.
INTERPRETER_NUMPY=numpy==2.3.5
NUMPY_OVERLAY="$ENV_DIR/interpreter-numpy"
make_numpy_overlay() {
    [ -d "$NUMPY_OVERLAY/numpy" ] && return 0
    side_pip install -q --no-deps --target "$NUMPY_OVERLAY" "$INTERPRETER_NUMPY"
}

run_pytest() {  # GROUP FILE_LIST PYTHONPATH [ENV=VALUE...]
    local group=$1 list=$2 path=$3
    shift 3
    [ -s "$list" ] || { echo "no test files in $list"; return 0; }
    (cd "$REPO" && env "$@" PYTHONPATH="$path" "$PY" -m pytest -q -p no:cacheprovider -o junit_family=xunit1 \
        --continue-on-collection-errors --junitxml="$RESULTS/$group.xml" $(cat "$list"))
}

has_smoke() {  # run.sh documents its options in its header's usage lines
    sed -n '1,/^set /p' "$REPO/benchmarks/gpu/run.sh" | grep -q -- '--smoke'
}

START=$SECONDS
if ! step env "venv + pip install (PyPI)" make_env || ! step numpy_overlay "$INTERPRETER_NUMPY" make_numpy_overlay
then
    echo "check_torch211: could not make the environment in $ENV_DIR (see $RESULTS/env.log)" >&2
    exit 2
fi
step versions "the env's versions" "$PY" - "$RESULTS/versions.json" "$ENV_DIR" <<'PYEOF'
import glob, importlib.metadata as md, json, platform, sys
import torch
facts = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda_build": torch.version.cuda,
         "cuda_available": torch.cuda.is_available()}
for dist in ("triton", "transformers", "torchvision", "tokenizers", "safetensors", "huggingface-hub", "numpy",
             "pillow", "pytest"):
    facts[dist] = md.version(dist)
# Where torch's wheel came from, as pip reported the latest install that put one there (a local file:// wheel would
# be a mirror's, not PyPI's build).
installs = [i for report in sorted(glob.glob(f"{sys.argv[2]}/install-report-*.json"))
            for i in json.load(open(report))["install"] if i["metadata"]["name"] == "torch"]
if installs:
    url = installs[-1]["download_info"]["url"]
    facts["torch_wheel"] = url.rsplit("/", 1)[-1]
    facts["torch_wheel_downloaded"] = not url.startswith("file:")
else:
    facts["torch_wheel"] = "unknown: no pip report installed torch"
json.dump(facts, open(sys.argv[1], "w"), indent=2)
print(json.dumps(facts))
PYEOF
step select "import walk" "$PY" "$HELPER" select "$RESULTS"
failed=0
# TRITON_INTERPRET=1 as tests/conftest.py sets it without CUDA: tests/gpu imports the unit tests' kernel module
step names "torch / triton / transformers names and keywords; the loan's files imported" \
    env PYTHONPATH="$REPO" TRITON_INTERPRET=1 "$PY" "$HELPER" names "$RESULTS" || failed=1
step cuda_path "pytest: the CUDA path's tests" run_pytest cuda_path "$RESULTS/cuda_path_tests.txt" "$REPO" || failed=1
step interpreter "pytest, TRITON_INTERPRET=1, $INTERPRETER_NUMPY" run_pytest interpreter \
    "$RESULTS/interpreter_tests.txt" "$NUMPY_OVERLAY:$REPO" TRITON_INTERPRET=1 || failed=1
if has_smoke; then
    # the CPU stands in for the device there, so any kernel it runs is interpreted: the overlay's numpy again
    step smoke "run.sh --smoke" env PYTHON="$PY" PYTHONPATH="$NUMPY_OVERLAY" \
        "$REPO/benchmarks/gpu/run.sh" --smoke "$RESULTS/smoke" || failed=1
else
    printf 'smoke\t-1\t0\trun.sh --smoke: not in this checkout\n' >> "$STEPS"
    echo "check_torch211: run.sh --smoke: not in this checkout" >&2
fi
"$PY" "$HELPER" summarize "$RESULTS"
echo "check_torch211: $((SECONDS - START)) s; summary in $RESULTS/summary.json" >&2
exit $failed
