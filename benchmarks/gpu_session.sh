#!/usr/bin/env bash
# One GPU session on a node without network: install the kit, run the CUDA tests, then the GPU throughput
# benchmark, each part under its own time budget; every part's output is kept and a summary closes the run.
# The kit comes with the work tree: .whl/ (cp312 wheels) and .devkit/data (prebuilt data artifacts), both made by
# benchmarks/gpu_wheels.sh on a networked machine.
#
#   bash benchmarks/gpu_session.sh                 # writes into $OUT (default /tmp/gpu-session)
#
# Environment (defaults): OUT (/tmp/gpu-session) TEST_S (200) BENCH_S (240) TEST_TIMEOUT (150, per test)
#   TEST_FILES (the tests/gpu files, in this order) BENCH_ATTN ("varlen flex": one benchmark run per attention)
#   BENCH_STEPS (10) BENCH_WARMUP (4) BENCH_ROUNDS (1) BENCH_VARIANTS ("bare torch loop,compass trainer")
#   PY (python3) SITE (/tmp/site: where .whl installs) SKIP_INSTALL (unset; 1: use PY's own packages, e.g. a
#   local .venv on a CPU machine, where the tests stop at "needs a CUDA device")
# Files under $OUT: gpu_session.log (all of it, the summary last), kit_check.log, gpu_tests.log, gpu_tests.xml,
#   gpu_throughput.log, results/ATTENTION/gpu_throughput.json (the benchmark's result file: copy the one to publish
#   to benchmarks/results/ and run benchmarks/bench_table.py).
set -uo pipefail  # no -e: a part that fails is reported, and the next part still runs
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/gpu-session}
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
TEST_S=${TEST_S:-200}
BENCH_S=${BENCH_S:-240}
TEST_TIMEOUT=${TEST_TIMEOUT:-150}
TEST_FILES=${TEST_FILES:-tests/gpu/test_collectives_on_nccl.py tests/gpu/test_training_on_cuda.py
tests/gpu/test_preflight_on_cuda.py tests/gpu/test_post_training_on_cuda.py tests/gpu/test_kernels_on_cuda.py}
BENCH_ATTN=${BENCH_ATTN:-varlen flex}
BENCH_STEPS=${BENCH_STEPS:-10}
BENCH_WARMUP=${BENCH_WARMUP:-4}
BENCH_ROUNDS=${BENCH_ROUNDS:-1}
BENCH_VARIANTS=${BENCH_VARIANTS:-bare torch loop,compass trainer}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-session-work.XXXXXX")
T0=$(date +%s)
stamp() { echo "=== [$(($(date +%s) - T0)) s] $*"; }

main() {

# --- setup ------------------------------------------------------------------------------------------------------
stamp "setup: $(hostname), repo $REPO, python $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
SETUP=ok
if [[ -z "${SKIP_INSTALL:-}" ]]; then
  shopt -s nullglob
  wheels=("$REPO"/.whl/*.whl)
  shopt -u nullglob
  if ((${#wheels[@]} == 0)); then
    echo "no wheels in $REPO/.whl: was it carried? (bash benchmarks/gpu_wheels.sh, carry [\".whl\", \".devkit\"])"
    SETUP="no .whl"
  elif $PY -m pip --version >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${wheels[@]}" 2>&1 | grep -v "Target directory .* already exists\|Running pip as" || true
    ((PIPESTATUS[0] == 0)) || SETUP="pip install failed"
  else  # no pip: a wheel is a zip; its .data/{purelib,platlib} go to the top, scripts are not needed
    echo "no pip: unpacking the wheels into $SITE"
    $PY - "$SITE" "${wheels[@]}" <<'EOF' || SETUP="unpacking the wheels failed"
import shutil, sys, zipfile
from pathlib import Path
site = Path(sys.argv[1]); site.mkdir(parents=True, exist_ok=True)
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            if name.endswith("/"):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
EOF
  fi
  echo "installed ${#wheels[@]} wheels into $SITE"
fi
# compass: the repository's folders are the `compass.*` namespace (pyproject's package-dir), linked under SITE
mkdir -p "$SITE/compass"
for part in specs flows tasks model infra; do ln -sfn "$REPO/$part" "$SITE/compass/$part"; done
export PYTHONPATH="$SITE:$REPO/benchmarks/gpu_session${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export COMPASS_PREBUILT_DATA=${COMPASS_PREBUILT_DATA:-$REPO/.devkit/data}
[[ -f "$COMPASS_PREBUILT_DATA/data.json" ]] || echo "no $COMPASS_PREBUILT_DATA/data.json: was .devkit carried?"
stamp "kit check"
timeout 90 $PY benchmarks/gpu_session/check_kit.py "$SITE" >"$OUT/kit_check.log" 2>&1 </dev/null
grep -av "^import .*: ok " "$OUT/kit_check.log" | cut -c1-400 | tail -60
KIT=$(grep -a "^kit check:" "$OUT/kit_check.log" | tail -1)

# --- tests ------------------------------------------------------------------------------------------------------
stamp "tests (budget ${TEST_S} s): pytest -m gpu $(echo $TEST_FILES)"
# SIGINT at the budget: pytest stops where it is and still prints its summary; SIGKILL 30 s later.
# shellcheck disable=SC2086  # TEST_FILES: a list
timeout -s INT -k 30 "$TEST_S" $PY -m pytest -q -m gpu $TEST_FILES -p no:cacheprovider -p prebuilt_data -p gpu_progress -rA \
  --durations=15 --timeout="$TEST_TIMEOUT" --basetemp="$WORK/pytest" --junitxml="$OUT/gpu_tests.xml" \
  </dev/null 2>&1 | tee "$OUT/gpu_tests.log" | grep -a --line-buffered -E \
  "^(\[gpu-progress\]|PASSED|FAILED|ERROR|SKIPPED|=+ |E  |[0-9.]+s (call|setup|teardown))|(passed|failed|error).* in [0-9.]+s"
TESTS_RC=${PIPESTATUS[0]}
TESTS_LINE=$(grep -aE "(passed|failed|error|skipped|no tests ran).* in [0-9.]+s" "$OUT/gpu_tests.log" | tail -1)

# --- benchmark --------------------------------------------------------------------------------------------------
BENCH_END=$(($(date +%s) + BENCH_S))
: >"$OUT/gpu_throughput.log"
declare -A BENCH_RC
for attention in $BENCH_ATTN; do
  left=$((BENCH_END - $(date +%s)))
  if ((left < 30)); then
    echo "--- attention $attention: not run (${left} s of the benchmark's ${BENCH_S} s left)" | tee -a "$OUT/gpu_throughput.log"
    BENCH_RC[$attention]="not run"
    continue
  fi
  stamp "benchmark --attention $attention (${left} s left of ${BENCH_S} s)"
  echo "--- attention $attention: gpu_throughput.py --steps $BENCH_STEPS --warmup $BENCH_WARMUP --rounds $BENCH_ROUNDS" \
    "--variants '$BENCH_VARIANTS' (budget ${left} s)" >>"$OUT/gpu_throughput.log"
  COMPASS_BENCH_RESULTS="$OUT/results/$attention" timeout -s INT -k 20 "$left" $PY benchmarks/gpu_throughput.py --attention "$attention" --steps "$BENCH_STEPS" \
    --warmup "$BENCH_WARMUP" --rounds "$BENCH_ROUNDS" --variants "$BENCH_VARIANTS" </dev/null 2>&1 |
    tee -a "$OUT/gpu_throughput.log" | grep -a --line-buffered -v "^\s*$"
  BENCH_RC[$attention]=${PIPESTATUS[0]}
done

# --- summary ----------------------------------------------------------------------------------------------------
verdict() { case "$1" in 0) echo "ok" ;; 124 | 130 | 137) echo "stopped at its time budget (rc $1)" ;; *) echo "rc $1" ;; esac; }
stamp "summary"
{
  echo "setup:     $SETUP; ${KIT:-kit check: no result}"
  grep -a "^versions: " "$OUT/kit_check.log" | cut -c1-400 | sed 's/^/           /'
  echo "tests:     $(verdict "$TESTS_RC"): ${TESTS_LINE:-no pytest summary line; its last: $(tail -1 "$OUT/gpu_tests.log")}"
  grep -aE "^\[gpu-progress\] (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.log" | cut -c16-300 | sed 's/^/           /'
  running=$(grep -a "^\[gpu-progress\] " "$OUT/gpu_tests.log" | tail -1 | grep "START" | cut -c23-)
  [[ -z "$running" ]] || echo "           STOPPED while running: $running"
  awk '/= prebuilt data =/ {on = 1; next} on && /^=/ {exit} on' "$OUT/gpu_tests.log" | sed 's/^/           data: /'
  for attention in $BENCH_ATTN; do
    rc=${BENCH_RC[$attention]}
    [[ "$rc" == "not run" ]] || rc=$(verdict "$rc")
    echo "benchmark: --attention $attention: $rc"
  done
  grep -aE "measured |no CUDA device|tokens/s|MFU \(median\)|GPU memory \(median|--child .* failed|Error: " "$OUT/gpu_throughput.log" |
    cut -c1-240 | head -30 | sed 's/^/           /'
  echo "files:     $(cd "$OUT" && ls | tr '\n' ' ')in $OUT; $(($(date +%s) - T0)) s in all"
  echo "(the tests' full output: gpu_tests.log; the benchmark's: gpu_throughput.log; the kit check: kit_check.log)"
}
}

main 2>&1 | tee "$OUT/gpu_session.log"
rm -rf "$WORK"
exit 0
