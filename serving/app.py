"""The serving app: Ray Serve LLM's `build_openai_app` with the alias ingress, configured from `mlflow.yaml`.

`app_args(config)` is the one description of the app; `build_app` builds it for `serve.run`, and
`serve_config_v2` emits the same args as a KubeRay RayService `serveConfigV2` (secrets as references).
"""
from __future__ import annotations

from typing import Any, Mapping

from rlops.config import Config, ConfigError, s3_environment

INGRESS_CLS = "serving.ingress:AliasIngress"
TRANSFORMERS_ENGINE_CLS = "serving.engines.transformers_engine:TransformersEngine"
ENGINE_CLS_ENV = "RAYLLM_VLLM_ENGINE_CLS"
CPU_ENGINE_KEY = "rlops_cpu_engine"  # LLMConfig.experimental_configs entry with our CPU engines' settings
APP_NAME = "rlops"
S3_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def resolve_engine(config: Config, has_gpu: bool) -> str:
    """`auto` is vLLM where a GPU is present, else the transformers CPU engine."""
    if config.serving.engine != "auto":
        return config.serving.engine
    return "vllm" if has_gpu else "transformers"


def llm_config(config: Config, engine: str) -> dict[str, Any]:
    """The `LLMConfig` of the base model with dynamic LoRA loading from the immutable adapter folders."""
    serving = config.serving
    engine_kwargs: dict[str, Any] = {"max_loras": serving.max_loras, "max_lora_rank": serving.max_lora_rank}
    if engine == "vllm":
        engine_kwargs["enable_lora"] = True  # Ray does not turn LoRA on in vLLM by itself
    engine_kwargs.update(serving.engine_kwargs)
    llm: dict[str, Any] = {
        "model_loading_config": {"model_id": serving.base_model_id, "model_source": config.base_model_source},
        "lora_config": {"dynamic_lora_loading_path": config.lora_path,
                        "max_num_adapters_per_replica": serving.max_loras},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {
            "autoscaling_config": {"min_replicas": serving.min_replicas, "max_replicas": serving.max_replicas},
        },
    }
    if engine == "transformers":
        llm["runtime_env"] = {"env_vars": {ENGINE_CLS_ENV: TRANSFORMERS_ENGINE_CLS}}
        # engine_kwargs must be vLLM args (Ray validates them even for a swapped engine): ours go here.
        llm["experimental_configs"] = {CPU_ENGINE_KEY: {"torch_threads": serving.cpu_threads,
                                                        "default_max_tokens": serving.default_max_tokens}}
        llm["placement_group_config"] = {"bundles": [{"CPU": serving.replica_cpus}]}
        llm["deployment_config"]["ray_actor_options"] = {"num_cpus": serving.replica_cpus}
    return llm


def ingress_settings(config: Config) -> dict[str, Any]:
    serving = config.serving
    return {
        "base_model_id": serving.base_model_id,
        "lora_path": config.lora_path,
        "served_aliases": list(config.registry.served_aliases),
        "default_alias": config.registry.default_alias,
        "staleness_s": serving.routes_staleness_s,
        "max_request_bytes": serving.max_request_bytes,
        "api_keys_env": serving.api_keys_env,
    }


def app_args(config: Config, engine: str, ingress_cls: str = INGRESS_CLS) -> dict[str, Any]:
    """The `build_openai_app` args: one LLM config and the alias ingress with its settings (no secrets)."""
    if not config.lora_path.startswith("s3://"):
        raise ConfigError(f"serving.dynamic_lora_loading_path {config.lora_path!r}: must be an s3:// URI")
    args: dict[str, Any] = {
        "llm_configs": [llm_config(config, engine)],
        "ingress_cls_config": {"ingress_cls": ingress_cls, "ingress_extra_kwargs": {"settings": ingress_settings(config)}},
    }
    if engine == "transformers":
        args["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": config.serving.replica_cpus}}
    return args


def build_app(config: Config, engine: str | None = None):
    """The Ray Serve application (for `serve.run`); `engine` defaults to `resolve_engine` on this machine."""
    from ray.serve.llm import build_openai_app

    if engine is None:
        import torch

        engine = resolve_engine(config, torch.cuda.is_available())
    return build_openai_app(app_args(config, engine))


def job_environment(config: Config, environ: Mapping[str, str]) -> dict[str, str]:
    """Env for every replica of a local run (Ray's job-level runtime env): S3 settings, and the API keys
    variable when auth is on (the ingress replica does not inherit the LLM deployment's runtime env)."""
    env = s3_environment(config, environ)
    name = config.serving.api_keys_env
    if name:
        if not environ.get(name, "").strip():
            raise ConfigError(f"serving.api_keys_env is {name}, but {name} is unset or empty")
        env[name] = environ[name]
    return env


def serve_config_v2(config: Config) -> dict[str, Any]:
    """A RayService `spec.serveConfigV2` (vLLM engine, for GPU clusters) plus the pod env it expects.

    Secrets are never values here: S3 credentials and API keys are `secretKeyRef`s to the Kubernetes
    Secret `serving.secrets_name`, to be put in the env of every Ray container.
    """
    # Placeholder credentials only make s3_environment skip its credential lookup; they are filtered out.
    placeholders = dict.fromkeys(S3_SECRET_ENV, "-")
    env_vars = {k: v for k, v in s3_environment(config, placeholders).items() if k not in S3_SECRET_ENV}
    application = {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": "ray.serve.llm:build_openai_app",
        "runtime_env": {"env_vars": env_vars},
        "args": app_args(config, "vllm" if config.serving.engine == "auto" else config.serving.engine),
    }
    secret_names = [*S3_SECRET_ENV, *([config.serving.api_keys_env] if config.serving.api_keys_env else [])]
    pod_env = [{"name": name, "valueFrom": {"secretKeyRef": {"name": config.serving.secrets_name, "key": name}}}
               for name in secret_names]
    return {
        "serveConfigV2": {"http_options": {"host": "0.0.0.0", "port": 8000}, "applications": [application]},
        "podEnv": pod_env,
    }


def run(config: Config, environ: Mapping[str, str], *, blocking: bool = True) -> None:
    """Start a local Ray, Serve on `serving.host:port`, and the app (`rlops serve`); blocks until stopped."""
    import ray
    from ray import serve

    serving = config.serving
    env = job_environment(config, environ)
    # address="local": always a fresh Ray of our own, never a cluster some other tool started here.
    ray.init(address="local", num_cpus=serving.local_num_cpus, runtime_env={"env_vars": env}, include_dashboard=False,
             _metrics_export_port=serving.metrics_port)
    app = build_app(config)
    serve.start(http_options={"host": serving.host, "port": serving.port})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=blocking)
