#!/usr/bin/env bash
# Submit a training job to a Ray cluster with `ray job submit`: the production SkyRL GRPO + LoRA job
# (Qwen3-VL, VisGym maze); with --local the local CPU trainer (`rlops train --local`, its stand-in); with
# --skyrl-dry-run the production recipe shrunk to a few steps on CPU nodes (`rlops train --skyrl-dry-run`;
# the nodes offer logical GPUs for SkyRL's bundles: `ray.gpus_per_node`).
#
#   bash training/train_job.sh [extra SkyRL overrides key=value ...]
#   bash training/train_job.sh --local [rlops train --local options, e.g. --steps 20 --fast]
#   bash training/train_job.sh --skyrl-dry-run [--steps 3]
#
# RAY_ADDRESS is the Ray dashboard URL; unset, the local cluster `rlops up` started (ray.nodes >= 1 in
# mlflow.yaml) is used, with its token auth. The recipe's overrides come from the rlops config (`training`
# section of mlflow.yaml, or RLOPS_CONFIG) and appear on the submitted command line; extra overrides given
# here come last and win. The non-secret MLflow, S3 and RLOPS_* variables of this shell reach the job
# through a runtime-env file readable only by you. Credentials never do (Ray shows a runtime env in job info
# and logs): the Ray nodes hold them in their own environment (docker/k8s/raycluster-train.yaml's Secret
# refs; locally, `rlops up` or the shell that ran `ray start`); the names withheld are printed.
# Optional: SUBMISSION_ID, PYTHON (default: python3), RLOPS_TRAINING__DATASETS_PATH / __CKPT_PATH /
# __EXPORT_PATH (paths as the cluster sees them).
# Resuming: submit again with the same checkpoint path (trainer.resume_mode=latest, same MLflow run); with
# --local or --skyrl-dry-run, with the same RUN_DIR (default <data_dir>/runs/<submission id>, printed), which holds the
# tracker's spool and state. `ray job logs --follow`, `ray job stop` (the run ends KILLED) work as usual.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
trainer=skyrl
if [[ "${1:-}" == "--local" || "${1:-}" == "--skyrl-dry-run" ]]; then
  trainer="$1"  # the `rlops train` flag of that trainer
  shift
fi

if [[ -z "${RAY_ADDRESS:-}" ]]; then
  while IFS='=' read -r name value; do
    [[ -n "$name" ]] && export "$name=$value"
  done < <(cd "$repo" && "$python" -m training.skyrl_main --print-cluster-env)
fi
: "${RAY_ADDRESS:?set RAY_ADDRESS to the Ray dashboard URL, e.g. http://127.0.0.1:8265, or set ray.nodes in mlflow.yaml and run rlops up}"
submission_id="${SUBMISSION_ID:-grpo-$(date -u +%Y%m%d-%H%M%S)}"

if [[ "$trainer" != skyrl ]]; then
  # The job runs in Ray's own working dir: give it this shell's config file and data dir as absolute paths.
  while IFS='=' read -r name value; do
    [[ -n "$name" ]] && export "$name=$value"
  done < <(cd "$repo" && "$python" -m training.skyrl_main --print-local-env)
  run_dir="${RUN_DIR:-$RLOPS_DATA_DIR/runs/$submission_id}"
  echo "train_job.sh: run dir $run_dir (submit again with RUN_DIR=$run_dir to resume)" >&2
  entrypoint=(python -m rlops train "$trainer" --run-dir "$run_dir" "$@")
else
  recipe="$(cd "$repo" && "$python" -m training.skyrl_main --print-overrides)"
  mapfile -t overrides <<<"$recipe"
  entrypoint=(python -m training.skyrl_main "${overrides[@]}" "$@")
fi

env_file="$(umask 077 && mktemp "${TMPDIR:-/tmp}/rlops-runtime-env.XXXXXX")"
trap 'rm -f "$env_file"' EXIT
(cd "$repo" && "$python" -m training.skyrl_main --print-runtime-env) >"$env_file"

ray job submit --address "$RAY_ADDRESS" \
  --submission-id "$submission_id" \
  --runtime-env "$env_file" \
  -- "${entrypoint[@]}"
