#!/usr/bin/env bash
# (Re)create .whl/: the wheels that `rlops train --local` needs on the offline GPU machine (the device's
# 'cuda' image: Python 3.12, torch, transformers, peft, accelerate, pyarrow, pandas, ... already there) and
# that its image lacks: trl + datasets, pydantic, and mlflow-skinny with what `import mlflow` needs.
#
# Why these and no more (checked by importing the trainer's chain with only the image's packages + these):
# - mlflow-skinny, not mlflow: the tracker and trainer use MlflowClient, mlflow.entities, mlflow.utils.*,
#   mlflow.protos and mlflow.system_metrics, all in skinny (mlflow-tracing is a subset of skinny: not needed).
# - `import mlflow` itself imports fastapi (mlflow.gateway, via mlflow.genai), opentelemetry (api, sdk, proto,
#   semantic-conventions), cachetools, sqlparse, importlib_metadata, and asks find_spec("databricks.agents"),
#   which needs the `databricks` namespace package: databricks-sdk (its modules are not imported).
# - Not carried (declared by mlflow-skinny but not imported on this path): gitpython, uvicorn, python-dotenv,
#   google-auth/cryptography (databricks.sdk); boto3 (S3 artifacts: the offline mode uploads nothing).
# - Not carried either, the image has them (2026-12 reading): typing_extensions 4.16.0 (pydantic 2.14 needs >= 4.16.0),
#   pyarrow 25.0.1, huggingface_hub 1.33.0, fsspec 2026.7.0, protobuf 7.36.2, anyio 4.15.1, accelerate, peft, pandas.
# Checked on nvidia-h200 (2026-12-04): imports, `rlops train --help`, a 4-step offline `train --local --fast` on CUDA.
#
# Usage, in the repo root (pip of any Python here; downloads cp312 manylinux wheels for the device):
#   bash scripts/gpu_wheels.sh            # -> .whl/ (19 wheels, about 11 MiB), ignored via .git/info/exclude
# On the device (run tool, carry [".whl"]), begin the command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
#   python3 -m rlops.cli --config <offline yaml> train --local ...
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    # the trainer (TRL GRPO) and its dataset library
    trl==1.16.0
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    # rlops.config and every other pydantic model
    pydantic==2.14.4
    pydantic_core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    # the tracker (mlflow client only) and what `import mlflow` imports
    mlflow-skinny==3.17.2
    cachetools==7.3.3
    opentelemetry-api==1.45.2
    opentelemetry-sdk==1.45.2
    opentelemetry-proto==1.45.2
    opentelemetry-semantic-conventions==0.66b2
    sqlparse==0.6.1
    importlib_metadata==9.1.0
    fastapi==0.136.3
    starlette==1.10.0
    databricks-sdk==0.162.0
)

grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls .whl/*.whl | wc -l | xargs echo "wheels:"
du -sh .whl
