#!/usr/bin/env bash
# The offline GPU run (issue 32): GRPO on a GPU machine that cannot reach MLflow, tracked offline, brought
# home as one bundle. Run on that machine in the repo root, after `bash scripts/gpu_wheels.sh` made .whl/
# here and the tree (with .whl/) was carried there:
#   OUT=<folder that comes back> STEPS=200 BUDGET=420 [EVAL_EVERY=20 PROMPTS=8 BASE_TGZ=base.tgz] \
#     bash scripts/gpu_offline_run.sh
# BASE_TGZ: a base.tgz of an earlier run, so the SFT base is not built again (and stays the one served).
# It writes to $OUT: gpu-run.tgz (the run: `rlops runs sync gpu-run.tgz` here), base.tgz (the SFT base the
# adapter was trained on: serving here needs the same base), train.json (the trainer's result) and train.log.
# Then, on a machine that reaches the stack (README "Train where MLflow cannot be reached"):
#   tar xzf base.tgz -C <data_dir>/models   # the served base = the trained one
#   rlops runs sync gpu-run.tgz && promote <model> --version N --to production && promote verify <model>
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to the folder that comes back}"
STEPS="${STEPS:-200}"
BUDGET="${BUDGET:-420}"
EVAL_EVERY="${EVAL_EVERY:-20}"
PROMPTS="${PROMPTS:-8}"
SITE=/tmp/rlops-site
DATA=/tmp/rlops-gpu-data
RUN_DIR=/tmp/rlops-gpu-run
CONFIG=/tmp/rlops-gpu.yaml

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cat >"$CONFIG" <<EOF
data_dir: $DATA
tracking: {mode: offline, system_metrics_interval_s: 5}
training:
  local: {steps: $STEPS, budget_s: $BUDGET, eval_interval: $EVAL_EVERY, ckpt_interval: $EVAL_EVERY, prompts_per_step: $PROMPTS}
EOF
if [ -n "${BASE_TGZ:-}" ]; then mkdir -p "$DATA/models" && tar xzf "$BASE_TGZ" -C "$DATA/models"; fi
rlops() { python3 -m rlops.cli --config "$CONFIG" "$@"; }
python3 -c 'import torch; print("cuda:", torch.cuda.is_available(), torch.cuda.get_device_name(0))'
start=$(date +%s)
rlops base build 2>&1 | tail -5
rlops train --local --run-dir "$RUN_DIR" --json -v >"$OUT/train.json" 2>"$OUT/train.log" || { tail -40 "$OUT/train.log"; exit 1; }
echo "GPU minutes (base + GRPO): $(( ($(date +%s) - start) / 60 ))"
rlops runs export "$RUN_DIR" -o "$OUT/gpu-run.tgz"
tar czf "$OUT/base.tgz" -C "$DATA/models" base
ls -la "$OUT"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('curve', r['curve'])" "$OUT/train.json"
