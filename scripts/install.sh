#!/usr/bin/env bash
# Installs the project into .venv following the CPU recipe (shared/notes/install-recipe.md):
# CPU torch first, everything else under one pin set, the packages whose metadata clashes with the
# pin set --no-deps, then a guard that no CUDA companion slipped in (they break ray.serve.llm on CPU).
set -euo pipefail
EXTRAS="${1:-dev}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
CONSTRAINTS=constraints/cpu.txt

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install torch==2.13.0
"${PIP[@]}" install -c "$CONSTRAINTS" -e ".[$EXTRAS]"
# Only the protocol/config modules of vllm are used on CPU; skyrl's metadata pins transformers<=5.8
# and peft==0.18.1, which clash with vllm's; both work with the pinned set. TRL's import of vllm
# reaches xgrammar/llguidance/tvm-ffi (with deps they would pull ~1 GB of triton).
"${PIP[@]}" install -c "$CONSTRAINTS" --no-deps vllm==0.29.0 skyrl==0.3.0 xgrammar==0.2.9 \
    llguidance==1.7.6 apache-tvm-ffi==0.1.11
"$VENV/bin/python" - <<'PY'
import importlib.util, sys
import torch
problems = []
if not torch.__version__.startswith("2.13.0") or torch.version.cuda is not None:
    problems.append(f"torch is {torch.__version__} (cuda={torch.version.cuda}); expected the CPU build 2.13.0")
for name in ("torchvision", "torchaudio", "torchcodec", "triton", "flash_attn"):
    if importlib.util.find_spec(name) is not None:
        problems.append(f"{name} is installed; it breaks ray.serve.llm on CPU torch (pip uninstall -y {name})")
if problems:
    sys.exit("install guard failed:\n  " + "\n  ".join(problems))
print("install guard ok: CPU torch", torch.__version__)
PY
# tests/test_postgres.py runs MLflow on a real PostgreSQL server: Debian's package, installed once (as root,
# as in CI); elsewhere only a hint, and those tests skip (under CI=true a skip fails).
if [ "$EXTRAS" = dev ] && ! command -v initdb >/dev/null && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "note: no PostgreSQL server found; tests/test_postgres.py needs one (apt-get install postgresql)" >&2
    fi
fi
