#!/usr/bin/env bash
# Submit the production SkyRL GRPO + LoRA job (Qwen3-VL, VisGym maze) to a Ray cluster.
#
#   RAY_ADDRESS=http://127.0.0.1:8265 bash training/train_job.sh [extra SkyRL overrides key=value ...]
#
# The recipe's overrides come from the rlops config (`training` section of mlflow.yaml, or RLOPS_CONFIG)
# and appear on the submitted command line; extra overrides given here come last and win. The non-secret
# MLflow, S3 and RLOPS_* variables of this shell reach the job through a runtime-env file readable only by
# you. Credentials never do (Ray shows a runtime env in job info and logs): the Ray nodes hold them in
# their own environment (docker/k8s/raycluster-train.yaml's Secret refs; locally, the shell that ran
# `ray start`); the names withheld are printed. Optional: SUBMISSION_ID, PYTHON (default: python3),
# RLOPS_TRAINING__DATASETS_PATH / __CKPT_PATH / __EXPORT_PATH (paths as the cluster sees them).
# Resuming: submit again with the same checkpoint path (trainer.resume_mode=latest, same MLflow run).
set -euo pipefail

: "${RAY_ADDRESS:?set RAY_ADDRESS to the Ray dashboard URL, e.g. http://127.0.0.1:8265}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"

recipe="$(cd "$repo" && "$python" -m training.skyrl_main --print-overrides)"
mapfile -t overrides <<<"$recipe"

env_file="$(umask 077 && mktemp "${TMPDIR:-/tmp}/rlops-runtime-env.XXXXXX")"
trap 'rm -f "$env_file"' EXIT
(cd "$repo" && "$python" -m training.skyrl_main --print-runtime-env) >"$env_file"

ray job submit --address "$RAY_ADDRESS" \
  --submission-id "${SUBMISSION_ID:-grpo-$(date -u +%Y%m%d-%H%M%S)}" \
  --runtime-env "$env_file" \
  -- python -m training.skyrl_main "${overrides[@]}" "$@"
