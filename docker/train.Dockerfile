# Training (RayCluster + `ray job submit`): SkyRL's GPU base (CUDA, uv, system deps) + SkyRL 0.3.0 with
# its FSDP stack + this package with the `skyrl` extra + mlflow, so the tracker callbacks run inside the
# Ray job (SkyRL's entrypoint is a Ray task: the package must be installed on every node).
# Build from the repo root: docker build -f docker/train.Dockerfile -t rlops-train:0.1.0 .
# SkyRL puts the versions in the image name and publishes a single tag per name.
# hadolint ignore=DL3006
FROM novaskyai/skyrl-train-ray-2.56.0-py3.12-cu12.8

# skyrl 0.3.0 pins ray==2.56.0, the base image's Ray.
# uv installs (pip only bootstraps it), as scripts/install.sh does.
RUN pip install --no-cache-dir "uv==0.13.8" \
    && uv pip install --system --no-cache "skyrl[skyrl-train,fsdp]==0.3.0" "mlflow==3.17.2"
COPY --chown=ray:users pyproject.toml README.md /tmp/rlops/
COPY --chown=ray:users rlops /tmp/rlops/rlops
COPY --chown=ray:users tracker /tmp/rlops/tracker
COPY --chown=ray:users training /tmp/rlops/training
COPY --chown=ray:users tasks /tmp/rlops/tasks
COPY --chown=ray:users serving /tmp/rlops/serving
COPY --chown=ray:users registry_hooks /tmp/rlops/registry_hooks
# The submit script, run from the head pod (docs/deployment.md); it resolves the installed package.
COPY --chown=ray:users training/train_job.sh /opt/rlops/training/train_job.sh
RUN uv pip install --system --no-cache "/tmp/rlops[skyrl]" \
    && rm -rf /tmp/rlops \
    && python -c "import tracker, training, skyrl.train.trainer" \
    && rlops --help >/dev/null
