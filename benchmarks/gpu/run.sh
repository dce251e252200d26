#!/usr/bin/env bash
# The one script a GPU loan runs (issue 39), under 8 minutes end to end:
#
#     benchmarks/gpu/run.sh RESULTS_DIR [WHEEL_DIR]
#
# Steps, each bounded by `timeout` and logged to RESULTS_DIR/<step>.log:
#   wheels   pip install --no-index from WHEEL_DIR (benchmarks/gpu/fetch_wheels.sh made it) what
#            requirements-gpu.txt lists; skipped without WHEEL_DIR                                    (60 s)
#   device   torch, triton, the CUDA device: into RESULTS_DIR/device.json; without CUDA the run stops
#            here with one line on stderr, exit 2                                                     (30 s)
#   tests    python -m pytest tests/gpu -q (junit XML in RESULTS_DIR/tests_gpu.xml)                  (180 s)
#   kernels  python benchmarks/gpu/kernels_check.py --out RESULTS_DIR/kernels.json                   (180 s)
# RESULTS_DIR/summary.json is always written (on failure, timeout or interrupt too): each step's exit status and
# seconds, the total, and whether every step passed. Exit status: 0 when all passed, 2 without CUDA, else 1.
# The repository is on PYTHONPATH (firsttoken is not installed there; the machine keeps its torch 2.11).
set -u
RESULTS=${1:?usage: benchmarks/gpu/run.sh RESULTS_DIR [WHEEL_DIR]}
WHEELS=${2:-}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
STEPS="$RESULTS/steps.tsv"
: > "$STEPS"
START=$(date +%s)
STATUS=1

write_summary() {
    "$PY" - "$STEPS" "$RESULTS/summary.json" "$START" "$STATUS" <<'PYEOF' || echo "run.sh: could not write summary.json" >&2
import json, sys, time
steps_file, out, start, status = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
steps = []
for line in open(steps_file):
    name, rc, seconds, note = line.rstrip("\n").split("\t", 3)
    steps.append({"step": name, "rc": int(rc), "seconds": float(seconds), "timed_out": rc in ("124", "137"),
                  "note": note})
json.dump({"exit_status": status, "ok": status == 0, "total_seconds": round(time.time() - start, 1),
           "steps": steps}, open(out, "w"), indent=2)
PYEOF
}
trap write_summary EXIT
trap 'exit 130' INT TERM

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
    [ "$name" = device ] && [ "$rc" -ne 0 ] && return $rc  # said below, in the run's one line
    echo "run.sh: $name: exit $rc in $((ms / 1000)) s (log: $RESULTS/$name.log)" >&2
    return $rc
}

if [ -n "$WHEELS" ]; then
    step wheels 60 "$WHEELS" "$PY" -m pip install --no-index --find-links "$WHEELS" \
        -r "$REPO/benchmarks/gpu/requirements-gpu.txt"
fi

if ! step device 30 "torch, triton, CUDA" "$PY" - "$RESULTS/device.json" <<'PYEOF'
import json, sys
import torch
facts = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
try:
    import triton
    facts["triton"] = triton.__version__
except ImportError as exc:
    facts["triton"] = f"absent: {exc}"
if facts["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    facts.update(device=props.name, capability=list(torch.cuda.get_device_capability(0)),
                 memory_bytes=props.total_memory, sms=props.multi_processor_count)
json.dump(facts, open(sys.argv[1], "w"), indent=2)
print(json.dumps(facts))
sys.exit(0 if facts["cuda_available"] else 2)
PYEOF
then
    echo "run.sh: no CUDA device here ($(tail -n 1 "$RESULTS/device.log")); nothing run on a GPU" >&2
    STATUS=2
    exit 2
fi

failed=0
step tests 180 "pytest tests/gpu" "$PY" -m pytest "$REPO/tests/gpu" -q -p no:cacheprovider \
    --junitxml="$RESULTS/tests_gpu.xml" || failed=1
step kernels 180 "kernels_check.py" "$PY" "$REPO/benchmarks/gpu/kernels_check.py" \
    --out "$RESULTS/kernels.json" --repeats 10 || failed=1
STATUS=$failed
exit $failed
