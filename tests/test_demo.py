"""End to end: `rlops demo --fast --task shapes` from a clean data dir, checked from outside (MLflow, boto3,
openai). The second task is the proof that the Task seam holds: it trains, tracks, registers, promotes,
serves and verifies through the same code as the maze, with nothing outside tasks/shapes/ knowing it."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rlops.layout import parse_s3_uri, routes_key, version_folder
from rlops.processes import free_port
from tracker.evals import table_artifact

from conftest import write_config

pytestmark = pytest.mark.slow

STAGE_LINE = re.compile(r"\[[1-7]/7\] [^\n]+")
TRAINING_LINE = re.compile(r"\[3/7\] GRPO [^:]+: step \d+/\d+, reward \S+, last eval \S+")


def assert_only_stage_lines(terminal: str) -> list[str]:
    """What the demo wrote to the terminal: its log's path, stage lines (live ones rewritten in place with
    \\r), and the closing 'Where to look' block; nothing from a library. Returns the fragments."""
    fragments = [f for f in re.split(r"[\r\n]+", re.sub(r"\x1b\[K", "", terminal)) if f.strip()]
    closing = next(i for i, f in enumerate(fragments) if f == "Where to look")
    assert fragments[0].startswith("details and library output: "), fragments[:3]
    strays = [f for f in fragments[1:closing] if not STAGE_LINE.fullmatch(f)]
    assert not strays, strays
    return fragments


def run_on_a_terminal(argv: list[str], env: dict, timeout_s: float) -> tuple[subprocess.CompletedProcess, str]:
    """Run with stderr on a pseudo-terminal (what a user sees: live lines are drawn) and stdout on a pipe."""
    main, follower = pty.openpty()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    seen, deadline = bytearray(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([main], [], [], 1)[0]:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            seen += chunk
    os.close(main)
    stdout = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    return subprocess.CompletedProcess(argv, proc.returncode, stdout.decode(), ""), seen.decode(errors="replace")


def test_demo_fast_runs_the_whole_loop_on_the_second_task(stack, tmp_path, unique_name):
    model = "shapes-grpo"  # --task shapes: its own experiment and registered model
    data_dir = tmp_path / "data"
    serving_port, hooks_port = free_port(), free_port()
    path = write_config(tmp_path / "mlflow.yaml", {
        "data_dir": str(data_dir),
        "tracking": {"experiment": f"demo-{unique_name}"},
        "server": {"port": stack.config.server.port},
        "storage": {"endpoint_url": stack.config.storage.endpoint_url, "bucket": stack.config.storage.bucket},
        "registry": {"models": [f"demo-{unique_name}"]},
        "serving": {"port": serving_port, "dynamic_lora_loading_path": f"s3://{stack.config.storage.bucket}/lora-{unique_name}"},
        "hooks": {"port": hooks_port},
    })
    env = stack.env
    env.update({"RLOPS_CONFIG": str(path), "HF_HUB_OFFLINE": "1"})
    env.pop("RLOPS_DATA_DIR", None)
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "rlops", "demo", "--fast", "--task", "shapes", "--json"], env=env,
                             capture_output=True, text=True, timeout=600)
        elapsed = time.monotonic() - started
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        summary = json.loads(out.stdout)  # --json: stdout is the one document, the stage lines are on stderr
        assert "Where to look" in out.stderr and "rlops down" in out.stderr
        assert_only_stage_lines(out.stderr)  # not a terminal: no live line either
        assert "Traceback" not in (data_dir / "logs" / "demo.log").read_text()
        lift = summary["lift"]  # the base and production on the same items, both through the endpoint
        assert lift["items"] == 64 and lift["production_version"] == int(summary["version"])
        assert f"base solves {lift['base_solved']}/64" in out.stderr
        assert Path(summary["picture"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        client = MlflowClient(stack.tracking_uri)
        run = client.get_run(summary["run_id"])
        assert run.info.status == "FINISHED" and run.data.tags["rlops.task"] == "tasks.shapes:ShapesTask"
        # the endpoint started beside training: GRPO left it a core
        assert run.data.params["torch_threads"] == str(max(1, len(os.sched_getaffinity(0)) - 1))
        assert "eval/shapes/count/avg_score" in run.data.metrics
        assert client.get_experiment(run.info.experiment_id).name == "shapes-grpo"
        rows = json.loads(Path(client.download_artifacts(run.info.run_id, table_artifact("shapes/count", 0),
                                                         str(tmp_path))).read_text())
        assert rows["columns"][:4] == ["id", "passed", "score", "extras"] and len(rows["data"]) == 64
        checkpoints = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                                  filter_string=f"source_run_id='{run.info.run_id}'")
        assert checkpoints, "no LoRA checkpoint was logged as a LoggedModel"
        assert "demo/lift.png" in {a.path for a in client.list_artifacts(run.info.run_id, "demo")}

        production = client.get_model_version_by_alias(model, "production")
        staging = client.get_model_version_by_alias(model, "staging")
        assert production.version == staging.version == summary["version"]

        location = parse_s3_uri(f"s3://{stack.config.storage.bucket}/lora-{unique_name}")
        s3 = stack.s3()
        manifest = json.loads(s3.get_object(Bucket=location.bucket, Key=routes_key(location, model))["Body"].read())
        assert manifest["aliases"]["production"]["version"] == int(production.version)
        folder = location.key(version_folder(model, int(production.version)))
        keys = {o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects_v2(Bucket=location.bucket, Prefix=folder + "/")["Contents"]}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= keys

        from openai import OpenAI

        openai_client = OpenAI(base_url=f"http://127.0.0.1:{serving_port}/v1", api_key="none")
        raw = openai_client.chat.completions.with_raw_response.create(
            model=f"visgym-qwen3vl:{model}", messages=[{"role": "user", "content": "3"}], max_tokens=4, temperature=0)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-rlops-model-version"] == production.version
        assert raw.parse().model == f"visgym-qwen3vl:{model}"
        assert summary["served_version"] == production.version
        # Parity: the served greedy answers on the fixed eval set agree with the tracked eval (fp32).
        parity = summary["parity"]
        assert parity["version"] == int(production.version) and parity["items"] == 64 and parity["matching"] >= 63
        assert parity["task"] == "tasks.shapes:ShapesTask" and parity["data_source"] == "shapes/count"
        # promote verify reads the task from the version's run: the config file still names the maze
        verify = subprocess.run([str(Path(sys.executable).parent / "promote"), "verify", model, "--json"],
                                env={**env, "RLOPS_REGISTRY__MODELS": f"[{model}]"},
                                capture_output=True, text=True, timeout=300)
        report = json.loads(verify.stdout)
        assert "matching" in report, verify.stdout + verify.stderr[-2000:]
        assert verify.returncode == (0 if report["matching"] == report["items"] else 7), verify.stderr
        assert report["served_pass_rate"] == parity["served_pass_rate"]
        logged = client.get_logged_model(production.model_id or production.source.removeprefix("models:/"))
        assert any(m.key == f"served/{parity['data_source']}/avg_score" for m in logged.metrics or [])
        assert client.get_model_version(model, production.version).tags["rlops.served_parity"] == \
            f"{report['matching']}/{report['items']}"
        print(f"rlops demo --fast took {elapsed:.0f} s; stages: {summary['stages']}")

        # A re-run reuses the stack and the endpoint: a new run and version, served without a restart.
        from rlops.processes import read_record

        serve_pid = read_record(data_dir, "serve").pid
        # ...and, on a terminal, shows only its stage lines and the live training line
        again, terminal = run_on_a_terminal([sys.executable, "-m", "rlops", "demo", "--fast", "--task", "shapes",
                                             "--json"], env, 600)
        assert again.returncode == 0, again.stdout[-3000:] + terminal[-3000:]
        fragments = assert_only_stage_lines(terminal)
        assert any(TRAINING_LINE.fullmatch(f) for f in fragments), fragments
        second = json.loads(again.stdout)
        assert second["run_id"] != summary["run_id"] and int(second["version"]) == int(summary["version"]) + 1
        production_now = client.get_model_version_by_alias(model, "production").version
        # The eval guardrail keeps the old production when the new run scored lower; the demo says so.
        assert production_now == second["version"] or "promote refused (guardrail)" in terminal
        assert second["served_version"] == production_now
        assert read_record(data_dir, "serve").pid == serve_pid
    finally:
        down = subprocess.run([sys.executable, "-m", "rlops", "down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
    # The session stack was reused, not started by the demo's data dir: it must still be up.
    assert MlflowClient(stack.tracking_uri).search_experiments(max_results=1) is not None
    # ...and holds no webhook to the stopped hooks service (a dead one delays every later delivery: issue 36).
    assert "deleted webhook" in down.stdout, down.stdout
    assert not [h.url for h in MlflowClient(stack.tracking_uri).list_webhooks(max_results=100)
                if f":{hooks_port}/" in h.url]
