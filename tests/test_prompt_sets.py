"""Production traces back to training: a version's traces (written by the ingress's TraceWriter to the real
MLflow, scored by the maze task) exported with `rlops data from-traces`, then trained on."""
from __future__ import annotations

import json
import time
import uuid

import mlflow
import pytest
from click.testing import CliRunner

from conftest import write_config
from registry_hooks.trace_retention import prune_traces
from rlops.cli import main
from serving.app import trace_settings
from serving.trace_writer import TraceWriter, TraceWriterSettings
from serving.traces import ServedRequest
from tasks.maze.env import answer_text, solve
from tasks.maze.task import item_maze
from training.local_trainer import train
from training.prompt_sets import PROMPTS_FILE, PromptSetError, load_prompt_set


def registered_version(client, config) -> tuple[str, str]:
    """A LoggedModel registered as version 1 of the test's model, as the tracker registers one."""
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(config.tracking.experiment)
    run = client.create_run(experiment_id)
    logged = client.create_logged_model(experiment_id, name="lora-step-1", source_run_id=run.info.run_id)
    client.finalize_logged_model(logged.model_id, "READY")
    client.set_terminated(run.info.run_id)
    mlflow.set_registry_uri(config.tracking_uri)
    version = mlflow.register_model(f"models:/{logged.model_id}", config.registered_model)
    client.set_registered_model_alias(config.registered_model, "production", version.version)
    return logged.model_id, version.version


def served_request(config, item, answer: str, version: int, user: str = "u1") -> ServedRequest:
    """A request for `item` answered with `answer` by `version` of the test's model, as the ingress records it."""
    body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": answer}}]}
    return ServedRequest("chat", f"base:{config.registered_model}", config.registered_model, "production", version,
                         False, f"user:{user}", time.time_ns(), 20.0, 15.0, 200, (50, 5),
                         json.dumps({"model": "x", "messages": item.messages()}).encode(), json.dumps(body).encode())


def serve_traces(config, items, answers) -> dict[str, int]:
    """The requests as the ingress hands them to its writer, written to the session's MLflow."""
    counts: dict[str, int] = {}
    settings = TraceWriterSettings.model_validate({**trace_settings(config), "sample_rate": 1.0})
    writer = TraceWriter(settings, lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n)).start()
    try:
        for i, (item, answer) in enumerate(zip(items, answers)):
            writer.offer(served_request(config, item, answer, 1, user=f"u{i}"))
        deadline = time.monotonic() + 60
        while counts.get("scored", 0) < len(items) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        writer.stop()
    return counts


@pytest.mark.slow
def test_failed_production_requests_become_the_prompts_of_the_next_run(test_config, mlflow_client, tmp_path):
    config = test_config
    config.training.local.num_generations, config.training.local.prompts_per_step = 4, 2
    config.training.local.ckpt_interval = config.training.local.eval_interval = 2
    config.training.local.eval_samples = 0
    config.task.options = {"answer_length": 8}
    config.serving.traces.experiment = f"{config.tracking.experiment}-base"  # retention below prunes it whole
    task = config.load_task()
    model_id, version = registered_version(mlflow_client, config)
    items = task.eval_items(task.eval_sets()[0])[:6]
    answers = [answer_text(solve(item_maze(it))) if i % 3 == 0 else "stop" for i, it in enumerate(items)]
    failed = {json.dumps({k: v for k, v in it.target.items() if k != "seed"}, sort_keys=True)
              for it, a in zip(items, answers) if not task.score(it, a).passed}
    assert 0 < len(failed) < len(items)
    assert serve_traces(config, items, answers) == {"recorded": 6, "scored": 6}

    path = write_config(tmp_path / "mlflow.yaml", config.model_dump(exclude_none=True))
    out = tmp_path / "from-traces"
    cli = CliRunner().invoke(main, ["--config", str(path), "data", "from-traces", config.registered_model,
                                    "--failed-only", "-o", str(out), "--json"])
    assert cli.exit_code == 0, cli.output
    result = json.loads(cli.stdout)
    assert result["prompts"] == result["failed"] == len(failed) and result["traces_read"] == len(failed)
    rows = [json.loads(line) for line in (out / PROMPTS_FILE).read_text().splitlines()]
    assert {json.dumps({k: v for k, v in r["target"].items() if k != "seed"}, sort_keys=True) for r in rows} == failed
    assert all(r["passed"] is False and r["score"] == 0.0 and (out / r["image"]).is_file() for r in rows)
    prompt_set = load_prompt_set(out)
    for item in prompt_set.items:  # each picture is the maze its row names
        assert task.request_item(item.image(), item.text).target["rows"] == item.target["rows"]

    # logged: the export run holds the set as a dataset input, and the traces it came from are linked to it
    export_run = mlflow_client.get_run(result["run_id"])
    [dataset_input] = export_run.inputs.dataset_inputs
    assert (dataset_input.dataset.name, dataset_input.dataset.digest) == (f"traces/{config.registered_model}-v{version}",
                                                                          result["sha256"][:36])
    linked = mlflow_client.search_traces(locations=[export_run.info.experiment_id], run_id=result["run_id"])
    assert {t.info.trace_id for t in linked} == {r["trace_id"] for r in rows}
    assert all(t.info.trace_metadata["mlflow.modelId"] == model_id for t in linked)

    # the next run trains on it, and lists it among its inputs
    trained = train(config, tmp_path / "run", steps=2, budget_s=600, fast=True, log=lambda _: None,
                    prompts=prompt_set, prompts_share=0.5)
    run = mlflow_client.get_run(trained.run_id)
    inputs = {(i.dataset.name, i.dataset.digest, {t.key: t.value for t in i.tags}["mlflow.data.context"])
              for i in run.inputs.dataset_inputs}
    assert (prompt_set.name, prompt_set.digest[:36], "training") in inputs
    assert run.data.params["prompts_share"] == "0.5" and run.data.params["prompts_sha256"] == prompt_set.digest

    # a set is written once, and an altered one is refused before anything trains on it
    again = CliRunner().invoke(main, ["--config", str(path), "data", "from-traces", config.registered_model, "-o", str(out)])
    assert again.exit_code == 1 and "exists" in again.output
    (out / PROMPTS_FILE).write_text((out / PROMPTS_FILE).read_text().replace('"passed": false', '"passed": true', 1))
    with pytest.raises(PromptSetError, match="altered"):
        load_prompt_set(out)
    refused = CliRunner().invoke(main, ["--config", str(path), "train", "--local", "--fast", "--prompts", str(out)])
    assert refused.exit_code == 1 and "altered" in refused.output

    # retention (the hooks service's periodic work): past it, the ingress's traces go; an app's own stay
    experiment_id = export_run.info.experiment_id
    mlflow.set_tracking_uri(config.tracking_uri)
    mlflow.set_experiment(experiment_id=experiment_id)
    with mlflow.start_span("an app's own trace"):
        pass
    mlflow.flush_trace_async_logging()
    assert prune_traces(config) == {}  # none is old enough yet
    assert prune_traces(config, now=time.time() + (config.serving.traces.retention_days + 1) * 86400) == {
        experiment_id: len(items)}
    [kept] = mlflow_client.search_traces(locations=[experiment_id])
    assert kept.info.tags.get("rlops.endpoint") is None


def test_from_traces_usage_errors(tmp_path):
    cli = CliRunner().invoke(main, ["data", "from-traces", "m", "--alias", "a", "--version", "2", "-o", str(tmp_path / "x")])
    assert cli.exit_code == 2 and "give one" in cli.output
    cli = CliRunner().invoke(main, ["data", "from-traces", "m", "--failed-only", "--max-score", "0.5", "-o", str(tmp_path / "x")])
    assert cli.exit_code == 2 and "give one" in cli.output
    cli = CliRunner().invoke(main, ["train", "--prompts", str(tmp_path)])
    assert cli.exit_code == 2 and "--local" in cli.output
