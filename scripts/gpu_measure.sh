#!/usr/bin/env bash
# Every GPU measurement of issue 14 on one 2-GPU machine, each written as JSON under $OUT.
#
#   scripts/gpu_measure.sh [all|tests|runs|bench|step]     (default: all; run from the repository root)
#
# tests: the GPU tests (tests/gpu, marked gpu; TESTS=path picks some) -> gpu_tests.json
# runs:  colocate run --device cuda --ranks 2, tiny and llama-1b (MODELS=... picks) -> run_<model>.json
# bench: benchmarks/restore.py --ranks 2 and update_weights.py at llama-1b, digest_rate.py at 4 GiB
#        -> restore.json, update_weights.json, digest_rate.json
# step:  benchmarks/step_overhead.py on one GPU, llama-1b (STEP_MODELS=..., STEP_OFFLOAD=always|auto|never,
#        STEP_OPTIONS=... other run options)
#        -> step_<model>.json
# ckpt:  colocate run --device cuda --ranks 1, 4 steps saving every 2, then resumed from step 2, per model
#        (CKPT_MODELS=..., default tiny qwen-0.5b) -> checkpoint.json: SHA256s, rewards, save and load seconds, bytes
# families: colocate run --device cuda --model qwen3-4b (whole), glm-5 and deepseek-v3 (3 layers, 16 experts)
#        (FAMILIES="name:layers:experts ...", FAMILY_STEPS, FAMILY_OPTIONS: other run options) -> family_<model>.json
# learn: colocate run --device cuda --ranks 1, 50 steps, per MODEL:LR[:OPTIONS] of LEARN (options: commas for spaces)
#        -> learn_<model>_<lr>.json: each run's report, and its wall seconds
# check: colocate check --json for qwen3-4b and a GLM-5 of 2 layers and 16 experts (its config.json written by
#        the job's own shrink) -> check_<name>.json, the tables in check.log
# Everything's output also goes to $OUT/<part>.log.
set -uo pipefail
OUT=${OUT:?set OUT to the folder for the results}
PART=${1:-all}
# NVLink multicast stays off: a program that uses it can take the host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
PY=${PYTHON:-python3}
TINY_STEPS=${TINY_STEPS:-30}
BIG_STEPS=${BIG_STEPS:-12}

tests() {
  timeout "${TEST_TIMEOUT:-480}" $PY -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/gpu} -rA -s \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/tests.log" | tail -40
  $PY - "$OUT/gpu_tests.xml" "$OUT/gpu_tests.json" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
cases = []
for case in root.iter("testcase"):
    outcome = "passed"
    for kind in ("failure", "error", "skipped"):
        node = case.find(kind)
        if node is not None:
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
            detail = (node.get("message") or "")[:500]
            break
    else:
        detail = ""
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time", 0)), "detail": detail})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
json.dump({"counts": counts, "cases": cases}, open(sys.argv[2], "w"), indent=1)
print(counts)
PYEOF
  rm -f "$OUT/gpu_tests.xml"
}

runs() {
  for model in ${MODELS:-tiny llama-1b}; do
    steps=$([ "$model" = tiny ] && echo "$TINY_STEPS" || echo "$BIG_STEPS")
    timeout "${RUN_TIMEOUT:-300}" $PY -m orchestrator.cli run --device cuda --ranks 2 --model "$model" \
      --steps "$steps" --report "$OUT/run_$model.json" 2>&1 | tee -a "$OUT/runs.log" | tail -30
  done
}

bench() {
  timeout "${BENCH_TIMEOUT:-300}" $PY benchmarks/restore.py --ranks 2 --preset llama-1b --json \
    > "$OUT/restore.json" 2> >(tee -a "$OUT/bench.log" | tail -20 >&2)
  timeout "${BENCH_TIMEOUT:-300}" $PY benchmarks/update_weights.py --preset llama-1b \
    --buckets-mib 64 256 1024 4096 --json > "$OUT/update_weights.json" 2> >(tee -a "$OUT/bench.log" | tail -20 >&2)
  timeout "${BENCH_TIMEOUT:-300}" $PY benchmarks/digest_rate.py --gib 4 \
    > "$OUT/digest_rate.json" 2> >(tee -a "$OUT/bench.log" | tail -20 >&2)
  tail -c 3000 "$OUT/restore.json" "$OUT/update_weights.json" "$OUT/digest_rate.json"
}

step() {
  for model in ${STEP_MODELS:-llama-1b}; do
    timeout "${STEP_TIMEOUT:-300}" $PY benchmarks/step_overhead.py --device cuda --model "$model" \
      --steps "${STEP_STEPS:-6}" --offload "${STEP_OFFLOAD:-auto}" --out "$OUT/step_$model${STEP_SUFFIX:-}.json" \
      -- ${STEP_OPTIONS:-} 2>&1 \
      | tee -a "$OUT/step.log" | tail -12
  done
}

ckpt() {
  local dir
  dir=$(mktemp -d)
  for model in ${CKPT_MODELS:-tiny qwen-0.5b}; do
    timeout "${RUN_TIMEOUT:-300}" $PY -m orchestrator.cli run --device cuda --ranks 1 --model "$model" --steps 4 \
      --save-every 2 --save-dir "$dir/$model" --report "$dir/$model.a.json" 2>&1 | tee -a "$OUT/ckpt.log" | tail -8
    du -sb "$dir/$model/step-000002" > "$dir/$model.bytes"
    rm -rf "$dir/$model/step-000004"
    timeout "${RUN_TIMEOUT:-300}" $PY -m orchestrator.cli run --device cuda --ranks 1 --model "$model" --steps 4 \
      --resume "$dir/$model" --report "$dir/$model.b.json" 2>&1 | tee -a "$OUT/ckpt.log" | tail -8
  done
  $PY - "$dir" "$OUT/checkpoint.json" ${CKPT_MODELS:-tiny qwen-0.5b} <<'PYEOF'
import json, pathlib, sys
d, out, models = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
result = {}
for m in models:
    try:
        a, b = (json.loads((d / f"{m}.{x}.json").read_text()) for x in "ab")
    except OSError as e:
        result[m] = {"error": str(e)}
        continue
    result[m] = {
        "sha256": [a.get("weights_sha256"), b.get("weights_sha256")],
        "weights_equal": a.get("weights_sha256") == b.get("weights_sha256"),
        "rewards": [[s["reward_mean"] for s in r["steps"]] for r in (a, b)],
        "save_seconds": [s["phase_seconds"].get("save") for s in a["steps"]],
        "resume_seconds": b.get("resume_seconds"),
        "checkpoint_bytes": int((d / f"{m}.bytes").read_text().split()[0]),
        "errors": [a.get("error"), b.get("error")],
    }
json.dump(result, open(out, "w"), indent=1)
print(json.dumps(result, indent=1))
PYEOF
  rm -rf "$dir"
}

families() {
  # NAME:LAYERS:EXPERTS, empty for the published count; one GPU, the default offload (auto)
  for entry in ${FAMILIES:-qwen3-4b:: glm-5:3:16 deepseek-v3:3:16}; do
    IFS=: read -r model layers experts <<< "$entry"
    timeout "${RUN_TIMEOUT:-240}" $PY -m orchestrator.cli run --device cuda --ranks 1 --model "$model" \
      ${layers:+--layers "$layers"} ${experts:+--experts "$experts"} --steps "${FAMILY_STEPS:-8}" ${FAMILY_OPTIONS:-} \
      --report "$OUT/family_$model.json" 2>&1 | tee -a "$OUT/families.log" | tail -32
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$OUT/families.log" 2>&1
  done
}

learn() {
  for entry in ${LEARN:-llama-1b:5e-4 llama-1b:1e-3 llama-1b:2e-3}; do
    IFS=: read -r model lr options <<< "$entry"
    local start=$SECONDS
    timeout "${LEARN_TIMEOUT:-170}" $PY -m orchestrator.cli run --device cuda --ranks 1 --model "$model" --lr "$lr" \
      --steps "${LEARN_STEPS:-50}" ${options//,/ } --report "$OUT/learn_${model}_$lr.json" 2>&1 \
      | tee -a "$OUT/learn.log" | tail -24
    echo "$model lr $lr: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s wall" | tee -a "$OUT/learn.log"
  done
}

check() {
  local dir
  dir=$(mktemp -d)
  $PY -c "import json, sys; from orchestrator.job.models import family_model
json.dump(family_model('glm-5', layers=2, experts=16).served, open(sys.argv[1], 'w'), indent=1)" "$dir/config.json"
  for target in qwen3-4b "$dir"; do
    name=$([ "$target" = qwen3-4b ] && echo qwen3-4b || echo glm-5-2l16e)
    timeout 150 $PY -m orchestrator.cli check "$target" 2>&1 | tee -a "$OUT/check.log" | tail -4
    timeout 150 $PY -m orchestrator.cli check "$target" --json > "$OUT/check_$name.json" 2>> "$OUT/check.log"
    echo "check $name: exit $?" | tee -a "$OUT/check.log"
  done
  rm -rf "$dir"
}

case "$PART" in
  all) tests; runs; bench ;;
  families) families ;;
  learn) learn ;;
  check) check ;;
  step) step ;;
  ckpt) ckpt ;;
  tests) tests ;;
  runs) runs ;;
  bench) bench ;;
  *) echo "unknown part $PART: all, tests, runs, bench, step, ckpt, families, learn or check" >&2; exit 2 ;;
esac
