"""The real SkyRL `RayPPOTrainer.train()` loop (workers, generator and inference mocked, as in SkyRL's
tests/train/test_rl_callbacks.py) drives tracker.skyrl into the real MLflow server."""
from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import AsyncMock, MagicMock

import pytest

from test_tracker_support import logged_table, make_peft_adapter, metric_history
from tracker import RunSession
from tracker.checkpoints import TAG_STEP
from tasks.maze import datasets as ds
from tasks.maze.env import AGENT_RGB, CELL_PX, DIRECTION_WORDS, generate_maze, solve

skyrl_tracker = pytest.importorskip("tracker.skyrl")

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch  # noqa: E402
from skyrl.train.config import (  # noqa: E402
    AlgorithmConfig, DataConfig, DataLoaderConfig, GeneratorConfig, InferenceEngineConfig, SamplingParams,
    SkyRLTrainConfig, TrainerConfig)
from skyrl.train.utils.callbacks import CallbackInput, TrainingCallback  # noqa: E402
from skyrl.train.utils.trainer_utils import cleanup_old_checkpoints, dump_per_dataset_eval_results  # noqa: E402
from tasks.maze.trajectories import ASSISTANT_HEADER, TURN_END, eval_sample_columns  # noqa: E402

DATA_SOURCE = "maze_2d/local7"
SCORES = {0: 0.1, 2: 0.6, 3: 0.4}  # eval solve rate per step: step 2's checkpoint is the best


class DummyDataset:
    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        return ([{"role": "user", "content": f"q{idx}"}], None)

    def collate_fn(self, batch):
        return batch


class PayloadSpy(TrainingCallback):
    """Records what SkyRL handed to its tracker, to compare with what landed in MLflow."""

    def __init__(self):
        self.logs: list[tuple[int, dict]] = []

    def on_log(self, trainer, ci, control):
        self.logs.append((ci.global_step, dict(ci.logs)))


def skyrl_config(tmp_path: Path, **trainer_overrides) -> SkyRLTrainConfig:
    settings = dict(
        project_name="skyrl-own-project", run_name="skyrl-run", logger="mlflow", micro_train_batch_size_per_gpu=2,
        train_batch_size=2, eval_batch_size=2, update_epochs_per_batch=1, epochs=1, max_prompt_length=20,
        remove_microbatch_padding=False, seed=42, resume_mode="none", eval_interval=2, eval_before_train=True,
        ckpt_interval=2, hf_save_interval=1, max_ckpts_to_keep=1, ckpt_path=str(tmp_path / "ckpts"),
        export_path=str(tmp_path / "exports"), enable_ray_gpu_monitor=False, update_ref_every_epoch=False,
        algorithm=AlgorithmConfig(advantage_estimator="grpo", kl_estimator_type="k1", use_kl_loss=True,
                                  kl_loss_coef=0.0, loss_reduction="token_mean", grpo_norm_by_std=True,
                                  use_kl_in_reward=False))
    trainer = TrainerConfig(**(settings | trainer_overrides))
    trainer.placement.colocate_all = False
    trainer.algorithm.dynamic_sampling.type = None
    generator = GeneratorConfig(sampling_params=SamplingParams(max_generate_length=20), n_samples_per_prompt=1,
                                batched=False, max_turns=1, step_wise_trajectories=False,
                                inference_engine=InferenceEngineConfig(enable_ray_prometheus_stats=False))
    return SkyRLTrainConfig(trainer=trainer, generator=generator,
                            data=DataConfig(dataloader=DataLoaderConfig(num_workers=0)))


def stub_training_input() -> TrainingInputBatch:
    batch = TrainingInputBatch({
        "sequences": torch.zeros((1, 4), dtype=torch.long), "attention_mask": torch.ones((1, 4), dtype=torch.long),
        "loss_mask": torch.ones((1, 4), dtype=torch.long), "response_mask": torch.ones((1, 4), dtype=torch.long),
        "rewards": torch.zeros((1, 4))})
    batch.metadata = {"uids": ["uid-0"], "response_length": 4, "avg_response_length": 4.0}
    return batch


def trainer_args(cfg) -> dict:
    """What BasePPOExp would pass to get_trainer, with the tokenizer, generator and inference mocked."""
    return dict(cfg=cfg, tokenizer=MagicMock(pad_token_id=0, eos_token_id=2), train_dataset=DummyDataset(6),
                eval_dataset=DummyDataset(2), inference_engine_client=None, generator=MagicMock(), colocate_pg=None)


def mocked_trainer(monkeypatch, cfg, session: RunSession, adapter: Path):
    trainer = skyrl_tracker.TrackedRayPPOTrainer(tracker=skyrl_tracker.make_tracking(cfg, session), **trainer_args(cfg))
    return mock_workers(monkeypatch, trainer, adapter)


def mock_workers(monkeypatch, trainer, adapter: Path, *, fail_at_step: int | None = None,
                 fail_after_checkpoint_at: int | None = None, fail_before_on_save_at: int | None = None):
    """Mock the trainer's GPU workers and rollouts; the worker "saves" a real PEFT adapter where SkyRL's
    FSDP worker would (`global_step_N/policy/lora_adapter/`, or the HF export folder). `fail_at_step` fails
    a step's training, `fail_after_checkpoint_at` the weight sync after that step's checkpoint,
    `fail_before_on_save_at` the old-checkpoint cleanup, after the checkpoint is complete and before on_save."""
    cfg = trainer.cfg

    def save_adapter(model, folder, tokenizer=None):
        target = Path(folder) / "lora_adapter" if model == "policy" and "ckpts" in str(folder) else Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (target / name).write_bytes((adapter / name).read_bytes())

    dispatch = MagicMock()
    def sync_weights():
        if trainer.global_step == fail_after_checkpoint_at:
            raise RuntimeError("NCCL watchdog: the weight sync timed out")

    dispatch.save_weights_for_sampler = AsyncMock(side_effect=sync_weights)
    dispatch.get_lcm_dp_size = MagicMock(return_value=1)
    dispatch.save_checkpoint = MagicMock(side_effect=save_adapter)
    dispatch.save_hf_model = MagicMock(side_effect=save_adapter)
    trainer.dispatch = dispatch

    def train_step(batch):
        if trainer.global_step == fail_at_step:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        status = {"policy_loss": 1.0 / trainer.global_step, "grad_norm": 0.5}
        # what the real train_critic_and_policy and generate put into the step's payload
        trainer.all_metrics.update({f"policy/{k}": v for k, v in status.items()})
        trainer.all_metrics.update({"reward/avg_raw_reward": 0.25, "environment/solved@1": 0.5})
        return status

    async def evaluate(*args, **kwargs):
        score = SCORES[trainer.global_step]
        return {f"eval/{DATA_SOURCE}/avg_score": score, f"eval/{DATA_SOURCE}/pass_at_1": score,
                "eval/all/avg_score": score}

    monkeypatch.setattr(trainer, "init_weight_sync_state", lambda: None)
    monkeypatch.setattr(trainer, "generate", AsyncMock(
        return_value={"rollout_metrics": None, "response_ids": [[1]], "rewards": [0.0]}))
    monkeypatch.setattr(trainer, "eval", evaluate)
    monkeypatch.setattr(trainer, "postprocess_generator_output", lambda gen_out, uids: (gen_out, uids))
    monkeypatch.setattr(trainer, "convert_to_training_input", lambda *_a, **_k: stub_training_input())
    monkeypatch.setattr(trainer, "fwd_logprobs_values_reward", lambda batch: batch)
    monkeypatch.setattr(trainer, "compute_advantages_and_returns", lambda batch: batch)
    monkeypatch.setattr(trainer, "train_critic_and_policy", train_step)
    def cleanup():  # runs on every Ray node; here there is only the driver
        if trainer.global_step == fail_before_on_save_at:
            raise KeyboardInterrupt  # what `ray job stop` raises in the training task (ray.cancel)
        cleanup_old_checkpoints(cfg.trainer.ckpt_path, cfg.trainer.max_ckpts_to_keep)

    monkeypatch.setattr(trainer, "_cleanup_old_checkpoints", cleanup)
    monkeypatch.setattr("skyrl.train.trainer.prepare_generator_input",
                        lambda *_a, **_k: ({"prompts": [[{"role": "user", "content": "q"}]]}, ["uid-0"]))
    return trainer


def tracked_exp(monkeypatch, cfg, rlops_config, adapter: Path, **failures):
    """A TrackedPPOExp whose `run()` goes through the real trainer loop with mocked workers.
    BasePPOExp.__init__ loads an HF tokenizer and datasets; the experiment's own code is what is under test."""
    exp = skyrl_tracker.TrackedPPOExp.__new__(skyrl_tracker.TrackedPPOExp)
    exp.cfg, exp.rlops_config, exp.eval_data_source, exp.session = cfg, rlops_config, None, None
    exp.task_columns, exp.node_monitors, exp.register_best = None, None, True
    exp.run_dir = skyrl_tracker.tracker_run_dir(cfg, rlops_config)

    def setup_trainer():  # BasePPOExp._setup_trainer minus model building: get_tracker, then get_trainer
        args = trainer_args(cfg)
        exp.trainer = exp.get_trainer(tracker=exp.get_tracker(), **args)
        return mock_workers(monkeypatch, exp.trainer, adapter, **failures)

    monkeypatch.setattr(exp, "_setup_trainer", setup_trainer)
    return exp


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return make_peft_adapter(tmp_path_factory.mktemp("peft") / "adapter")


def test_skyrl_loop_lands_every_metric_checkpoint_eval_and_best_version(
        monkeypatch, test_config, tmp_path, mlflow_client, adapter):
    cfg = skyrl_config(tmp_path)
    run_dir = Path(cfg.trainer.ckpt_path)
    session = RunSession.start(test_config, run_dir, params=skyrl_tracker.skyrl_params(cfg),
                               tags=skyrl_tracker.skyrl_tags(cfg), run_name="skyrl")
    trainer = mocked_trainer(monkeypatch, cfg, session, adapter)
    spy = PayloadSpy()
    skyrl_tracker.attach(trainer, session, eval_data_source=DATA_SOURCE)
    trainer.add_callback(spy)
    asyncio.run(trainer.train())  # ends with SkyRL's tracker.finish(): must not end our run
    assert mlflow_client.get_run(session.run_id).info.status == "RUNNING"
    session.finish()

    run = mlflow_client.get_run(session.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer/policy/model/lora/rank"] == str(cfg.trainer.policy.model.lora.rank)
    # one run only: SkyRL's backend neither opened its own run nor its own experiment
    assert [r.info.run_id for r in mlflow_client.search_runs([session.experiment_id])] == [session.run_id]
    assert mlflow_client.get_experiment_by_name("skyrl-own-project") is None

    # every key of every payload SkyRL handed its tracker, exactly once at its step (`@` -> `_at_`)
    assert [step for step, _ in spy.logs] == [0, 1, 2, 3]
    expected: dict[str, list[tuple[int, float]]] = {}
    for step, payload in spy.logs:
        for key, value in skyrl_tracker.numeric(payload).items():
            expected.setdefault(key.replace("@", "_at_"), []).append((step, value))
    assert "environment/solved_at_1" in expected and "policy/policy_loss" in expected
    for key, points in expected.items():
        assert metric_history(mlflow_client, session.run_id, key) == sorted(points), key
    assert metric_history(mlflow_client, session.run_id, f"eval/{DATA_SOURCE}/avg_score") == [
        (0, 0.1), (2, 0.6), (3, 0.4)]

    # a LoggedModel per step with an adapter (1: HF export only; 2, 3: checkpoint + export, logged once),
    # eval linked, the step-2 checkpoint folder already deleted by max_ckpts_to_keep=1
    assert not (run_dir / "global_step_2").exists()
    models = {int(m.tags[TAG_STEP]): m for m in mlflow_client.search_logged_models(
        experiment_ids=[session.experiment_id], filter_string=f"source_run_id = '{session.run_id}'")}
    assert sorted(models) == [1, 2, 3]
    assert models[1].metrics == []  # no eval at step 1: nothing to link
    for step in (2, 3):
        linked = {m.key: m.value for m in models[step].metrics}
        assert linked[f"eval/{DATA_SOURCE}/avg_score"] == SCORES[step]
        assert models[step].tags["rlops.base_model"] == cfg.trainer.policy.model.path  # the trainer's, not config's
        files = {f.path for f in mlflow_client.list_logged_model_artifacts(models[step].model_id)}
        assert files == {"adapter_config.json", "adapter_model.safetensors"}

    # on_train_end registered the best checkpoint of that eval set, `candidate` alias only
    version = mlflow_client.get_model_version_by_alias(test_config.registered_model, "candidate")
    assert version.source == f"models:/{models[2].model_id}"
    assert version.tags["rlops.step"] == "2" and version.tags["rlops.run_id"] == session.run_id
    assert version.tags["rlops.metric_value"] == "0.6"
    assert version.aliases == ["candidate"]


def test_skyrl_experiment_raise_ends_failed_and_restart_resumes_the_run(monkeypatch, test_config, tmp_path,
                                                                         mlflow_client, adapter):
    cfg = skyrl_config(tmp_path, hf_save_interval=0)
    run_dir = Path(cfg.trainer.ckpt_path)
    exp = tracked_exp(monkeypatch, cfg, test_config, adapter, fail_at_step=3)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        exp.run()
    exp.trainer.tracker.finish()  # SkyRL's own end of tracking (also run by its __del__) must not flip FAILED
    run = mlflow_client.get_run(exp.session.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["rlops.exception_type"] == "RuntimeError"
    assert "illegal memory access" in run.data.tags["rlops.exception_message"]
    assert [s for s, _ in metric_history(mlflow_client, run.info.run_id, "policy/policy_loss")] == [1, 2]
    assert [int(m.tags[TAG_STEP]) for m in mlflow_client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'")] == [2]

    resumed = RunSession.start(test_config, run_dir, params=skyrl_tracker.skyrl_params(cfg))
    assert resumed.run_id == run.info.run_id
    assert mlflow_client.get_run(resumed.run_id).info.status == "RUNNING"
    assert resumed.log_checkpoint(adapter, step=2) is False  # step 2 is archived already
    resumed.finish()


def test_skyrl_resume_latest_continues_the_run_at_the_trainers_global_step(monkeypatch, test_config, tmp_path,
                                                                           mlflow_client, adapter):
    cfg = skyrl_config(tmp_path, hf_save_interval=0)
    crashed = tracked_exp(monkeypatch, cfg, test_config, adapter, fail_at_step=3)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        crashed.run()
    run_id = crashed.session.run_id

    # the restarted job: SkyRL loads global_step_2 (weights, optimizer, dataloader) and evaluates it again
    # before training (eval_before_train); the tracker continues the same run and logs that eval once
    resumed = tracked_exp(monkeypatch, skyrl_config(tmp_path, hf_save_interval=0, resume_mode="latest"),
                          test_config, adapter)
    resumed.run()
    assert resumed.session.run_id == run_id
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["rlops.resumes"] == "1"
    assert [s for s, _ in metric_history(mlflow_client, run_id, "policy/policy_loss")] == [1, 2, 3]
    assert metric_history(mlflow_client, run_id, f"eval/{DATA_SOURCE}/avg_score") == [(0, 0.1), (2, 0.6), (3, 0.4)]
    models = {int(m.tags[TAG_STEP]): m for m in mlflow_client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")}
    assert sorted(models) == [2, 3]
    linked = sorted((m.key, m.step) for m in models[2].metrics)  # the re-run eval of step 2 is not linked twice
    assert linked == [("eval/all/avg_score", 2), (f"eval/{DATA_SOURCE}/avg_score", 2), (f"eval/{DATA_SOURCE}/pass_at_1", 2)]
    version = mlflow_client.get_model_version_by_alias(test_config.registered_model, "candidate")
    assert version.tags["rlops.step"] == "2"

    # resume_mode=none trains from step 0 again: a new run, not a splice onto the finished one
    fresh = tracked_exp(monkeypatch, skyrl_config(tmp_path / "again", hf_save_interval=0), test_config, adapter)
    fresh.run()
    assert fresh.session.run_id != run_id


def test_a_failure_between_a_checkpoint_and_its_log_keeps_the_steps_metrics_once(monkeypatch, test_config,
                                                                                 tmp_path, mlflow_client, adapter):
    """SkyRL saves step N's checkpoint before it logs step N, and a run resumed from that checkpoint starts
    at N+1: the step's metrics go to the tracker (and its spool) before the checkpoint is written."""
    cfg = skyrl_config(tmp_path, hf_save_interval=0)
    crashed = tracked_exp(monkeypatch, cfg, test_config, adapter, fail_after_checkpoint_at=2)
    with pytest.raises(RuntimeError, match="weight sync"):
        crashed.run()
    run_id = crashed.session.run_id
    assert (Path(cfg.trainer.ckpt_path) / "global_step_2").is_dir()
    for key in ("policy/policy_loss", "reward/avg_raw_reward", "environment/solved_at_1"):
        assert [s for s, _ in metric_history(mlflow_client, run_id, key)] == [1, 2], key

    resumed = tracked_exp(monkeypatch, skyrl_config(tmp_path, hf_save_interval=0, resume_mode="latest"),
                          test_config, adapter)
    resumed.run()
    assert resumed.session.run_id == run_id
    # each point once across the resume; a step's own total time ends after its checkpoint: step 2 has none
    for key in ("policy/policy_loss", "reward/avg_raw_reward", "timing/generate", "timing/train_critic_and_policy"):
        assert [s for s, _ in metric_history(mlflow_client, run_id, key)] == [1, 2, 3], key
    assert [s for s, _ in metric_history(mlflow_client, run_id, "timing/step")] == [1, 3]


def test_a_checkpoint_completed_just_before_a_stop_is_logged_when_the_run_resumes(monkeypatch, test_config,
                                                                                 tmp_path, mlflow_client, adapter):
    """SkyRL fires on_save after its save: stopped in between, the checkpoint is complete on disk (the resumed
    trainer starts after it) but was never logged. The resumed run logs it at its start, once."""
    cfg = skyrl_config(tmp_path, hf_save_interval=0, max_ckpts_to_keep=-1)
    stopped = tracked_exp(monkeypatch, cfg, test_config, adapter, fail_before_on_save_at=2)
    with pytest.raises(KeyboardInterrupt):
        stopped.run()
    run_id = stopped.session.run_id
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["rlops.end_reason"] == "KeyboardInterrupt"

    def logged_steps() -> list[int]:
        return sorted(int(m.tags[TAG_STEP]) for m in mlflow_client.search_logged_models(
            experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"))

    assert (Path(cfg.trainer.ckpt_path) / "latest_ckpt_global_step.txt").read_text() == "2" and logged_steps() == []

    resumed = tracked_exp(monkeypatch, skyrl_config(tmp_path, hf_save_interval=0, max_ckpts_to_keep=-1,
                                                    resume_mode="latest"), test_config, adapter)
    resumed.run()
    assert resumed.session.run_id == run_id
    assert logged_steps() == [2, 3]  # step 2's, logged at the resume, once; step 3's is the run's last
    version = mlflow_client.get_model_version_by_alias(test_config.registered_model, "candidate")
    assert version.tags["rlops.step"] == "2"  # and it can be registered: its eval is linked to it


def test_skyrl_eval_keys_are_logged_under_the_data_source_name():
    """SkyRL writes `eval/maze_2d_easy/avg_score` (its file-name form of `maze_2d/easy`); the tracker logs
    the contract's `eval/maze_2d/easy/avg_score`, which registration ranks by."""
    metrics = {"eval/maze_2d_easy/avg_score": 0.5, "eval/maze_2d_easy/pass_at_1": 0.5, "eval/all/avg_score": 0.5,
               "eval/plain/avg_score": 0.25}
    assert skyrl_tracker.named_by_data_source(metrics, {"maze_2d/easy", "plain"}) == {
        "eval/maze_2d/easy/avg_score": 0.5, "eval/maze_2d/easy/pass_at_1": 0.5, "eval/all/avg_score": 0.5,
        "eval/plain/avg_score": 0.25}


def test_a_remote_ckpt_path_keeps_the_tracker_state_in_a_local_folder_keyed_by_it(test_config, tmp_path,
                                                                                  monkeypatch):
    cfg = skyrl_config(tmp_path, ckpt_path="s3://bucket/team/ckpts")
    first, again = (skyrl_tracker.tracker_run_dir(cfg, test_config) for _ in range(2))
    assert first == again and first.parent == test_config.data_path / "tracker-state"
    assert "s3:" not in str(first) and first.name.startswith("bucket-team-ckpts-")
    other = skyrl_tracker.tracker_run_dir(skyrl_config(tmp_path, ckpt_path="s3://bucket/team/ckpts2"), test_config)
    assert other != first

    # SkyRL's on_save hands over the remote folder: nothing is archived, and no `s3:` folder appears anywhere
    monkeypatch.chdir(tmp_path)
    with RunSession.start(test_config, first) as session:
        assert not skyrl_tracker.log_adapter(session, "s3://bucket/team/ckpts/global_step_2", 2)
        assert session.checkpoint_steps == frozenset()
    assert (first / ".rlops-tracker" / "run.json").is_file()
    assert not [p for root in (tmp_path, first) for p in root.rglob("s3:*")]


class TextTokenizer:
    """Decodes ids into the pieces of a Qwen-format multi-turn transcript (what dump_per_dataset_eval_results
    calls on SkyRL's tokenizer)."""

    def __init__(self):
        self.pieces: list[str] = []

    def encode(self, pieces: list[str]) -> list[int]:
        for piece in pieces:
            if piece not in self.pieces:
                self.pieces.append(piece)
        return [self.pieces.index(piece) for piece in pieces]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_skyrl_eval_trajectories_land_as_the_sample_table_with_maze_images(test_config, tmp_path, mlflow_client):
    """What SkyRL hands over at eval time: on_eval_end's CallbackInput (metrics) and the trajectories its
    evaluate() dumps with its own dump_per_dataset_eval_results (decoded multi-turn responses)."""
    test_config.tracking.sample_items = 2
    export = tmp_path / "export"
    mazes = [generate_maze(seed, 7) for seed in (0, 1, 2)]
    tokenizer = TextTokenizer()
    turn_end_observation = [TURN_END, "\n<|im_start|>user\n", *["<|image_pad|>"] * 50, "Action executed successfully.",
                            TURN_END, "\n", ASSISTANT_HEADER]

    def transcript(answers: list[str]) -> list[int]:
        pieces = []
        for i, answer in enumerate(answers):
            pieces += [answer] + (turn_end_observation if i < len(answers) - 1 else [TURN_END])
        return tokenizer.encode(pieces)

    solved_answers = [DIRECTION_WORDS[d] for d in solve(mazes[0])] + ["stop"]
    answers = [solved_answers, ["I think left", "('move', 3)", "stop"], ["up"]]
    rewards = [1.0, 0.0, 0.0]
    extras = [{k: v for k, v in ds.skyrl_row(m, DATA_SOURCE, "eval").items() if k not in ("prompt", "env_class")}
              for m in mazes]
    folder = export / "dumped_evals" / "global_step_2_evals"
    folder.mkdir(parents=True)
    outputs = {"prompt_token_ids": [tokenizer.encode(["<|vision_start|>", *["<|image_pad|>"] * 80, "Navigate."])] * 3,
               "response_ids": [transcript(a) for a in answers], "rewards": rewards, "stop_reasons": ["stop"] * 3}
    metrics = {f"eval/{DATA_SOURCE}/avg_score": 1 / 3}
    dump_per_dataset_eval_results(folder, tokenizer, outputs, [DATA_SOURCE] * 3, ["visgym"] * 3, extras, metrics)

    trainer = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(export_path=str(export))))
    with RunSession.start(test_config, tmp_path / "run") as session:
        callback = skyrl_tracker.TrackerCallback(session, register_best=False, task_columns=eval_sample_columns)
        callback.on_eval_end(trainer, CallbackInput(global_step=2, epoch=0, total_steps=3, steps_per_epoch=3,
                                                    metrics=metrics), None)
        blocked_s = callback.blocking_s
    table = logged_table(mlflow_client, session.run_id, "eval/samples/step_2.json", tmp_path)
    assert list(table[0]) == ["image", "moves", "id", "prompt", "completion", "reward", "passed", "data_source"]
    assert [(r["id"], r["moves"], r["reward"], r["passed"]) for r in table] == [
        ("0", " ".join(solved_answers), 1.0, True), ("1", "? down stop", 0.0, False)]  # the bound: 2 of 3
    assert table[0]["prompt"] == "<|vision_start|><|image_pad|>Navigate."  # the image's pad tokens shown once
    assert table[1]["completion"].startswith("I think left<|im_end|>\n<|im_start|>user\n<|image_pad|>Action")
    images = {f.path for f in mlflow_client.list_artifacts(session.run_id, "table_images/eval/samples/step_2")}
    assert all(r["image"]["type"] == "image" and r["image"]["filepath"] in images for r in table)
    # the maze as the policy's turns left it: the solved one's agent stands on the target
    solved_image = mlflow_client.download_artifacts(session.run_id, table[0]["image"]["filepath"], str(tmp_path))
    with Image.open(solved_image) as im:
        (gr, gc), middle = mazes[0].goal, CELL_PX // 2
        assert im.convert("RGB").getpixel((gc * CELL_PX + middle, gr * CELL_PX + middle)) == AGENT_RGB
    files = {f.path for f in mlflow_client.list_artifacts(session.run_id, "eval/samples")}
    assert files == {"eval/samples/step_2.json", "eval/samples/step_2.png"}
    assert blocked_s < 1.0  # rendering and uploads ran on the sample thread
