"""`rlops demo`: the whole loop on one machine, each stage through the same code paths users run.

stack up -> base model -> GRPO + LoRA training tracked in MLflow (best checkpoint registered),
while the endpoint starts on the base -> staging via the webhook path (a plain MLflow client moves the alias) -> production via `promote`
-> the Ray Serve endpoint (Ray's vLLM engine) serves it: `promote verify` checks the served greedy pass rate
against the tracked one, then the base answers the same items (the lift: both solve counts), and one item
goes through the official openai client. The terminal gets one line per stage; details and library output
go to the demo's log. Everything it starts is recorded in the data dir, so `rlops down` stops it; a re-run reuses what exists.
"""
from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx

from rlops import processes, stack
from rlops.chat_client import ChatClient
from rlops.config import Config, serving_api_key
from rlops.layout import RoutesManifest, parse_s3_uri
from rlops.task import Task, task_path
from rlops.terminal import Terminal

HOOKS_SECRET_FILE = "hooks-secret"
SERVE_READY_TIMEOUT_S = 300.0
FAST_STEPS = 6
PICTURE_ITEMS = 4  # items drawn as the base and production answered them
WEBHOOK_CACHE_TTL_S = 2.5  # MLFLOW_WEBHOOK_CACHE_TTL of the embedded stack (rlops/stack.py) + margin


class DemoError(RuntimeError):
    """A stage failed; the message says which and where its log is."""


@dataclass
class DemoSummary:
    stages: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    run_id: str = ""
    version: str | None = None
    pass_rate_before: float | None = None
    pass_rate_after: float | None = None
    served_version: str | None = None
    parity: dict | None = None  # promote verify's report on the production version
    registration_refused: str | None = None  # why the run registered nothing (it did not beat its base)
    registration_evidence: str | None = None  # how the registered checkpoint beat its base (the paired test)
    lift: dict | None = None  # base and production solve counts on the same eval items (lift_line)
    picture: str | None = None  # the lift picture (rlops.figures), also logged to the run
    answer: str = ""
    passed: bool | None = None
    urls: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Stage:
    """One stage's line: `note` is what it says once done; `detail` goes to the log (the terminal with -v)."""

    def __init__(self, head: str, terminal: Terminal):
        self.head, self.terminal, self.note = head, terminal, "done"

    def live(self, text: str) -> None:
        self.terminal.live(f"{self.head}: {text}")

    @staticmethod
    def detail(text: str) -> None:
        print(f"    {text}", flush=True)


class Progress:
    """One line per stage on the terminal, rewritten in place while it runs, and its duration recorded."""

    def __init__(self, total: int, summary: DemoSummary, terminal: Terminal):
        self.total, self.summary, self.terminal, self.index = total, summary, terminal, 0

    @contextmanager
    def stage(self, name: str) -> Iterator[Stage]:
        self.index += 1
        stage = Stage(f"[{self.index}/{self.total}] {name}", self.terminal)
        stage.live("...")
        stage.detail(f"{stage.head} ...")
        started = time.monotonic()
        try:
            yield stage
        except Exception:
            self.terminal.line(f"{stage.head}: FAILED after {time.monotonic() - started:.1f} s")
            raise
        seconds = time.monotonic() - started
        self.summary.stages[name] = round(seconds, 1)
        self.terminal.line(f"{stage.head}: {stage.note} ({seconds:.1f} s)")


def _child_env(config: Config, config_path: str | None, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RLOPS_DATA_DIR": str(config.data_path), "HF_HUB_OFFLINE": "1", **extra})
    if config_path:
        env["RLOPS_CONFIG"] = str(Path(config_path).resolve())
    return env


def _start_cli(config: Config, name: str, args: list[str], env: dict[str, str]) -> processes.ProcessRecord:
    return processes.start(config.data_path, name, [sys.executable, "-m", "rlops", *args], env)


def _start_serving(config: Config, config_path: str | None, base_url: str,
                   base_env: dict[str, str]) -> processes.ProcessRecord | None:
    """Start `rlops serve` in the background unless an endpoint is already up; its record, if any."""
    record = processes.read_record(config.data_path, "serve")
    if record is not None and record.process() is not None:
        return record
    if stack.http_ok(f"{base_url}/models"):
        Stage.detail(f"reusing the endpoint already running at {base_url}")
        return None
    Stage.detail(f"starting the endpoint at {base_url} in the background (log: {processes.log_path(config.data_path, 'serve')})")
    return _start_cli(config, "serve", ["serve"], _child_env(config, config_path, base_env))


def _manifest(config: Config, model: str) -> RoutesManifest:
    from registry_hooks import storage

    manifest, _ = storage.read_manifest(stack.s3_client(config), parse_s3_uri(config.lora_path), model)
    return manifest


def _published_or_refused(config: Config, model: str, alias: str, version: int) -> bool:
    """The sync has decided about `version` under `alias`: published it, or recorded its refusal."""
    manifest = _manifest(config, model)
    route, refused = manifest.aliases.get(alias), manifest.refused.get(alias)
    return (route is not None and route.version == version) or (refused is not None and refused.version == version)


def _hooks_secret(config: Config) -> str:
    return config.hooks.secret or stack.secret_file(config.data_path / HOOKS_SECRET_FILE, lambda: secrets.token_urlsafe(32))


def _endpoint_ready(base_url: str, wanted: str, version: int | None, api_key: str | None) -> bool:
    """The endpoint lists `wanted` at `version` (None: the base, listed without one; routes refresh within
    the staleness bound) and answers it: the ingress lists models before the vLLM replica has loaded, so
    only an answer proves readiness."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/models", headers=headers, timeout=5)
    listed = {m["id"]: m.get("metadata", {}).get("version") for m in response.json()["data"]} if response.status_code == 200 else {}
    if listed.get(wanted) != version:
        return False
    body = {"model": wanted, "messages": [{"role": "user", "content": "move"}], "max_tokens": 1}
    return httpx.post(f"{base_url}/chat/completions", json=body, headers=headers, timeout=5).status_code == 200


def _watch_endpoint(base_url: str, model: str, api_key: str | None, answers: threading.Event,
                    done: threading.Event) -> None:
    """Sets `answers` once the endpoint answers `model` (polled every 2 s in a thread of its own), unless
    `done` is set first."""
    def watch() -> None:
        while not done.wait(2.0):
            try:
                if _endpoint_ready(base_url, model, None, api_key):
                    answers.set()
                    return
            except httpx.HTTPError:
                continue

    threading.Thread(target=watch, name="rlops-demo-endpoint-watch", daemon=True).start()


def for_task(config: Config, name: str) -> tuple[Config, dict[str, str]]:
    """`rlops demo --task NAME`: the config on another task (its default options), with its own experiment
    and registered model (`<name>-grpo`), and the same as env overrides for the stages' processes."""
    path = task_path(name)
    short = path.rsplit(":", 1)[0].rsplit(".", 1)[-1]
    updated = config.model_copy(deep=True)
    updated.task.path, updated.task.options = path, {}
    updated.tracking.experiment, updated.tracking.registered_model = f"{short}-grpo", None
    updated.registry.models = [f"{short}-grpo"]
    env = {"RLOPS_TASK__PATH": path, "RLOPS_TASK__OPTIONS": "{}", "RLOPS_TRACKING__EXPERIMENT": f"{short}-grpo",
           "RLOPS_REGISTRY__MODELS": f"[{short}-grpo]"}
    return updated, env


def run_demo(config: Config, *, fast: bool, terminal: Terminal, config_path: str | None = None,
             env: dict[str, str] | None = None) -> DemoSummary:
    """Run every stage; raise DemoError naming the failed stage. Leaves the stack, hooks and serving up.
    `env` (for_task's overrides) reaches every process a stage starts."""
    from training import base as base_model
    from training import local_trainer

    task = config.load_task()
    summary = DemoSummary()
    progress = Progress(7, summary, terminal)
    model = config.registered_model
    base_url = f"http://{config.serving.host}:{config.serving.port}/v1"
    api_key = serving_api_key(config)  # with serving.api_keys_env set, the demo's client sends the first key
    summary.urls = {"mlflow_ui": config.tracking_uri, "endpoint": base_url, "s3": config.storage.endpoint_url or ""}

    with progress.stage("stack: MLflow server + S3") as stage:
        if stack.mlflow_healthy(config.tracking_uri) and stack.s3_healthy(config):
            stack.ensure_bucket(config)
            stage.note = f"reusing the running stack at {config.tracking_uri}"
        else:
            stack.up(config)
            stage.note = f"MLflow at {config.tracking_uri}, S3 at {config.storage.endpoint_url}"

    with progress.stage("base model" + (" (tiny base, no SFT)" if fast else " (SFT warm start, cached)")) as stage:
        base = base_model.ensure_tiny_init(config) if fast else base_model.ensure_base(config, task, log=stage.detail)
        stage.note = str(base)
    # Promotion checks adapters against the served base, and serving loads it: both use the trained-on base.
    config = config.model_copy(update={"serving": config.serving.model_copy(update={"model_source": str(base)})})
    base_env = {**(env or {}), "RLOPS_SERVING__MODEL_SOURCE": str(base)}
    # Serving needs only the base: its start (vLLM's engine, minutes on a small machine) overlaps training.
    serve_record = _start_serving(config, config_path, base_url, base_env)
    # So does the webhook receiver: it starts, and MLflow's webhook cache expires, while training runs.
    receiver = _start_receiver(config, config_path, base_env)

    with progress.stage("GRPO + LoRA training, tracked in MLflow") as stage:
        run_dir = config.data_path / "runs" / time.strftime("%Y%m%d-%H%M%S")
        local = config.training.local
        updates = {}
        endpoint_answers, training_done = threading.Event(), threading.Event()
        if fast:  # the plumbing check: greedy evals only (sampled pass@1 of the random-init base says nothing)
            updates["eval_samples"] = 0
        if serve_record is not None and local.torch_threads is None:
            # The endpoint starts beside: a core of its own until it answers, else torch's threads wait at
            # every op for the one it holds (bench/README.md, "The demo's GRPO stage beside the endpoint").
            updates["torch_threads"] = max(1, len(os.sched_getaffinity(0)) - 1)
            _watch_endpoint(base_url, config.serving.base_model_id, api_key, endpoint_answers, training_done)
        if updates:
            local = local.model_copy(update=updates)
            config = config.model_copy(update={"training": config.training.model_copy(update={"local": local})})
        try:
            result = local_trainer.train(config, run_dir, fast=fast, steps=FAST_STEPS if fast else None,
                                         log=stage.detail, report=lambda p: stage.live(p.line()),
                                         threads_back=endpoint_answers if "torch_threads" in updates else None)
        finally:
            training_done.set()
        summary.run_id, summary.version = result.run_id, result.registered_version
        summary.pass_rate_before, summary.pass_rate_after = result.before, result.after
        summary.registration_refused, summary.registration_evidence = (result.registration_refused,
                                                                       result.registration_evidence)
        outcome = (f"{result.registration_refused}; production keeps its current version"
                   if result.registration_refused else f"registered {model} v{result.registered_version}"
                   + (f": it beat the base, {result.registration_evidence}" if result.registration_evidence else ""))
        best = f" (best {result.best[1]} at step {result.best[0]})" if result.best and result.best[1] != result.after else ""
        stage.note = (f"run {result.run_id}: {result.steps} steps, {result.eval_data_source} pass rate "
                      f"{result.before} -> {result.after}{best}; {outcome}")
        if result.registered_version is None and not result.registration_refused:
            raise DemoError("training registered no checkpoint (no eval ran); nothing to promote")
    version = int(result.registered_version) if result.registered_version is not None else None

    with progress.stage("promotion: staging via webhook, production via promote") as stage:
        if version is None:
            stage.note = "skipped: this run registered nothing that beat its base"
        else:
            stage.note = _promote(config, model, version, receiver)

    with progress.stage("serving: Ray Serve LLM endpoint on vLLM (started beside training)") as stage:
        route = _manifest(config, model).aliases.get("production")
        production = route.version if route is not None else None
        # nothing in production yet (no run beat its base): the endpoint serves the base model alone
        wanted = f"{config.serving.base_model_id}:{model}" if route is not None else config.serving.base_model_id
        waited = processes.wait_healthy(
            serve_record if serve_record is not None and serve_record.process() is not None else None,
            lambda: _endpoint_ready(base_url, wanted, production, api_key), SERVE_READY_TIMEOUT_S, "endpoint")
        stage.note = (f"{base_url} lists {wanted}" + (f" at v{production}" if production else " (no production version)")
                      + f", ready after {waited:.1f} s (log: {processes.log_path(config.data_path, 'serve')})")

    chat = ChatClient(base_url, api_key)
    lift_source = task.eval_sets()[0]
    lift_items = task.eval_items(lift_source)
    # The base answers the lift's items while parity asks production the same ones: one batch for the engine.
    asking = ThreadPoolExecutor(1, thread_name_prefix="rlops-demo-base")
    base_asked = asking.submit(chat.answers, config.serving.base_model_id, lift_items, task.answer_length)
    try:
        with progress.stage("parity: the served answers against the tracked eval (promote verify)") as stage:
            from registry_hooks.parity import verify_served

            if production is None:
                stage.note = "skipped: no production version"
            else:
                report = verify_served(config, model, alias="production", version=None, api_key=api_key,
                                       endpoint=base_url.removesuffix("/v1"))
                summary.parity = report.to_dict()
                stage.note = (f"{report.served_name} (v{report.version}): served {report.served:.4f} vs tracked "
                              f"{report.tracked:.4f} on {report.data_source}; {report.matching}/{report.items} items agree")

        with progress.stage("lift: the base and production on the same eval items, through the endpoint") as stage:
            data_source = summary.parity["data_source"] if summary.parity else lift_source
            if data_source == lift_source:
                items, base_answers = lift_items, base_asked.result()
            else:
                items = task.eval_items(data_source)
                base_answers = chat.answers(config.serving.base_model_id, items, task.answer_length)
            summary.lift = lift_counts(task, data_source, items, base_answers, summary.parity)
            stage.note = lift_line(summary.lift, task.name)
            if production is not None:
                shown = items[:PICTURE_ITEMS]
                answers = {"base": base_answers, "production": chat.answers(wanted, shown, task.answer_length)}
                summary.picture = str(_picture(config, task, result, summary.lift, shown, answers))
                stage.note += f"; picture: {summary.picture} (and in the run's artifacts)"
            # one request through the official openai client: what a production client sees
            from openai import OpenAI

            item = items[0]
            client = OpenAI(base_url=base_url, api_key=api_key or "none")
            raw = client.chat.completions.with_raw_response.create(
                model=wanted, temperature=0, max_tokens=task.answer_length, messages=item.messages())
            summary.answer = raw.parse().choices[0].message.content or ""
            summary.served_version = raw.headers.get("x-rlops-model-version")
            summary.passed = task.score(item, summary.answer).passed
            stage.detail(f"openai client: {wanted} (x-rlops-model-version: {summary.served_version}) answered "
                         f"{summary.answer!r} to {task.name} item {item.id}: {'passes' if summary.passed else 'fails'}")
    finally:
        asking.shutdown(wait=False, cancel_futures=True)
    return summary


def lift_counts(task: Task, data_source: str, items: list, base_answers: list[str], parity: dict | None) -> dict:
    """Solve counts of the base and of production on the same eval items, both answered by the endpoint
    (production's are the answers `promote verify` just scored)."""
    lift = {"data_source": data_source, "items": len(items),
            "base_solved": sum(task.score(it, a).passed for it, a in zip(items, base_answers)),
            "production_version": None, "production_solved": None}
    if parity:
        lift["production_version"] = parity["version"]
        lift["production_solved"] = round(parity["served_pass_rate"] * parity["items"])
    return lift


def _picture(config: Config, task: Task, result, lift: dict, items: list, answers: dict[str, list[str]]) -> Path:
    """The lift picture of this run (rlops.figures), logged to the run as `demo/lift.png`."""
    from mlflow import MlflowClient

    from rlops.figures import Example, draw_lift

    def example(who: str, index: int) -> Example:
        answer = answers[who][index]
        return Example(task.illustrate(items[index], answer), answer, task.score(items[index], answer).passed)

    path = config.data_path / "demo" / result.run_id / "lift.png"
    draw_lift(path, title=f"{task.name}: {config.registered_model} v{lift['production_version']} against its base",
              curve=result.curve, pick=result.best,
              solved=(lift["base_solved"], lift["production_solved"], lift["items"]),
              examples=[(it.id, example("base", i), example("production", i)) for i, it in enumerate(items)])
    MlflowClient(config.tracking_uri).log_artifact(result.run_id, str(path), "demo")
    return path


def lift_line(lift: dict, task_name: str) -> str:
    base = f"base solves {lift['base_solved']}/{lift['items']} {task_name} items of {lift['data_source']}"
    if lift["production_solved"] is None:
        return f"{base}; no production version to compare"
    gained = lift["production_solved"] - lift["base_solved"]
    return (f"{base}, production v{lift['production_version']} solves {lift['production_solved']}/{lift['items']} "
            f"({gained:+d})")


@dataclass
class Receiver:
    """The webhook receiver started for this run, and when MLflow's cached webhook list has it."""
    record: processes.ProcessRecord
    url: str
    seen_after: float  # time.monotonic()


def _start_receiver(config: Config, config_path: str | None, base_env: dict[str, str]) -> Receiver:
    """(Re)start `rlops hooks serve` on this run's base and register its webhook; does not wait for it."""
    from registry_hooks.subscriptions import register_webhook

    secret = _hooks_secret(config)
    processes.stop(config.data_path, "hooks")  # restart: it must check adapters against this run's base
    record = _start_cli(config, "hooks", ["hooks", "serve"],
                        _child_env(config, config_path, {**base_env, "RLOPS_HOOKS__SECRET": secret}))
    register_webhook(config.model_copy(update={"hooks": config.hooks.model_copy(update={"secret": secret})}))
    # the server caches its webhook list; a fresh one is seen after the TTL
    return Receiver(record, f"http://{config.hooks.host}:{config.hooks.port}", time.monotonic() + WEBHOOK_CACHE_TTL_S)


def _promote(config: Config, model: str, version: int, receiver: Receiver) -> str:
    """Staging through the webhook path (a plain MLflow client moves the alias), production via promote;
    the stage's line."""
    from mlflow import MlflowClient

    from registry_hooks.operations import promote
    from registry_hooks.sync import Refused

    processes.wait_healthy(receiver.record, lambda: stack.http_ok(f"{receiver.url}/healthz"), 60, "webhook receiver")
    time.sleep(max(0.0, receiver.seen_after - time.monotonic()))
    started = time.monotonic()
    MlflowClient(config.tracking_uri).set_registered_model_alias(model, "staging", str(version))
    processes.wait_healthy(None, lambda: _published_or_refused(config, model, "staging", version), 90,
                           "staging published by the webhook/reconciler")
    refused = _manifest(config, model).refused.get("staging")
    if refused is not None and refused.version == version:
        raise DemoError(f"promotion of v{version} to staging was refused: {refused.reason}")
    staging = f"staging -> v{version} by the webhook in {time.monotonic() - started:.1f} s"
    Stage.detail(f"webhook path: plain MlflowClient set {model}@staging -> v{version}; manifest published "
                 f"{time.monotonic() - started:.1f} s later")
    try:
        report = promote(config, model, to_alias="production", from_alias="staging", trigger="demo")
    except Refused as exc:
        Stage.detail(f"promote refused (guardrail): {exc}")
        return f"{staging}; promote refused (guardrail): production keeps its version"
    return f"{staging}; promote --from staging --to production: serving v{report.served.get('production')}"


def where_to_look(config: Config, summary: DemoSummary) -> str:
    model = config.registered_model
    name = f"{config.serving.base_model_id}:{model}"
    base_url = summary.urls["endpoint"]
    return f"""
Where to look
  MLflow UI            {config.tracking_uri}
    runs to compare:   Experiments > {config.tracking.experiment} (select runs > Compare)
    pass-rate chart:   run {summary.run_id} > Model metrics > eval/.../avg_score
    registry:          Models > {model} (aliases production, staging, candidate)
  Endpoint             {base_url}  (model "{name}", or "{name}@staging", "{name}@v<N>")
    curl {base_url}/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "{'hello'}"}}], "max_tokens": 8}}'
    python: OpenAI(base_url="{base_url}", api_key="none").chat.completions.create(model="{name}", messages=[...])
  Stage times          {", ".join(f"{k.split(':')[0]} {v:.0f}s" for k, v in summary.stages.items())}
  Stop everything      rlops down
"""
