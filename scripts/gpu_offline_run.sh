#!/usr/bin/env bash
# The offline GPU run (issue 32): GRPO on a GPU machine that cannot reach MLflow, tracked offline, brought
# home as one bundle. Run on that machine in the repo root, after `bash scripts/gpu_wheels.sh` made .whl/
# here and the tree (with .whl/) was carried there:
#   OUT=<folder that comes back> [STEPS=300 BUDGET=420 EVAL_EVERY=20 PROMPTS=8 BASE_TGZ=base.tgz] \
#     [LOCAL='learning_rate: 5e-4, beta: 0.04'] [TAG=a] bash scripts/gpu_offline_run.sh
# The defaults are the recipe that lifted the tiny base 19/64 -> 30/64 on an H200 (bench/README.md).
# LOCAL: more training.local settings (YAML flow mapping body; LOCAL= for none). TAG: a name for this run's
# scratch paths and output files, so several runs share one GPU at once (each gets its own folders under /tmp).
# BASE_TGZ: a base.tgz of an earlier run, so the SFT base is not built again (and stays the one served).
# It writes to $OUT (names end in -$TAG when set): gpu-run.tgz (the run: `rlops runs sync gpu-run.tgz` here), base.tgz (the SFT base the
# adapter was trained on: serving here needs the same base), train.json (the trainer's result) and train.log.
# Then, on a machine that reaches the stack (README "Train where MLflow cannot be reached"):
#   tar xzf base.tgz -C <data_dir>/models   # the served base = the trained one
#   rlops runs sync gpu-run.tgz && promote <model> --version N --to production && promote verify <model>
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to the folder that comes back}"
STEPS="${STEPS:-300}"
BUDGET="${BUDGET:-420}"
EVAL_EVERY="${EVAL_EVERY:-20}"
PROMPTS="${PROMPTS:-8}"
LOCAL="${LOCAL-learning_rate: 5e-4, beta: 0.04}"
LOCAL="${LOCAL:+, $LOCAL}"
TAG="${TAG:+-$TAG}"
SITE=/tmp/rlops-site
DATA=/tmp/rlops-gpu-data$TAG
RUN_DIR=/tmp/rlops-gpu-run$TAG
CONFIG=/tmp/rlops-gpu$TAG.yaml

( flock 9; [ -d "$SITE" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    .whl/*.whl ) 9>/tmp/rlops-site.lock
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cat >"$CONFIG" <<EOF
data_dir: $DATA
tracking: {mode: offline, system_metrics_interval_s: 5}
training:
  local: {steps: $STEPS, budget_s: $BUDGET, eval_interval: $EVAL_EVERY, ckpt_interval: $EVAL_EVERY, prompts_per_step: $PROMPTS$LOCAL}
EOF
if [ -n "${BASE_TGZ:-}" ]; then mkdir -p "$DATA/models" && tar xzf "$BASE_TGZ" -C "$DATA/models"; fi
rlops() { python3 -m rlops.cli --config "$CONFIG" "$@"; }
python3 -c 'import torch; print("cuda:", torch.cuda.is_available(), torch.cuda.get_device_name(0))'
start=$(date +%s)
rlops base build 2>&1 | tail -5
rlops train --local --run-dir "$RUN_DIR" --json -v >"$OUT/train$TAG.json" 2>"$OUT/train$TAG.log" || { tail -40 "$OUT/train$TAG.log"; exit 1; }
echo "GPU minutes (base + GRPO): $(( ($(date +%s) - start) / 60 ))"
rlops runs export "$RUN_DIR" -o "$OUT/gpu-run$TAG.tgz"
tar czf "$OUT/base$TAG.tgz" -C "$DATA/models" base
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('curve', r['curve'])" "$OUT/train$TAG.json"
