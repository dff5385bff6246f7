"""SkyRL production wiring on CPU, through SkyRL's own code: the recipe validates in SkyRL's config classes,
the datasets load through SkyRL's PromptDataset and feed the `visgym` env, the experiment builds the real
trainer with our callback attached and stops exactly where GPU placement groups are requested, and
train_job.sh submits the expected command line and environment (fake `ray` on PATH)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlops.config import Config
from tasks.maze import datasets as ds
from training import skyrl_main
from training.skyrl_main import build_skyrl_config, recipe_overrides, runtime_env
from training.tiny_vlm import build_tiny_vlm

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def skyrl_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("skyrl")
    ds.build_datasets(root / "datasets", ds.DatasetSpec(skyrl_train_count=32, local_train_count=8, heldout_count=4))
    return {"datasets": root / "datasets", "model": build_tiny_vlm(root / "tiny"), "root": root}


def test_recipe_validates_in_skyrl_config_classes():
    cfg = build_skyrl_config(recipe_overrides(Config()))
    assert cfg.trainer.policy.model.lora.rank == 32
    assert cfg.trainer.placement.colocate_all is True
    assert cfg.generator.inference_engine.gpu_memory_utilization == 0.45
    assert (cfg.generator.n_samples_per_prompt, cfg.generator.max_turns) == (8, 15)
    assert (cfg.trainer.eval_interval, cfg.trainer.ckpt_interval, cfg.trainer.hf_save_interval) == (10, 20, 20)
    assert cfg.trainer.algorithm.advantage_estimator == "grpo"
    assert cfg.generator.vision_language_generator is True and cfg.generator.batched is False
    assert cfg.trainer.resume_mode == "latest" and cfg.environment.env_class == "visgym"
    assert cfg.data.val_data[0].endswith("datasets/skyrl/eval.parquet")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):  # the old flat key is rejected
        build_skyrl_config(["generator.gpu_memory_utilization=0.45"])


def test_datasets_load_through_skyrl_and_feed_the_env(skyrl_data):
    import skyrl_gym
    from skyrl.train.dataset import PromptDataset

    from transformers import AutoProcessor

    from tasks.maze import MazeTask
    from training.skyrl_main import register_skyrl_env

    def register_visgym_env():
        register_skyrl_env(MazeTask(MazeTask.Options()))

    tokenizer = AutoProcessor.from_pretrained(str(skyrl_data["model"])).tokenizer
    eval_set = PromptDataset(datasets=[str(skyrl_data["datasets"] / "skyrl" / "eval.parquet")], tokenizer=tokenizer,
                             max_prompt_length=512, num_workers=1)
    assert len(eval_set) == 64
    messages, env_class, extras, _ = eval_set[5]
    assert env_class == "visgym" and extras["data_source"] == "maze_2d/easy" and extras["extra_info"]["seed"] == 5
    register_visgym_env()
    env = skyrl_gym.make(env_class, env_config={}, extras={**extras, "max_turns": 15})
    conversation, _ = env.init(messages)
    assert conversation[-1]["content"][0]["type"] == "image_url"
    assert env.step("('stop', 'stop')")["done"]


def _skyrl_cfg(skyrl_data, **extra):
    paths = {"datasets_path": str(skyrl_data["datasets"]), "ckpt_path": str(skyrl_data["root"] / "ckpt"),
             "export_path": str(skyrl_data["root"] / "export")}
    overrides = recipe_overrides(Config.model_validate({"training": paths}))
    overrides += [f"trainer.policy.model.path={skyrl_data['model']}", "trainer.train_batch_size=4",
                  "trainer.policy_mini_batch_size=4", "trainer.eval_batch_size=4", "trainer.max_prompt_length=512"]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return build_skyrl_config(overrides)


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


def test_experiment_builds_trainer_with_callback_then_stops_at_gpu_placement(skyrl_data, test_config, mlflow_client,
                                                                           local_ray, monkeypatch):
    import ray
    import skyrl.train.trainer as skyrl_trainer
    # The FSDP workers import flash-attn (a GPU-only build); placement only needs their base classes.
    from skyrl.backends.skyrl_train.workers.worker import CriticWorkerBase, PolicyWorkerBase, RefWorkerBase
    from skyrl.train.entrypoints.main_base import BasePPOExp

    from tracker.skyrl import TrackedPPOExp, TrackedRayPPOTrainer, TrackerCallback

    # Only SkyRL's wait for GPUs is shortened (its own timeout knob); nothing of the path is replaced.
    monkeypatch.setattr(skyrl_trainer, "SKYRL_RAY_PG_TIMEOUT_IN_S", 3)
    monkeypatch.setattr(BasePPOExp.get_colocate_pg, "__defaults__", (3,))

    # Without colocation, building the experiment needs no GPU: our run starts, the real trainer is built
    # with our callback attached, and the first failure is the policy workers' GPU placement group.
    test_config.tracking.system_metrics_interval_s = 0.5
    exp = TrackedPPOExp(_skyrl_cfg(skyrl_data, **{"trainer.placement.colocate_all": "false"}), test_config)
    tracker = exp.get_tracker()
    assert exp.node_monitors.actors == []  # one Ray node: the session's own monitor is that node's
    trainer = exp.get_trainer(exp.cfg, tracker, exp.tokenizer, exp.train_dataset, exp.eval_dataset,
                              inference_engine_client=None, generator=None, colocate_pg=None)
    assert isinstance(trainer, TrackedRayPPOTrainer) and trainer.rlops_callback.session is exp.session
    assert any(isinstance(cb, TrackerCallback) for cb in trainer._callback_handler.callbacks)
    with pytest.raises(RuntimeError, match=r"requiring [1-9][\d.]* GPUs"):
        trainer.build_models(PolicyWorkerBase, CriticWorkerBase, RefWorkerBase)
    # The recipe as submitted (colocate_all=true) stops earlier: constructing BasePPOExp does the same
    # tokenizer + dataset steps as above and then requests the colocated placement group, which fails.
    exp.cfg = _skyrl_cfg(skyrl_data)
    with pytest.raises(RuntimeError, match=r"placement group .*requiring [1-9][\d.]* GPUs"):
        exp.get_colocate_pg()
    exp.session.fail(RuntimeError("no GPU"))
    run = mlflow_client.get_run(exp.session.run_id)
    assert run.info.status == "FAILED" and run.data.tags["rlops.trainer"] == "skyrl"
    node = ray.get_runtime_context().get_node_id()
    assert run.data.tags[f"rlops.ray_node.{node[:8]}"].endswith(node)
    assert any(key.startswith(f"system/{node[:8]}/") for key in run.data.metrics)


def test_each_ray_node_s_system_metrics_land_under_its_node_id(local_ray, test_config, mlflow_client):
    from tracker.ray_nodes import NodeMonitors, cluster

    nodes, here = cluster()
    assert [n.label for n in nodes] == [here] and nodes[0].ip
    run_id = mlflow_client.create_run(mlflow_client.create_experiment(test_config.tracking.experiment)).info.run_id
    # the only node here stands for a remote one: its monitor runs in an actor pinned to it
    monitors = NodeMonitors.start(nodes, run_id, test_config.tracking_uri, 0.5, resume=False)
    key = f"system/{here}/cpu_utilization_percentage"
    deadline = time.monotonic() + 60
    while key not in mlflow_client.get_run(run_id).data.metrics and time.monotonic() < deadline:
        time.sleep(0.5)
    monitors.stop()
    assert key in mlflow_client.get_run(run_id).data.metrics
    assert monitors.actors == []


def test_train_job_submits_recipe_and_env_without_secrets_on_the_command_line(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    record = tmp_path / "ray-call.json"
    fake_ray = fake_bin / "ray"
    fake_ray.write_text(f"""#!{sys.executable}
import json, os, stat, sys
args = sys.argv[1:]
env_file = args[args.index("--runtime-env") + 1]
json.dump({{"argv": args, "runtime_env": json.load(open(env_file)),
            "mode": oct(stat.S_IMODE(os.stat(env_file).st_mode))}}, open({str(record)!r}, "w"))
""")
    fake_ray.chmod(fake_ray.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLOPS_", "MLFLOW_", "AWS_"))}
    env.update({"PATH": f"{fake_bin}:{env['PATH']}", "PYTHON": sys.executable, "RAY_ADDRESS": "http://ray-head:8265",
                "SUBMISSION_ID": "grpo-test", "RLOPS_CONFIG": str(REPO / "mlflow.yaml"),
                "MLFLOW_TRACKING_URI": "https://mlflow.example.com", "MLFLOW_TRACKING_PASSWORD": "s3cret-pw",
                "AWS_SECRET_ACCESS_KEY": "aws-secret-value", "RLOPS_TRAINING__DATASETS_PATH": "/data/rlops/datasets",
                "RLOPS_HOOKS__SECRET": "whsec-hooks-value",
                "RLOPS_SERVER__BACKEND_STORE_URI": "postgresql://mlflow:db-pass-value@db:5432/mlflow"})
    proc = subprocess.run(["bash", str(REPO / "training" / "train_job.sh"), "trainer.epochs=3"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    call = json.loads(record.read_text())
    argv = call["argv"]
    expected_recipe = recipe_overrides(Config.model_validate({"training": {"datasets_path": "/data/rlops/datasets"}}))
    head = ["job", "submit", "--address", "http://ray-head:8265", "--submission-id", "grpo-test", "--runtime-env"]
    assert argv[:7] == head
    assert argv[8:] == ["--", "python", "-m", "training.skyrl_main", *expected_recipe, "trainer.epochs=3"]
    for key in ("trainer.policy.model.lora.rank=32", "trainer.placement.colocate_all=true",
                "generator.inference_engine.gpu_memory_utilization=0.45", "generator.n_samples_per_prompt=8",
                "generator.max_turns=15", "trainer.eval_interval=10", "trainer.ckpt_interval=20",
                "trainer.hf_save_interval=20", "trainer.resume_mode=latest", "trainer.algorithm.advantage_estimator=grpo",
                "generator.vision_language_generator=true", "data.val_data=['/data/rlops/datasets/skyrl/eval.parquet']"):
        assert key in argv
    assert not any("s3cret" in a or "aws-secret" in a for a in argv)
    env_vars = call["runtime_env"]["env_vars"]
    assert env_vars["MLFLOW_TRACKING_URI"] == "https://mlflow.example.com"
    # Ray shows a runtime env in job info and logs: no secret goes there (the Ray nodes have them).
    secrets = ("s3cret-pw", "aws-secret-value", "whsec-hooks-value", "db-pass-value")
    assert not any(secret in json.dumps(call["runtime_env"]) for secret in secrets)
    assert "RLOPS_HOOKS__SECRET, RLOPS_SERVER__BACKEND_STORE_URI" in proc.stderr and not any(s in proc.stderr for s in secrets)
    assert env_vars["RLOPS_CONFIG"] == str(REPO / "mlflow.yaml")
    assert env_vars["RLOPS_TRAINING__DATASETS_PATH"] == "/data/rlops/datasets"
    assert call["mode"] == "0o600"
    assert not Path(argv[7]).exists()  # the runtime-env file is removed after submitting


def test_skyrl_s_ray_init_gets_no_credential_of_the_driver(monkeypatch, tmp_path):
    """SkyRL copies WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ... from the driver's env into the runtime env of
    its `ray.init` (utils.py:742-758), which Ray shows in its records; the workers get them from the nodes.
    The production driver's ray.init is observed at the call (it needs the GPU cluster to run)."""
    cfg = build_skyrl_config([*recipe_overrides(Config()), f"trainer.log_path={tmp_path}"])
    for name, value in {"WANDB_API_KEY": "wandb-secret-value", "MLFLOW_TRACKING_TOKEN": "mlflow-token-value",
                        "MLFLOW_TRACKING_URI": "http://mlflow.internal:5000", "RAY_BACKEND_LOG_LEVEL": "",
                        "SKYRL_LOG_FILE": ""}.items():
        monkeypatch.setenv(name, value)
    from skyrl.train.utils import utils

    assert {"WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"} <= set(utils.prepare_runtime_environment(cfg))
    assert skyrl_main.skyrl_env_vars(cfg)["MLFLOW_TRACKING_URI"] == "http://mlflow.internal:5000"
    calls = []
    monkeypatch.setattr("ray.init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr("skyrl.backends.skyrl_train.utils.ppo_utils.sync_registries", lambda: None)
    skyrl_main.initialize_ray(cfg)
    [call] = calls
    env_vars = call["runtime_env"]["env_vars"]
    assert env_vars["MLFLOW_TRACKING_URI"] == "http://mlflow.internal:5000" and "SKYRL_LOG_FILE" in env_vars
    for given in (env_vars, skyrl_main.skyrl_env_vars(cfg)):
        assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"} & set(given)
        assert not any("secret-value" in v or "token-value" in v for v in given.values())
    assert "WANDB_API_KEY" in utils.prepare_runtime_environment(cfg)  # SkyRL's own function is left as it was


def test_train_job_requires_ray_address():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(["bash", str(REPO / "training" / "train_job.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "RAY_ADDRESS" in proc.stderr


def test_runtime_env_defaults_the_tracking_uri_from_config():
    config = Config.model_validate({"tracking": {"uri": "http://mlflow.internal:5000"}})
    assert runtime_env(config, environ={})["env_vars"] == {"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000"}
    leaky = runtime_env(config, environ={"MLFLOW_TRACKING_URI": "https://u:pw@mlflow.example.com", "HF_TOKEN": "hf_x",
                                         "AWS_ACCESS_KEY_ID": "AKIAABCDEFGHIJKLMNOP", "RLOPS_TRAINING__MAX_TURNS": "3"})
    assert leaky["env_vars"] == {"RLOPS_TRAINING__MAX_TURNS": "3"} and leaky["withheld"] == ["MLFLOW_TRACKING_URI"]
