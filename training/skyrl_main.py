"""The production job: SkyRL GRPO + LoRA on Qwen3-VL for the VisGym maze, tracked by `tracker.skyrl`.

Submitted by `training/train_job.sh` as `python -m training.skyrl_main <SkyRL overrides...>`. The
recipe's overrides come from the `training` section of the rlops config (mlflow.yaml), printed by
`--print-overrides` so the submitted command line shows them; later overrides win. Inside the Ray task
the `visgym` env is registered and `TrackedPPOExp` (our run, our callback, HF-export archiving) runs.

    python -m training.skyrl_main --print-overrides     # the recipe, one override per line
    python -m training.skyrl_main --print-runtime-env   # Ray runtime env JSON (MLflow/S3/rlops env, no secrets)
    python -m training.skyrl_main --print-cluster-env   # RAY_ADDRESS and token auth of `rlops up`'s cluster
    python -m training.skyrl_main --print-local-env     # absolute RLOPS_CONFIG / RLOPS_DATA_DIR (train_job.sh --local)
    python -m training.skyrl_main [overrides...]         # run (on the cluster, inside `ray job submit`)
"""
from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, Mapping, Sequence

from rlops.config import Config, find_config_file, is_secret_key, load_config, mask_value, ray_client_env
from rlops.task import Task, TaskError

# Forwarded to the Ray job. Ray shows a runtime env on its Jobs page, in job info and in its logs, so no
# credential goes there: the Ray nodes have them in their own environment (the Secret refs of
# docker/k8s/raycluster-train.yaml; locally, the shell that ran `ray start`).
FORWARDED_ENV = (
    "MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
    "RLOPS_CONFIG",
)


def merge_runtime_env_with_the_job() -> None:
    """Inside a Ray job, let SkyRL's `ray.init(runtime_env=...)` merge with the job's runtime env: it repeats
    the job's MLFLOW_TRACKING_URI (read from this driver's env, so the same value), and Ray refuses a driver
    env var the job also sets unless told the driver's wins."""
    os.environ["RAY_OVERRIDE_JOB_RUNTIME_ENV"] = "1"


def recipe_overrides(config: Config) -> list[str]:
    """SkyRL CLI overrides for the VisGym maze recipe (the `training` section), in SkyRL current keys."""
    training = config.training
    datasets = (training.datasets_path or str(config.data_path / "datasets")).rstrip("/")
    ckpt = training.ckpt_path or str(config.data_path / "skyrl" / "ckpt")
    export = training.export_path or str(config.data_path / "skyrl" / "export")
    return [
        f"trainer.policy.model.path={training.base_model}",
        f"trainer.policy.model.lora.rank={training.lora_rank}",
        f"trainer.policy.model.lora.alpha={training.lora_alpha}",
        "trainer.algorithm.advantage_estimator=grpo",
        "trainer.placement.colocate_all=true",
        "trainer.strategy=fsdp",
        f"generator.inference_engine.gpu_memory_utilization={training.gpu_memory_utilization}",
        f"generator.n_samples_per_prompt={training.n_samples_per_prompt}",
        f"generator.max_turns={training.max_turns}",
        "generator.vision_language_generator=true",
        "generator.batched=false",
        "generator.use_conversation_multi_turn=true",
        "trainer.remove_microbatch_padding=false",
        f"trainer.eval_interval={training.eval_interval}",
        "trainer.eval_before_train=true",  # the base's score: registration needs a checkpoint to beat it
        f"trainer.ckpt_interval={training.ckpt_interval}",
        f"trainer.hf_save_interval={training.hf_save_interval}",
        "trainer.resume_mode=latest",
        f"trainer.ckpt_path={ckpt}",
        f"trainer.export_path={export}",
        "trainer.logger=mlflow",
        f"trainer.project_name={config.tracking.experiment}",
        "environment.env_class=visgym",
        f"data.train_data=['{datasets}/skyrl/train.parquet']",
        f"data.val_data=['{datasets}/skyrl/eval.parquet']",
    ]


def cluster_env(config: Config) -> dict[str, str]:
    """What `ray job submit` needs for the local cluster of `rlops up`: its job API and token auth (a file
    path, not the token); empty without one (ray.nodes 0)."""
    if not config.ray_dashboard_url:
        return {}
    return {"RAY_ADDRESS": config.ray_dashboard_url, **ray_client_env(config)}


def local_job_env(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The config file and data dir this shell resolved, as absolute paths for a job that runs elsewhere."""
    file = find_config_file(environ=environ)
    env = {"RLOPS_DATA_DIR": str(config.data_path)}
    if file is not None:
        env["RLOPS_CONFIG"] = str(file.resolve())
    return env


def is_secret_env(name: str, value: str) -> bool:
    """A variable that must stay out of Ray: a secret-looking name, or a value with a credential or a URI password."""
    return is_secret_key(name) or mask_value(name.lower(), value) != value


def without_secrets(env_vars: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env_vars.items() if not is_secret_env(k, v)}


def skyrl_env_vars(cfg) -> dict[str, str]:
    """SkyRL's runtime env for its workers (`prepare_runtime_environment`) without the credentials it copies
    from the driver's env (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ..., utils.py:742-758): Ray shows a runtime
    env in its records, and the workers get those from the Ray nodes' own env."""
    from skyrl.train.utils.utils import prepare_runtime_environment

    return without_secrets(prepare_runtime_environment(cfg))


def initialize_ray(cfg) -> None:
    """SkyRL's `initialize_ray` (its log file, its registries) with `skyrl_env_vars` as the runtime env."""
    from skyrl.train.utils import utils

    prepare = utils.prepare_runtime_environment
    utils.prepare_runtime_environment = lambda c: without_secrets(prepare(c))
    try:
        utils.initialize_ray(cfg)
    finally:
        utils.prepare_runtime_environment = prepare


def runtime_env(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The Ray runtime env of the job: the non-secret MLflow, S3 and rlops variables of this shell.
    Returns it with the names of the variables withheld as secrets under `withheld` (not part of Ray's env)."""
    environ = os.environ if environ is None else environ
    wanted = {"MLFLOW_TRACKING_URI": config.tracking_uri}
    wanted.update({k: environ[k] for k in FORWARDED_ENV if environ.get(k)})
    wanted.update({k: v for k, v in environ.items() if k.startswith("RLOPS_") and v})
    env_vars = without_secrets(wanted)
    return {"env_vars": env_vars, "withheld": sorted(set(wanted) - set(env_vars))}


def build_skyrl_config(overrides: Sequence[str]):
    """Parse and validate the overrides with SkyRL's own config classes (raises on an unknown key)."""
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg

    cfg = SkyRLTrainConfig.from_cli_overrides(list(overrides))
    validate_cfg(cfg)
    return cfg


def register_skyrl_env(task: Task) -> None:
    """Register the task's multi-turn env with skyrl-gym under its id (idempotent)."""
    from skyrl_gym.envs import register
    from skyrl_gym.envs.registration import registry

    if not (task.skyrl_env_id and task.skyrl_env_entry_point):
        raise TaskError(f"task {task.name} has no SkyRL env (skyrl_env_id and skyrl_env_entry_point unset)")
    if task.skyrl_env_id not in registry:
        register(id=task.skyrl_env_id, entry_point=task.skyrl_env_entry_point)


def run_experiment(cfg, config: Config, register_best: bool = True) -> dict[str, str]:
    """Inside the Ray task: register the env, then run the tracked experiment; returns its MLflow run.
    `register_best` False leaves the registry alone (a dry run)."""
    from tracker.skyrl import TrackedPPOExp

    task = config.load_task()
    register_skyrl_env(task)
    exp = TrackedPPOExp(cfg, config, eval_data_source=config.training.eval_data_source,
                        task_columns=task.skyrl_sample_columns, register_best=register_best)
    exp.run()
    return {"run_id": exp.session.run_id, "experiment_id": exp.session.experiment_id}


def run_in_ray_task(cfg, config: Config, register_best: bool = True) -> dict[str, str]:
    """`run_experiment` in a Ray task (never on the head node), as SkyRL's own entrypoint runs it; returns
    its MLflow run. SIGTERM to this driver (`ray job stop`) cancels the task: Ray raises KeyboardInterrupt
    in it, its run ends KILLED, and this returns once it has (Ray would otherwise kill the task's worker
    with the driver and leave the run RUNNING)."""
    import ray

    task = ray.remote(num_cpus=1)(run_experiment).remote(cfg, config, register_best)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: ray.cancel(task, recursive=False))
    try:
        return ray.get(task)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    config = load_config()
    if args[:1] == ["--print-overrides"]:
        print("\n".join(recipe_overrides(config)))
        return
    if args[:1] in (["--print-cluster-env"], ["--print-local-env"]):
        env = cluster_env(config) if args[0] == "--print-cluster-env" else local_job_env(config)
        print("\n".join(f"{k}={v}" for k, v in env.items()))
        return
    if args[:1] == ["--print-runtime-env"]:
        env = runtime_env(config)
        if env["withheld"]:
            print(f"skyrl_main: not forwarded to Ray (secrets come from the Ray nodes' environment): "
                  f"{', '.join(env['withheld'])}", file=sys.stderr)
        print(json.dumps({"env_vars": env["env_vars"]}, indent=2))
        return
    bad = [a for a in args if "=" not in a or a.startswith("-")]
    if bad:
        raise SystemExit(f"skyrl_main: expected SkyRL overrides key=value, got {bad}")
    cfg = build_skyrl_config(args)

    merge_runtime_env_with_the_job()
    initialize_ray(cfg)
    run_in_ray_task(cfg, config)


if __name__ == "__main__":
    main()
