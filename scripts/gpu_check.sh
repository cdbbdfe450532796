#!/usr/bin/env bash
# The GPU check, in one script for a lent GPU machine (no network, no download; about 8 minutes at most).
#
#   scripts/gpu_check.sh
#
# Steps (each a process of scripts/gpu_check.py, bounded by `timeout`, printing PASS/FAIL/SKIP and why):
#   env      nvidia-smi, the Python found, package versions, torch and torch.cuda.is_available()
#   build    a random-init Qwen2 of the Qwen2-0.5B shape (494M parameters: hidden 896, 24 layers, 14 heads,
#            2 KV heads, MLP 4864, vocab 151936) from its config, saved in bf16 to a temporary directory,
#            with the tiny model's character tokenizer padded to the same vocabulary
#   engine   producers.engines.HFEngine on CUDA: 16 prompts x 16 samples x 64 tokens, tokens/s, logprobs
#            against the trainer's teacher-forced recompute, a load_weights update
#   trainer  trainer.loop.Trainer on CUDA: 3 GRPO steps on 8 groups x 8 of the engine's rollouts; step time,
#            finite loss, weights changed, the bf16 delta of the trained weights encoded and applied bit-exact
#   ranks    trainer.ranks: 3 fixed steps on 1 rank and, with 2+ GPUs, on 2 ranks under torchrun (FSDP2, then
#            DeepSpeed ZeRO-2 where it imports); every version published once, 2-rank weights = 1-rank weights
#   bench    scripts/bench_weights.py as it is (--model <built model> --quick --lrs 1e-6); a CPU benchmark;
#            synthetic GSM8K-shaped text stands in when its data file is absent
#   vllm     VLLMServer + VLLMEngine where some Python imports a CUDA vllm (.venv-vllm, GPU_CHECK_VLLM_PYTHON, ...)
#   sglang   SGLangEngine (launching a server) where some Python imports sglang
# A step SKIPs when it cannot run here (no CUDA, a package missing, no model) and FAILs when it ran and broke.
# The last line of output is one JSON object summarising every step; it is also $OUT/summary.json.
#
# Environment:
#   OUT                     where results go (default ./gpu_check_out): summary.json, per step STEP.json and
#                           STEP.log, nvidia-smi.txt, bench_weights.txt, vllm_server.log
#   GPU_CHECK_DEVICE        cuda (default) or cpu: the CPU runs every step's code (a dry run)
#   GPU_CHECK_SMALL=1       a 2-layer hidden-128 model and small batches instead of the 0.5B shape
#   GPU_CHECK_PYTHON        the interpreter to use (default: the first of .venv/bin/python, python3, python,
#                           /opt/conda/bin/python, /usr/local/bin/python3, /usr/bin/python3 that imports torch,
#                           preferring one with CUDA when the device is cuda)
#   GPU_CHECK_VLLM_PYTHON, GPU_CHECK_SGLANG_PYTHON   interpreters to try first for vLLM / SGLang
#   GPU_CHECK_VLLM=1        on the CPU, run the vLLM step too (vLLM's CPU server takes minutes)
#   GPU_CHECK_BUDGET_S      seconds for all steps together (default 440 x the scale); a step never gets more
#                           than is left
#   GPU_CHECK_TIMEOUT_SCALE a whole number multiplying every step's time bound and the default budget
#                           (default 1 on cuda, 3 on the CPU)
#   GPU_CHECK_TMP           parent of the temporary work directory (default $TMPDIR or /tmp); removed at the end
#                           unless GPU_CHECK_KEEP=1
#
# Exit status: 0 when no step failed; 1 when a step that could run failed; 2 when none of build, engine and
# trainer could run (nothing was checked: no Python with torch, or no CUDA).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
START=$(date +%s)
OUT="${OUT:-./gpu_check_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/*.json "$OUT"/*.status "$OUT"/*.log
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
SMALL="${GPU_CHECK_SMALL:-0}"
# on the CPU (a dry run, maybe on a busy machine) every bound is 3 times longer unless GPU_CHECK_TIMEOUT_SCALE says
if [[ "$DEVICE" == cuda* ]]; then SCALE="${GPU_CHECK_TIMEOUT_SCALE:-1}"; else SCALE="${GPU_CHECK_TIMEOUT_SCALE:-3}"; fi
BUDGET="${GPU_CHECK_BUDGET_S:-$((440 * SCALE))}"
WORK="$(mktemp -d "${GPU_CHECK_TMP:-${TMPDIR:-/tmp}}/gpu_check.XXXXXX")"
cleanup() { if [ "${GPU_CHECK_KEEP:-0}" != 1 ]; then rm -rf "$WORK"; fi; }
trap cleanup EXIT

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error

json_str() {  # a JSON string literal of $1
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/ }
  s=${s//$'\t'/ }
  s=${s//$'\r'/ }
  printf '"%s"' "$s"
}

# record STEP STATUS REASON [SECONDS]: a result written by this script (the step's Python did not write one)
record() {
  printf '{"step": %s, "status": %s, "reason": %s, "seconds": %s}\n' "$(json_str "$1")" "$(json_str "$2")" \
    "$(json_str "$3")" "${4:-0}" >"$OUT/$1.json"
  printf '%s\t%s\n' "$2" "$3" >"$OUT/$1.status"
}

echo "== gpu_check: device $DEVICE, small=$SMALL, budget ${BUDGET}s (bounds x$SCALE), OUT=$OUT, work dir $WORK"

# -- the interpreter ------------------------------------------------------------------------------
PY=""
FIRST=""
WITH_TORCH=""
cands=()
[ -n "${GPU_CHECK_PYTHON:-}" ] && cands+=("$GPU_CHECK_PYTHON")
cands+=("$ROOT/.venv/bin/python" python3 python /opt/conda/bin/python /usr/local/bin/python3 /usr/bin/python3)
declare -A seen=()
for c in "${cands[@]}"; do
  p="$(command -v "$c" 2>/dev/null)" || continue
  [ -x "$p" ] || continue
  [ -n "${seen[$p]:-}" ] && continue  # by path, not target: a venv's python links to its base interpreter
  seen[$p]=1
  FIRST="${FIRST:-$p}"
  probe="$(timeout 90 "$p" -c 'import sys; v = sys.version.split()[0]
try:
    import torch
    print(v, "torch", torch.__version__, "cuda_build", torch.version.cuda, "cuda_available", torch.cuda.is_available())
except Exception as e:
    print(v, "no torch:", type(e).__name__, e)' 2>&1 | tail -1)"
  echo "   python candidate $p: $probe"
  case "$probe" in
    *"cuda_available True"*) PY="$p"; break ;;
    *" torch "*) WITH_TORCH="${WITH_TORCH:-$p}"; if [[ "$DEVICE" != cuda* ]]; then PY="$p"; break; fi ;;
  esac
done
PY="${PY:-${WITH_TORCH:-$FIRST}}"
echo "   using: ${PY:-no Python interpreter found}"

# -- steps ----------------------------------------------------------------------------------------
STEPS=()
# run_step NAME CAP_S MIN_S: run gpu_check.py NAME with a timeout of min(CAP_S, budget left); SKIP below MIN_S
run_step() {
  local name=$1 cap=$2 min=$3 left t rc status reason t0
  STEPS+=("$name")
  echo
  echo "== [$name]"
  t0=$(date +%s)
  left=$((BUDGET - (t0 - START)))
  if [ -z "$PY" ]; then
    if [ "$name" = env ]; then record "$name" FAIL "no Python interpreter found (tried ${cands[*]})"
    else record "$name" SKIP "no Python interpreter"; fi
  elif [ -n "$UNUSABLE" ]; then
    record "$name" SKIP "$UNUSABLE"
  elif [ "$left" -lt "$min" ]; then
    record "$name" SKIP "time budget: ${left}s left of ${BUDGET}s, the step needs ${min}s"
  else
    cap=$((cap * SCALE))
    t=$((cap < left ? cap : left))
    local small_flag=()
    [ "$SMALL" = 1 ] && small_flag=(--small)
    timeout -k 15 "$t" "$PY" scripts/gpu_check.py "$name" --out "$OUT" --work "$WORK" --device "$DEVICE" \
      --timeout "$t" "${small_flag[@]}" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      record "$name" FAIL "timed out after ${t}s (exit $rc); see $name.log" $(( $(date +%s) - t0 ))
    elif [ ! -s "$OUT/$name.status" ]; then
      record "$name" FAIL "exited $rc without a result: $(tail -3 "$OUT/$name.log" | tr '\n' ' ' | cut -c1-400)" \
        $(( $(date +%s) - t0 ))
    fi
  fi
  IFS=$'\t' read -r status reason <"$OUT/$name.status"
  echo "[$name] $status${reason:+: $reason} ($(( $(date +%s) - t0 ))s)"
}

UNUSABLE=""
run_step env 60 20
# the env step found no torch / no CUDA (or its report failed): the other steps cannot run
if grep -q '"usable": false' "$OUT/env.json" || ! grep -q PASS "$OUT/env.status"; then
  UNUSABLE="env: $(cut -f2- "$OUT/env.status")"
fi
run_step build 100 30
run_step engine 100 30
run_step trainer 130 40
run_step ranks 120 40
run_step bench 160 40
run_step vllm 200 30
run_step sglang 200 30

# -- summary --------------------------------------------------------------------------------------
passed=0 failed=0 skipped=0 core_ran=0
parts=()
for s in "${STEPS[@]}"; do
  IFS=$'\t' read -r status reason <"$OUT/$s.status"
  case "$status" in
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
    *) skipped=$((skipped + 1)) ;;
  esac
  case "$s:$status" in build:PASS|build:FAIL|engine:PASS|engine:FAIL|trainer:PASS|trainer:FAIL) core_ran=1 ;; esac
  parts+=("$(json_str "$s"): $(tr -d '\n' <"$OUT/$s.json")")
done
ok=true
code=0
if [ "$failed" -gt 0 ]; then ok=false; code=1
elif [ "$core_ran" = 0 ]; then ok=false; code=2; fi
steps_json=$(IFS=,; echo "${parts[*]}")
fmt='{"metric": "gpu_check", "ok": %s, "exit": %d, "passed": %d, "failed": %d, "skipped": %d, "device": %s, '
fmt+='"small": %s, "python": %s, "total_s": %d, "steps": {%s}}'
line=$(printf "$fmt" "$ok" "$code" "$passed" "$failed" "$skipped" "$(json_str "$DEVICE")" \
  "$([ "$SMALL" = 1 ] && echo true || echo false)" \
  "$(json_str "$PY")" $(( $(date +%s) - START )) "$steps_json")
echo "$line" >"$OUT/summary.json"
echo
echo "== gpu_check: $passed passed, $failed failed, $skipped skipped in $(( $(date +%s) - START ))s (exit $code)"
echo "$line"
exit "$code"
