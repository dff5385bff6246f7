# Serving (RayService) and the promotion hooks: Ray's LLM image at our ray pin (it carries vLLM, CUDA and
# Ray Serve LLM) + boto3 (ray[llm] does not bring it) + the MLflow client + this package.
# Build from the repo root: docker build -f docker/serve.Dockerfile -t rlops-serve:0.1.0 .
FROM rayproject/ray-llm:2.60.0-py311-cu128

# This package goes in --no-deps: the image's ray/vllm/transformers stay as Ray built them; its own needs
# beyond the image are boto3 and the MLflow client (registry_hooks). The last step fails the build if the
# image lacks anything the serving app or the CLI (`rlops hooks serve`) imports.
# uv installs (pip only bootstraps it), as scripts/install.sh does; the image already carries the GPU vllm.
RUN pip install --no-cache-dir "uv==0.13.8" \
    && uv pip install --system --no-cache "boto3==1.44.8" "mlflow-skinny==3.17.2"
COPY --chown=ray:users pyproject.toml README.md /tmp/rlops/
COPY --chown=ray:users rlops /tmp/rlops/rlops
COPY --chown=ray:users serving /tmp/rlops/serving
COPY --chown=ray:users registry_hooks /tmp/rlops/registry_hooks
COPY --chown=ray:users tracker /tmp/rlops/tracker
COPY --chown=ray:users tasks /tmp/rlops/tasks
RUN uv pip install --system --no-cache --no-deps /tmp/rlops \
    && rm -rf /tmp/rlops \
    && python -c "import serving, registry_hooks, tasks.maze, ray.serve.llm" \
    && rlops --help >/dev/null
