#!/usr/bin/env bash
# patrl's one-shot device check: the `gpu`-marked tests, then gpu_engine_bench.py and
# gpu/decode_profile.py: about 5 minutes on an H200 when every step passes; at most ~9 (the
# steps' timeouts add up to 515 s, their kill grace to 18 s, the setup takes the rest: give
# the call 560 s). Run from anywhere:
#
#   bash benchmarks/gpu/check.sh [WHEELS_DIR]
#
# Python: $PY, else `python3` (the system one: no venv, no nox, no package registry needed).
# Wheels: the dependencies that Python lacks (pydantic, math-verify, ...), as .whl files in
#   WHEELS_DIR, else $PATRL_WHEELS, else the first folder of .device_wheels/,
#   shared/device/wheels/ and ../shared/device/wheels/ (from the repository root) that
#   exists; they are unzipped onto PYTHONPATH (no pip). With none of these (patrl installed
#   normally, say) nothing is unpacked.
# The packages' src/ and tests/ go first on PYTHONPATH: this checkout is what is checked.
# Results: $OUT, else benchmarks/results/gpu_check/, holds env.json, one log and one JUnit
#   XML per step, the bench's JSON and summary.json (each step's exit status, seconds, test
#   counts, and each failed test with its message: benchmarks/gpu/summarize.py). With
#   PATRL_CHECK_PACK=1 the logs and XML end in one logs.tar.gz (for a lent machine that
#   returns only a few files). Exit status: 0 when every step passed, 1 when one failed or timed out,
#   2 without a CUDA device (nothing else runs), 3 when the environment is unusable.
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
PY=${PY:-python3}

# --- a CUDA device, or a clean refusal, before anything else ------------------------------
if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "check.sh: $PY cannot import torch; set PY to a Python with CUDA torch" >&2
  exit 3
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "check.sh: no CUDA device (torch.cuda.is_available() is False under $PY):" \
    "this check runs on a GPU machine; nothing was run" >&2
  exit 2
fi

OUT=${OUT:-$ROOT/benchmarks/results/gpu_check}
mkdir -p "$OUT" || exit 3
OUT=$(cd "$OUT" && pwd)

# --- wheels onto PYTHONPATH, then the packages' sources ------------------------------------
WHEELS=${1:-${PATRL_WHEELS:-}}
if [ -z "$WHEELS" ]; then
  for candidate in "$ROOT/.device_wheels" "$ROOT/shared/device/wheels" \
    "$ROOT/../shared/device/wheels"; do
    if [ -d "$candidate" ]; then WHEELS=$candidate; break; fi
  done
fi
DEPS=""
if [ -n "$WHEELS" ]; then
  if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "check.sh: no .whl files in $WHEELS" >&2
    exit 3
  fi
  DEPS=$(mktemp -d "${TMPDIR:-/tmp}/patrl_deps.XXXXXX") || exit 3
  trap 'rm -rf "$DEPS"' EXIT
  for wheel in "$WHEELS"/*.whl; do
    "$PY" -m zipfile -e "$wheel" "$DEPS" || { echo "check.sh: cannot unzip $wheel" >&2; exit 3; }
  done
fi
SRC=$(ls -d "$ROOT"/packages/*/src "$ROOT"/examples/src | paste -sd: -)  # examples: the demo task
export PYTHONPATH="$SRC:$ROOT/tests${DEPS:+:$DEPS}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

"$PY" - "$OUT/env.json" "${WHEELS:-}" <<'EOF' || { echo "check.sh: the environment is unusable (see above)" >&2; exit 3; }
import datetime, json, platform, sys
import torch, transformers
info = {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "host": platform.node(), "python": sys.version.split()[0], "torch": torch.__version__,
    "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
    "device_count": torch.cuda.device_count(),
    "device_memory_GiB": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
    "transformers": transformers.__version__, "wheels": sys.argv[2] or None,
}
for name in ("triton", "pydantic", "math_verify", "flash_attn", "datasets"):
    try:
        module = __import__(name)
        info[name] = getattr(module, "__version__", getattr(module, "VERSION", "present"))
    except ImportError:
        info[name] = None
import patrl.orchestrator, patrl.rollout, patrl.trainer  # the packages import, or stop here
info["patrl_from"] = patrl.rollout.__file__
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
EOF

# --- the steps: (name, seconds, command...) ------------------------------------------------
rc=0
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, $(date -u +%T))"
  local start=$SECONDS status=0
  timeout -k 3 "$limit" "$@" > "$OUT/$name.log" 2>&1 || status=$?
  echo "$name $status $((SECONDS - start))" >> "$OUT/steps.txt"
  [ "$status" -eq 0 ] || rc=1
  tail -n 15 "$OUT/$name.log"
}
gpu_tests() {  # the test files under $@ that hold gpu-marked tests
  grep -rl --include='test_*.py' -e 'pytest.mark.gpu' "$@" 2>/dev/null | sort
}
PYTEST=("$PY" -m pytest -p no:cacheprovider -m gpu -q -rfEs --continue-on-collection-errors)
: > "$OUT/steps.txt"

mapfile -t ROLLOUT < <(gpu_tests packages/rollout/tests)
mapfile -t TRAINER < <(gpu_tests packages/trainer/tests)
mapfile -t ORCHESTRATOR < <(gpu_tests packages/orchestrator/tests)
mapfile -t OTHERS < <(gpu_tests packages/kvstore/tests packages/tpreshard/tests \
  packages/lenpredict/tests tests)
tests() {  # name, seconds, files... (no files: nothing to run, and pytest must not get none)
  local name=$1 limit=$2; shift 2
  if [ "$#" -eq 0 ]; then echo "=== $name: no gpu-marked tests"; return; fi
  step "$name" "$limit" "${PYTEST[@]}" --junitxml="$OUT/$name.xml" "$@"
}
tests tests_rollout 95 "${ROLLOUT[@]}"
tests tests_trainer 75 "${TRAINER[@]}"
tests tests_orchestrator 60 "${ORCHESTRATOR[@]}"
tests tests_others 110 "${OTHERS[@]}"
step bench_llama1b 100 "$PY" benchmarks/gpu_engine_bench.py --batches 1,64 --steps 32 \
  --repeats 1 --verify 4 --out "$OUT/gpu_engine_bench_llama1b.json"
step decode_profile 75 "$PY" benchmarks/gpu/decode_profile.py --batches 1,64 --steps 48 \
  --out "$OUT/decode_profile.json"

"$PY" benchmarks/gpu/summarize.py "$OUT" ${PATRL_CHECK_PACK:+--pack}
echo "=== done: exit $rc, results in $OUT"
exit $rc
