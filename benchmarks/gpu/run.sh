#!/usr/bin/env bash
# The one script a GPU loan runs: the GPU table (issue 51) in at most 8 minutes, each figure written as it is
# measured. This command line is a contract (other scripts call `run.sh --smoke RESULTS_DIR`); keep it stable:
#
#     benchmarks/gpu/run.sh [--smoke] [--tests] [--bundle FILE] RESULTS_DIR [WHEEL_DIR]
#
# Steps in order of value, each under `timeout` with its bound from manifest.py (on a device the bounds sum to
# 480 s), its output in RESULTS_DIR/<step>.log:
#   wheels  pip install --no-index from WHEEL_DIR what requirements-gpu.txt lists (fetch_wheels.sh made it);
#           skipped without WHEEL_DIR
#   device  torch, triton, the device into device.json; without CUDA a device run stops here, exit 2
#   gate    ours vs transformers on Qwen2-VL-7B (dummy weights), bf16 and fp32, sdpa and triton backends
#   ttft    unloaded TTFT per seed-mix class, Qwen2-VL-7B and Qwen2.5-VL-7B, vs transformers' generate
#   mfu     language-model prefill and vision tower vs the bf16 matmul peak measured in the run
#   decode  tokens/s at batch 1 / 16 / 64, CUDA graphs on and off, vs weight bytes / copy bandwidth
#   served  the seed mix through firsttoken bench at U 0.6 of the measured capacity, default vs fcfs
# The table's steps are benchmarks/gpu/step.py STEP: each rewrites RESULTS_DIR/<step>.json after every figure (a
# step stopped at its bound leaves what it measured) and is skipped when a rerun finds its JSON "done" (resume a
# run by running it again into the same RESULTS_DIR). A timing step measures a backend only where the gate passed.
# On every exit (failure, timeout, interrupt) summary.py prints the table from the JSON, each target met / missed /
# not run and why, and writes RESULTS_DIR/summary.json and summary.txt.
#
#   --smoke        the CPU stands in for the device: each family's tiny checkpoint, fp32, sdpa in place of triton,
#                  no graphs, small images, few repeats. Every step's code path end to end; no figure is a GPU's.
#   --tests        after the table (outside its 8 minutes): pytest tests/gpu (180 s) and kernels_check.py (180 s)
#   --bundle FILE  FILE (.tar.gz) holds RESULTS_DIR as it stands after every step: on a loan put it under $OUT, so
#                  a call stopped at its limit still returns what finished (one file of the 8 that come back)
# Exit status: 0 when every step ended done (and the gate passed); 2 without CUDA on a device run; else 1.
# The repository is on PYTHONPATH (firsttoken is not installed there; the machine keeps its torch 2.11). $PYTHON
# names the interpreter (default python3, the GPU machine's torch one); the servers the served step starts run on
# it too. $FIRSTTOKEN_GPU_TABLE_MODELS: where the checkpoint directories are made (default: the temp dir).
set -u
SMOKE=
TESTS=0
BUNDLE=
while [ $# -gt 0 ]; do
    case $1 in
        --smoke) SMOKE=--smoke; shift ;;
        --tests) TESTS=1; shift ;;
        --bundle) BUNDLE=${2:?--bundle needs a FILE}; shift 2 ;;
        -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
RESULTS=${1:?usage: benchmarks/gpu/run.sh [--smoke] [--tests] [--bundle FILE] RESULTS_DIR [WHEEL_DIR]}
WHEELS=${2:-}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
GPU="$REPO/benchmarks/gpu"
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
STEPS="$RESULTS/steps.tsv"
touch "$STEPS"
START=$(date +%s)
STATUS=1

bundle() {
    [ -n "$BUNDLE" ] || return 0
    tar -czf "$BUNDLE.part" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" 2>/dev/null \
        && mv -f "$BUNDLE.part" "$BUNDLE"
}

finish() {
    "$PY" "$GPU/summary.py" "$RESULTS" --steps "$STEPS" --start "$START" --status "$STATUS" \
        || echo "run.sh: could not write the summary" >&2
    bundle
}
trap finish EXIT
trap 'exit 130' INT TERM

declare -A LIMIT  # step -> its bound in seconds; ORDER: the table's steps in run order (manifest.py)
ORDER=()
while read -r name seconds; do
    LIMIT[$name]=$seconds
    case $name in wheels|device) ;; *) ORDER+=("$name") ;; esac
done < <("$PY" "$GPU/manifest.py" $SMOKE)

# step NAME LIMIT_S NOTE CMD...: run CMD under `timeout`, output to NAME.log, one line to steps.tsv
step() {
    local name=$1 limit=$2 note=$3
    shift 3
    local t0 rc ms
    t0=$(date +%s%N)
    timeout -k 10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    printf '%s\t%s\t%d.%03d\t%s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "$note" >> "$STEPS"
    echo "run.sh: $name: exit $rc in $((ms / 1000)) s (log: $RESULTS/$name.log)" >&2
    bundle
    return $rc
}

if [ -n "$WHEELS" ]; then
    step wheels "${LIMIT[wheels]}" "$WHEELS" "$PY" -m pip install -q --no-index --find-links "$WHEELS" \
        -r "$GPU/requirements-gpu.txt"
fi

step device "${LIMIT[device]}" "torch, triton, the device" "$PY" - "$RESULTS/device.json" $SMOKE <<'PYEOF'
import json, sys
import torch
facts = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
         "smoke": "--smoke" in sys.argv}
try:
    import triton
    facts["triton"] = triton.__version__
except ImportError as exc:
    facts["triton"] = f"absent: {exc}"
if facts["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    facts.update(device=props.name, capability=list(torch.cuda.get_device_capability(0)),
                 memory_bytes=props.total_memory, sms=props.multi_processor_count)
else:
    facts["device"] = "cpu (standing in for a GPU: --smoke)" if facts["smoke"] else None
json.dump(facts, open(sys.argv[1], "w"), indent=2)
print(json.dumps(facts))
sys.exit(0 if facts["cuda_available"] or facts["smoke"] else 2)
PYEOF
rc=$?
if [ $rc -eq 2 ]; then
    echo "run.sh: no CUDA device here ($(tail -n 1 "$RESULTS/device.log")); nothing run on a GPU" >&2
    STATUS=2
    exit 2
elif [ $rc -ne 0 ]; then
    echo "run.sh: the device probe failed (exit $rc; $RESULTS/device.log); nothing measured" >&2
    exit 1
fi

failed=0
for name in "${ORDER[@]}"; do
    step "$name" "${LIMIT[$name]}" "step.py $name" "$PY" "$GPU/step.py" "$name" "$RESULTS" $SMOKE < /dev/null \
        || failed=1
done

if [ $TESTS -eq 1 ]; then
    step tests 180 "pytest tests/gpu" "$PY" -m pytest "$REPO/tests/gpu" -q -p no:cacheprovider \
        --junitxml="$RESULTS/tests_gpu.xml" || failed=1
    step kernels 180 "kernels_check.py" "$PY" "$GPU/kernels_check.py" --out "$RESULTS/kernels.json" --repeats 10 \
        || failed=1
fi
STATUS=$failed
exit $failed
