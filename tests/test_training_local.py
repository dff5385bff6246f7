"""The local CPU trainer: pure parts (reward shaping, intervals, machine check) and a real GRPO run on the
tiny random-init model whose metrics, checkpoints, eval and registration land in the real MLflow server."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from click.testing import CliRunner

from rlops.cli import main
from rlops.config import Config
from conftest import write_config
from tasks.maze import datasets as ds
from test_tracker_support import logged_table
from tracker import sync_runs
from tracker.lineage import content_digest
from tasks.maze.env import answer_text, generate_maze, move, solve, walk_answer
from tasks.maze.task import MazeTask, maze_item, shaped_reward
from training.base import TrainingError, check_fits_machine, estimate_parameters, sft_items, tiny_init_dir
from training.evaluation import SAMPLED_METRIC, completion_text, evaluate, item_mean_interval, wilson_interval
from training.local_trainer import GRPO_PROMPTS, LORA_TARGETS, item_row, torch_threads, training_rewards, train


def test_shaped_reward_orders_answers_by_quality():
    maze = generate_maze(4, 7)
    path = solve(maze)
    blocked = next(d for d in range(4) if move(maze, maze.start, d) is None)
    answers = {
        "solved": answer_text(path),
        "at_goal_no_stop": " ".join(answer_text(path).split()[:-1]),
        "halfway": answer_text(path[: len(path) // 2]),
        "bump": answer_text([blocked]),
        "junk": "banana",
    }
    score = {k: shaped_reward(walk_answer(maze, a)) for k, a in answers.items()}
    assert score["solved"] == 1.0
    assert score["solved"] > score["at_goal_no_stop"] > score["halfway"] > score["bump"] >= score["junk"] == 0.0
    past = walk_answer(maze, answer_text(path + [path[-1] ^ 2, (path[-1] ^ 2) ^ 2]))  # step off and back
    assert past.solved and shaped_reward(past) < 1.0


def test_trl_reward_functions_read_the_item_columns():
    maze = generate_maze(9, 7)
    row = item_row(maze_item(maze))
    columns = {k: [row[k], row[k]] for k in ("item_id", "item_text", "target")}
    completions = [[{"role": "assistant", "content": answer_text(solve(maze))}], [{"role": "assistant", "content": "up"}]]
    shaped = MazeTask(MazeTask.Options(reward="shaped"))
    reward, score = training_rewards(shaped)
    assert reward([None, None], completions, **columns)[0] == 1.0 and 0.0 < reward([None], completions[1:], **{
        k: v[:1] for k, v in columns.items()})[0] < 1.0
    assert score([None, None], completions, **columns) == [1.0, 0.0]
    plain_reward, _ = training_rewards(MazeTask(MazeTask.Options()))
    assert plain_reward([None, None], completions, **columns) == [1.0, 0.0]  # the default trains on the task score
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "left stop"}]}]) == "left stop"


def test_local_training_never_sees_a_fixed_eval_or_held_out_layout():
    config = Config()
    task = config.load_task()
    evals = {ds.layout_key(m) for s in ds.local_eval_sets(task.options.eval_size) for m in s.mazes()}
    assert len(evals) >= 256
    for items in (sft_items(config, task), task.train_items(GRPO_PROMPTS)):
        mazes = [ds.maze_from_layout(json.dumps(it.target)) for it in items]
        assert len(mazes) >= 2048 and not {ds.layout_key(m) for m in mazes} & evals


def test_wilson_interval_brackets_the_rate():
    low, high = wilson_interval(32, 64)
    assert low < 0.5 < high and high - low == pytest.approx(0.24, abs=0.02)
    assert wilson_interval(0, 64)[0] == 0.0 and wilson_interval(64, 64)[1] == 1.0


def test_sampled_interval_spreads_between_mazes_not_samples():
    # 4 samples of 64 mazes: every maze solved half the time vs half the mazes always solved.
    even, split = [0.5] * 64, [1.0] * 32 + [0.0] * 32
    assert item_mean_interval(even) == (0.5, 0.5)  # no maze-to-maze spread
    low, high = item_mean_interval(split)
    assert low < 0.5 < high and high - low == pytest.approx(2 * 1.96 * (0.5039 / 8), abs=1e-3)
    assert item_mean_interval([1.0]) == (0.0, 1.0)


def test_sampled_eval_is_reproducible_and_leaves_the_training_rng_alone(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from training.tiny_vlm import build_tiny_vlm

    init = build_tiny_vlm(tmp_path / "tiny", seed=0)
    model, processor = AutoModelForImageTextToText.from_pretrained(str(init)), AutoProcessor.from_pretrained(str(init))
    task = MazeTask(MazeTask.Options(eval_size=5, answer_length=6))
    task.eval_items = lambda source: [maze_item(m) for m in ds.MazeSet(source, 5, (0, 1, 2)).mazes()]
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    first = evaluate(model, processor, task, "maze_2d/test5", samples=3, temperature=1.0)
    assert torch.equal(torch.get_rng_state(), rng)
    again = evaluate(model, processor, task, "maze_2d/test5", samples=3, temperature=1.0)
    greedy_only = evaluate(model, processor, task, "maze_2d/test5")
    assert first.sampled_rate == again.sampled_rate and 0.0 <= first.sampled_rate <= 1.0
    assert first.sampled_ci95[0] <= first.sampled_rate <= first.sampled_ci95[1]
    assert greedy_only.sampled_rate is None and greedy_only.rows == first.rows


def test_eval_samples_out_of_range_is_a_config_error(tmp_path, monkeypatch):
    from rlops.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)
    for value, expected in (("-1", "greater than or equal to 0"), ("65", "less than or equal to 64")):
        with pytest.raises(ConfigError, match=f"RLOPS_TRAINING__LOCAL__EVAL_SAMPLES: training.local.eval_samples: .*{expected}"):
            load_config(None, environ={"RLOPS_TRAINING__LOCAL__EVAL_SAMPLES": value})


def test_torch_threads_hold_inside_the_training_and_come_back_after_it(tmp_path, monkeypatch):
    from rlops.config import ConfigError, load_config

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"), torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="training.local.torch_threads: .*greater than or equal to 1"):
        load_config(None, environ={"RLOPS_TRAINING__LOCAL__TORCH_THREADS": "0"})


def test_threads_held_apart_come_back_at_the_step_after_the_release(test_config, tmp_path):
    """The demo holds a core apart while its endpoint starts (`torch_threads`), and gives it back to training
    once the endpoint answers (`threads_back`): from the next step on, torch runs on its own count again."""
    config = _tiny_local(test_config)
    config.training.local.torch_threads = 1
    before, released, threads_seen, lines = torch.get_num_threads(), threading.Event(), {}, []

    def report(progress) -> None:  # on the training thread: the step-0 eval, then after each logged step
        threads_seen[progress.step] = torch.get_num_threads()
        if progress.step == 1:
            released.set()

    vllm_logging = os.environ.get("VLLM_LOGGING_LEVEL")
    train(config, tmp_path / "run", steps=3, budget_s=600, fast=True, log=lines.append, report=report,
          threads_back=released)
    # the endpoint the demo starts beside training inherits this env: TRL's import must not quiet its engines
    assert os.environ.get("VLLM_LOGGING_LEVEL") == vllm_logging
    assert threads_seen == {0: 1, 1: 1, 2: before, 3: before}
    assert "step 1: torch back on" in "\n".join(lines) and torch.get_num_threads() == before


def test_too_large_base_is_refused_before_loading():
    assert estimate_parameters("Qwen/Qwen3-VL-8B-Instruct") == 8_000_000_000
    assert estimate_parameters("some/model") is None
    with pytest.raises(TrainingError, match=r"Qwen3-VL-8B-Instruct.*GiB.*train_job.sh"):
        check_fits_machine("Qwen/Qwen3-VL-8B-Instruct", available_bytes=16 * 2**30)
    check_fits_machine("Qwen/Qwen3-VL-2B-Instruct", available_bytes=64 * 2**30)


def test_cli_train_validates_before_training():
    runner = CliRunner()
    no_local = runner.invoke(main, ["train"])
    assert no_local.exit_code != 0 and "train_job.sh" in no_local.output
    bad_steps = runner.invoke(main, ["train", "--local", "--steps", "0"])
    assert bad_steps.exit_code != 0 and "--steps" in bad_steps.output
    too_big = runner.invoke(main, ["base", "build"], env={"RLOPS_TRAINING__LOCAL__BASE_MODEL": "Qwen/Qwen3-VL-235B-A22B"})
    assert too_big.exit_code != 0 and "GiB" in too_big.output


@pytest.mark.parametrize("tracking", ["online", "offline"])
def test_local_grpo_run_lands_in_mlflow(test_config, mlflow_client, tmp_path, tracking):
    """Offline: trained with no server at all, then `rlops runs sync`: the same run, checked the same way."""
    config = test_config
    local = config.training.local
    local.num_generations, local.prompts_per_step = 4, 2
    local.ckpt_interval = local.eval_interval = 2
    config.task.options = {"answer_length": 8}
    local.eval_samples = 2
    config.tracking.sample_items, config.tracking.sample_groups = 5, 1
    config.tracking.sample_train_every = 3
    config.tracking.system_metrics_interval_s = 1.0
    if tracking == "online":
        result = train(config, tmp_path / "run", steps=4, budget_s=600, fast=True, log=lambda _: None)
        run_id, registered_version = result.run_id, result.registered_version
    else:
        offline = config.model_copy(deep=True)
        offline.tracking.mode, offline.tracking.uri = "offline", "http://127.0.0.1:9"  # nothing answers there
        result = train(offline, tmp_path / "run", steps=4, budget_s=600, fast=True, log=lambda _: None)
        assert result.offline and result.registered_version is None and result.run_id.startswith("offline-")
        report, = sync_runs(config, [tmp_path / "run"])
        assert not report.left and report.registered.startswith(f"{config.registered_model} v")
        run_id, registered_version = report.run_id, report.registered.rsplit(" v", 1)[1]

    assert result.steps == 4 and [s for s, _ in result.curve] == [0, 2, 4]
    assert result.before == result.curve[0][1] and 0.0 <= result.after <= 1.0
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    task = config.load_task()
    source = task.eval_sets()[0]
    assert source == "maze_2d/local7" and run.data.tags["rlops.task"] == "tasks.maze:MazeTask"
    assert run.data.params["task.answer_length"] == "8" and run.data.params["task.eval_size"] == "7"
    assert run.data.params["eval_layout_sha256"] == task.items_digest(task.eval_items(source))
    rewards = mlflow_client.get_metric_history(run_id, "reward/avg_raw_reward")
    assert sorted(m.step for m in rewards) == [1, 2, 3, 4]
    evals = mlflow_client.get_metric_history(run_id, f"eval/{source}/avg_score")
    assert sorted(m.step for m in evals) == [0, 2, 4]
    assert {m.step: m.value for m in evals}[4] == pytest.approx(result.after)
    sampled = mlflow_client.get_metric_history(run_id, f"eval/{source}/{SAMPLED_METRIC}")
    assert {m.step: m.value for m in sampled} == pytest.approx(dict(result.sampled_curve))
    assert [s for s, _ in result.sampled_curve] == [0, 2, 4] and result.sampled_after == result.sampled_curve[-1][1]

    models = mlflow_client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                                filter_string=f"source_run_id = '{run_id}'")
    steps = sorted(int(m.tags["rlops.step"]) for m in models)
    assert steps == [2, 4]
    # names and lineage: a readable run name, a portable base id + content digest, the adapter's own params
    assert run.info.run_name.startswith(f"grpo-tiny-init-r{local.lora_rank}-")
    base_sha256 = content_digest(tiny_init_dir(config))
    for model in models:
        assert model.tags["rlops.lora_rank"] == str(local.lora_rank)
        assert model.tags["rlops.base_model"] == "tiny-init" and model.tags["rlops.base_model_sha256"] == base_sha256
        assert model.params == {"lora_rank": str(local.lora_rank), "lora_alpha": str(local.lora_alpha),
                                "target_modules": ",".join(sorted(LORA_TARGETS)), "base_model": "tiny-init",
                                "base_model_sha256": base_sha256, "trainer": "trl-grpo-local"}
        files = {a.path for a in mlflow_client.list_logged_model_artifacts(model.model_id)}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files

    # datasets as inputs, and each linked eval metric names its eval set (MLflow's dataset filter)
    eval_sha256 = task.items_digest(task.eval_items(source))
    train_sha256 = task.items_digest(task.train_items(GRPO_PROMPTS))
    inputs = {(i.dataset.name, i.dataset.digest, {t.key: t.value for t in i.tags}["mlflow.data.context"])
              for i in run.inputs.dataset_inputs}
    assert inputs == {(source, eval_sha256[:36], "eval"), ("maze_2d/train", train_sha256[:36], "training")}
    assert run.data.params["train_layout_sha256"] == train_sha256
    for model in models:
        assert {(m.dataset_name, m.dataset_digest) for m in model.metrics} == {(source, eval_sha256[:36])}
    on_eval_set = mlflow_client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'",
        datasets=[{"dataset_name": source, "dataset_digest": eval_sha256[:36]}])
    assert len(on_eval_set) == 2

    # rollouts to look at: a bounded table with images per eval, a grid image, GRPO groups per log step
    for step in (0, 2, 4):
        table = logged_table(mlflow_client, run_id, f"eval/samples/step_{step}.json", tmp_path / f"t{step}")
        assert [r["id"] for r in table] == [str(seed) for seed in ds.local_eval_set(7).seeds[:5]]
        assert {"image", "prompt", "completion", "moves", "reward", "passed"} <= set(table[0])
        images = {a.path for a in mlflow_client.list_artifacts(run_id, f"table_images/eval/samples/step_{step}")}
        assert {r["image"]["filepath"] for r in table} <= images
    assert {a.path for a in mlflow_client.list_artifacts(run_id, "eval/samples")} == {
        f"eval/samples/step_{s}.{ext}" for s in (0, 2, 4) for ext in ("json", "png")}
    groups = logged_table(mlflow_client, run_id, "train/samples/step_3.json", tmp_path / "g")
    assert [a.path for a in mlflow_client.list_artifacts(run_id, "train/samples")] == [
        "train/samples/step_3.json", "train/samples/step_3.png"]  # every sample_train_every steps only
    assert len(groups) == local.num_generations and {r["group"] for r in groups} == {0}
    assert abs(sum(r["advantage"] for r in groups)) < 1e-3 and {"completion", "reward", "image"} <= set(groups[0])

    # the machine and the cost: MLflow's system metrics, throughput and wall time per phase
    logged = set(run.data.metrics)
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= logged
    assert {"perf/step_s", "perf/tokens_per_s", "perf/eval_s", "perf/checkpoint_s", "perf/wall_s"} <= logged

    assert registered_version is not None
    version = mlflow_client.get_model_version(config.registered_model, registered_version)
    assert version.tags["rlops.metric_key"] == f"eval/{source}/avg_score"
    assert version.tags["rlops.eval_set_sha256"] == eval_sha256
    step = version.tags["rlops.step"]
    for part in (f"eval/{source}/avg_score", f"step {step}", run.info.run_name, run_id, "tiny-init",
                 base_sha256, eval_sha256):
        assert part in version.description
    assert mlflow_client.get_model_version_by_alias(config.registered_model, "candidate").version == version.version


def _tiny_local(config):
    local = config.training.local
    local.num_generations, local.prompts_per_step = 4, 2
    local.ckpt_interval = local.eval_interval = 2
    config.task.options = {"answer_length": 8}
    local.eval_samples = 0
    return config


@pytest.mark.slow
def test_rerun_on_one_run_dir_continues_the_run_without_duplicate_steps(test_config, mlflow_client, tmp_path,
                                                                        monkeypatch):
    from rlops.layout import TAG_SHA256
    from tracker.checkpoints import sha256_of
    from training import local_trainer

    config, run_dir = _tiny_local(test_config), tmp_path / "run"
    source = config.load_task().eval_sets()[0]
    crash_after_logging = local_trainer.QuietProgressCallback.on_log

    def crash_at_step_3(self, args, state, control, logs=None, **kwargs):  # after the tracker logged step 3
        if state.global_step == 3:
            raise RuntimeError("node lost")
        return crash_after_logging(self, args, state, control, logs=logs, **kwargs)

    monkeypatch.setattr(local_trainer.QuietProgressCallback, "on_log", crash_at_step_3)
    with pytest.raises(RuntimeError, match="node lost"):
        train(config, run_dir, steps=4, budget_s=600, fast=True, log=lambda _: None)
    monkeypatch.undo()
    [first] = mlflow_client.search_runs([mlflow_client.get_experiment_by_name(config.tracking.experiment).experiment_id])
    assert first.info.status == "FAILED"

    # the same command again, as `rlops train --json`: the trainer resumes from checkpoint-2, the MLflow run
    # continues after step 3; stdout is the one JSON document, "resuming run ..." goes to stderr
    path = write_config(tmp_path / "mlflow.yaml", config.model_dump(exclude_none=True))
    cli = CliRunner().invoke(main, ["--config", str(path), "train", "--local", "--run-dir", str(run_dir),
                                    "--steps", "4", "--budget", "600", "--fast", "--json"])
    assert cli.exit_code == 0, cli.output
    resumed = json.loads(cli.stdout)
    assert f"resuming run {first.info.run_id}" in cli.stderr
    assert resumed["run_id"] == first.info.run_id and resumed["steps"] == 4
    run = mlflow_client.get_run(resumed["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["rlops.resumes"] == "1"
    rewards = mlflow_client.get_metric_history(resumed["run_id"], "reward/avg_raw_reward")
    assert sorted(m.step for m in rewards) == [1, 2, 3, 4]  # step 3 was replayed but logged once
    assert_one_point_per_step(mlflow_client, run)  # the Trainer's end-of-training log adds no second point
    evals = mlflow_client.get_metric_history(resumed["run_id"], f"eval/{source}/avg_score")
    assert sorted(m.step for m in evals) == [0, 2, 4] and [s for s, _ in resumed["curve"]] == [0, 2, 4]
    models = mlflow_client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                                filter_string=f"source_run_id = '{resumed['run_id']}'")
    assert sorted(int(m.tags["rlops.step"]) for m in models) == [2, 4]
    for model in models:  # each LoggedModel's eval belongs to the weights it archived
        weights = run_dir / f"checkpoint-{model.tags['rlops.step']}" / "adapter_model.safetensors"
        assert model.tags[TAG_SHA256 + "adapter_model.safetensors"] == sha256_of(weights)
        assert [(m.key, m.step) for m in model.metrics] == [(f"eval/{source}/avg_score", int(model.tags["rlops.step"]))]

    # a finished run dir starts a new run; the finished one's state and checkpoints move aside
    fresh = train(config, run_dir, steps=2, budget_s=600, fast=True, log=lambda _: None)
    assert fresh.run_id != resumed["run_id"] and [s for s, _ in fresh.curve] == [0, 2]
    archived = run_dir / f"previous-{resumed['run_id']}"
    assert (archived / "checkpoint-4").is_dir() and (archived / ".rlops-tracker" / "run.json").is_file()
    assert sorted(m.step for m in mlflow_client.get_metric_history(fresh.run_id, "reward/avg_raw_reward")) == [1, 2]

    # --resume continues a finished run with more steps
    more = train(config, run_dir, steps=4, budget_s=600, fast=True, resume=True, log=lambda _: None)
    assert more.run_id == fresh.run_id and [s for s, _ in more.curve] == [0, 2, 4]
    assert sorted(m.step for m in mlflow_client.get_metric_history(more.run_id, "reward/avg_raw_reward")) == [1, 2, 3, 4]
    assert_one_point_per_step(mlflow_client, mlflow_client.get_run(more.run_id))


def assert_one_point_per_step(client, run) -> None:
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert len(steps) == len(set(steps)), f"{key} has two points at one step: {sorted(steps)}"
