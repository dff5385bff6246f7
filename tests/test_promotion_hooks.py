"""The webhook receiver and the reconciler against the real MLflow server: a plain
`MlflowClient.set_registered_model_alias` must reach serving within seconds, each path alone."""
from __future__ import annotations

import getpass
import json
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest
import uvicorn
from click.testing import CliRunner

from registry_hooks import operations
from registry_hooks.cli import main as promote_cli
from registry_hooks.service import Metrics, Reconciler, create_app
from registry_hooks.subscriptions import webhook_name
from registry_hooks.webhook import ALIAS_EVENTS, MAX_BODY_BYTES, sign
from rlops import processes
from rlops.cli import main as rlops_cli
from rlops.processes import free_port

from conftest import write_config
from test_promotion_support import lora_template, read_manifest, register_version, write_adapter  # noqa: F401


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return None


@pytest.fixture
def hooks_service(test_config, mlflow_client):
    """Factory: run the receiver + reconciler in-process on a real port with the given hooks settings."""
    running = []

    def start(**hooks):
        cfg = test_config.model_copy(deep=True)
        cfg.hooks.port = free_port()
        cfg.hooks.secret = "whsec-" + uuid.uuid4().hex
        for key, value in hooks.items():
            setattr(cfg.hooks, key, value)
        metrics = Metrics()
        reconciler = Reconciler(cfg, metrics)
        server = uvicorn.Server(uvicorn.Config(create_app(cfg, reconciler, metrics), host="127.0.0.1",
                                               port=cfg.hooks.port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        assert wait_for(lambda: server.started, 10)
        reconciler.start()
        running.append((server, thread, reconciler, cfg))
        return cfg, reconciler, metrics, f"http://127.0.0.1:{cfg.hooks.port}"

    yield start
    for server, thread, reconciler, cfg in running:
        server.should_exit = True
        thread.join(10)
        reconciler.stop()
        for hook in mlflow_client.list_webhooks(max_results=100):
            if hook.name == webhook_name(cfg):
                mlflow_client.delete_webhook(hook.webhook_id)


@pytest.fixture
def version(test_config, lora_template, tmp_path):
    def make(seed: int = 1) -> int:
        return register_version(test_config, write_adapter(lora_template, tmp_path / f"a{seed}", test_config, seed=seed),
                                step=seed)
    return make


def served(stack, config, alias="production"):
    manifest = read_manifest(stack, config)
    return manifest.aliases[alias].version if manifest and alias in manifest.aliases else None


def publish_latency(client, stack, cfg, version: int, alias: str = "production") -> float:
    """Seconds from a plain client's alias move to the manifest serving it (fails after 15 s)."""
    started = time.monotonic()
    client.set_registered_model_alias(cfg.registry.models[0], alias, str(version))
    assert wait_for(lambda: served(stack, cfg, alias) == version, 15), f"v{version} was not published"
    return time.monotonic() - started


def sample(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_webhook_alone_promotes_within_seconds(stack, test_config, mlflow_client, hooks_service, version, tmp_path):
    cfg, reconciler, metrics, url = hooks_service(reconcile_interval_s=0)
    # `rlops hooks register` with the secret from the environment only; `config show` never prints it.
    path = write_config(tmp_path / "mlflow.yaml", cfg.model_dump(exclude_none=True, exclude={"hooks": {"secret"}}))
    runner = CliRunner()
    env = {"RLOPS_HOOKS__SECRET": cfg.hooks.secret}
    registered = runner.invoke(rlops_cli, ["--config", str(path), "hooks", "register"], env=env)
    assert registered.exit_code == 0 and f"-> {url}/webhook" in registered.stdout, registered.output
    shown = runner.invoke(rlops_cli, ["--config", str(path), "config", "show"], env=env)
    assert shown.exit_code == 0 and cfg.hooks.secret not in shown.stdout and "secret: '****'" in shown.stdout
    again = runner.invoke(rlops_cli, ["--config", str(path), "hooks", "register"], env=env)  # updates, no duplicate
    assert again.exit_code == 0
    assert [h.name for h in mlflow_client.list_webhooks(max_results=100)].count(webhook_name(cfg)) == 1
    model = cfg.registry.models[0]
    v1 = version(1)
    time.sleep(2.5)  # the server caches its webhook list for MLFLOW_WEBHOOK_CACHE_TTL (2 s in the embedded stack)

    latency = publish_latency(mlflow_client, stack, cfg, v1)
    print(f"alias set -> manifest published via webhook: {latency:.2f}s")
    assert latency < 10
    assert wait_for(lambda: sample(metrics, "rlops_hooks_syncs_total", trigger="webhook", outcome="ok") >= 1, 10)
    assert sample(metrics, "rlops_hooks_syncs_total", trigger="reconciler", outcome="ok") == 0
    assert read_manifest(stack, cfg).aliases["production"].trigger == "webhook"

    mlflow_client.delete_registered_model_alias(model, "production")  # .deleted events reconcile too
    assert wait_for(lambda: served(stack, cfg) is None, 15)
    body = httpx.get(f"{url}/metrics").text
    assert 'rlops_hooks_deliveries_total{result="accepted"}' in body


def test_dead_webhooks_are_reported_pruned_and_never_delay_the_live_one(stack, test_config, mlflow_client,
                                                                        hooks_service, version, tmp_path, request):
    """Webhooks left by stopped receivers (issue 36): MLflow retries each delivery to them for ~7 s from one
    pool of 10 workers, so every move queues that much work before the next move's deliveries. With 12 of them
    a move still reaches the live receiver within the bound; `rlops hooks register` and `rlops status` name
    them, `rlops hooks prune` deletes exactly those, and then a burst of other moves delays nothing."""
    dead = {mlflow_client.create_webhook(f"stale-{i}-{uuid.uuid4().hex[:6]}", f"http://127.0.0.1:{free_port()}/webhook",
                                         list(ALIAS_EVENTS)).webhook_id for i in range(12)}
    request.addfinalizer(lambda: [mlflow_client.delete_webhook(h.webhook_id)
                                  for h in mlflow_client.list_webhooks(max_results=100) if h.webhook_id in dead])
    cfg, reconciler, metrics, url = hooks_service(reconcile_interval_s=0)
    path = write_config(tmp_path / "mlflow.yaml", cfg.model_dump(exclude_none=True, exclude={"hooks": {"secret"}}))
    runner = CliRunner()
    env = {"RLOPS_HOOKS__SECRET": cfg.hooks.secret}
    registered = runner.invoke(rlops_cli, ["--config", str(path), "hooks", "register"], env=env)
    assert registered.exit_code == 0 and "12 webhook(s) on alias events do not answer" in registered.stderr, \
        registered.output
    assert all(hook_id in registered.stderr for hook_id in dead) and "rlops hooks prune" in registered.stderr
    model = cfg.registry.models[0]
    v1, v2 = version(1), version(2)
    time.sleep(2.5)  # MLFLOW_WEBHOOK_CACHE_TTL of the embedded stack

    latency = publish_latency(mlflow_client, stack, cfg, v1)
    print(f"12 dead webhooks registered: alias set -> published via webhook in {latency:.2f}s")
    assert latency < 10

    status = runner.invoke(rlops_cli, ["--config", str(path), "status"], env=env)
    assert "webhooks 1/13 on alias events answer" in status.stdout, status.output
    assert all(hook_id in status.stderr for hook_id in dead), status.output
    pruned = runner.invoke(rlops_cli, ["--config", str(path), "hooks", "prune", "--yes"], env=env)
    assert pruned.exit_code == 0, pruned.output
    assert {line.split()[2] for line in pruned.stdout.splitlines() if line.startswith("deleted webhook")} == dead
    left = {h.webhook_id: h.name for h in mlflow_client.list_webhooks(max_results=100)}
    assert not dead & set(left) and webhook_name(cfg) in left.values()
    assert "nothing to delete" in runner.invoke(rlops_cli, ["--config", str(path), "hooks", "prune"], env=env).stdout

    other = f"{model}-other"  # another team's model: its moves' deliveries queue before ours in MLflow's pool
    mlflow_client.create_registered_model(other)
    other_version = mlflow_client.create_model_version(other, f"s3://{cfg.storage.bucket}/elsewhere").version
    time.sleep(2.5)
    for i in range(30):  # once pruned, a burst of moves queues nothing slow in front of the one that matters
        mlflow_client.set_registered_model_alias(other, f"burst{i}", other_version)
    assert publish_latency(mlflow_client, stack, cfg, v2) < 10


def test_cli_moves_are_credited_to_their_author_whichever_publisher_wins(stack, test_config, mlflow_client,
                                                                         hooks_service, version, tmp_path):
    """Issue 40: the CLI's own sync, the webhook and the reconciler race to publish each `promote`; every
    entry names the CLI user, trigger `cli` and the reason (one move, one entry), and a plain
    MlflowClient's move is the registry's, never the webhook's."""
    cfg, reconciler, metrics, url = hooks_service(reconcile_interval_s=0.3)
    path = write_config(tmp_path / "mlflow.yaml", cfg.model_dump(exclude_none=True, exclude={"hooks": {"secret"}}))
    runner = CliRunner()
    env = {"RLOPS_HOOKS__SECRET": cfg.hooks.secret}
    assert runner.invoke(rlops_cli, ["--config", str(path), "hooks", "register"], env=env).exit_code == 0
    model = cfg.registry.models[0]
    v1, v2 = version(1), version(2)
    time.sleep(2.5)  # MLFLOW_WEBHOOK_CACHE_TTL of the embedded stack
    moves = 8
    for i in range(moves):
        moved = runner.invoke(promote_cli, ["--config", str(path), model, "--version", str((v1, v2)[i % 2]),
                                            "--to", "production", "--force", "--reason", f"move {i}"], env=env)
        assert moved.exit_code == 0, moved.output
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    assert wait_for(lambda: served(stack, cfg) == v1, 15)
    assert wait_for(lambda: sample(metrics, "rlops_hooks_deliveries_total", result="accepted") >= moves, 15)

    entries = json.loads(runner.invoke(promote_cli, ["--config", str(path), "history", model, "--json"]).stdout)
    actor = f"os:{getpass.getuser()}"
    *by_cli, by_hand = entries
    assert [(e["version"], e["trigger"], e["actor"], e["reason"]) for e in by_cli] == [
        ((v1, v2)[i % 2], "cli", actor, f"move {i}") for i in range(moves)]
    assert (by_hand["version"], by_hand["actor"], by_hand["reason"]) == (v1, "registry", None)
    assert by_hand["trigger"] in ("webhook", "reconciler")  # the publisher that saw it first
    tags = mlflow_client.get_registered_model(model).tags
    assert not [key for key in tags if key.startswith("rlops.move.")]  # each note went once published


def test_forged_stale_replayed_and_duplicate_deliveries(stack, test_config, mlflow_client, hooks_service, version):
    cfg, reconciler, metrics, url = hooks_service(reconcile_interval_s=0)
    model = cfg.registry.models[0]
    v1 = version(1)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    # The payload's version is a lie: the receiver must only reconcile the model from the registry.
    body = json.dumps({"entity": "model_version_alias", "action": "created", "timestamp": "now",
                       "data": {"name": model, "alias": "production", "version": "999"}}).encode()

    def post(secret=cfg.hooks.secret, ts=None, delivery="d-1", payload=body, headers=None):
        ts = str(int(time.time()) if ts is None else ts)
        sent = headers if headers is not None else {
            "X-MLflow-Delivery-Id": delivery, "X-MLflow-Timestamp": ts,
            "X-MLflow-Signature": sign(secret, delivery, ts, payload)}
        return httpx.post(f"{url}/webhook", content=payload, headers=sent, timeout=5)

    assert post(secret="wrong-secret").status_code == 401
    assert post(ts=int(time.time()) - 3600).status_code == 401
    assert post(ts=int(time.time()) + 3600).status_code == 401
    assert post(headers={}).status_code == 401
    # A non-ASCII signature is a 401 like any other bad one (it was a 500).
    assert post(headers={"X-MLflow-Delivery-Id": "d-9", "X-MLflow-Timestamp": str(int(time.time())),
                         "X-MLflow-Signature": "v1,\u00e9\u00e8==".encode("latin-1")}).status_code == 401
    # Over the cap: refused from Content-Length, and while streaming when no length is declared.
    big = b" " * (MAX_BODY_BYTES + 1)
    assert post(delivery="d-big", payload=big).status_code == 413
    streamed = httpx.post(f"{url}/webhook", content=iter([big[:1024], big[1024:]]), timeout=5)
    assert "content-length" not in streamed.request.headers and streamed.status_code == 413
    tampered = post(delivery="d-2")
    assert tampered.status_code == 202
    good_headers = dict(tampered.request.headers)
    assert post(headers=good_headers).json() == {"status": "duplicate"}  # replay of a seen delivery
    assert post(delivery="d-2").json() == {"status": "duplicate"}
    assert post(payload=body.replace(b'"created"', b'"updated"'), headers=good_headers).status_code == 401
    other = json.dumps({"entity": "model_version_alias", "action": "created", "data": {"name": "elsewhere"}}).encode()
    assert post(delivery="d-3", payload=other).json() == {"status": "ignored"}

    assert wait_for(lambda: served(stack, cfg) == v1, 15)
    assert wait_for(lambda: sample(metrics, "rlops_hooks_syncs_total", trigger="webhook", outcome="ok") == 1, 10)
    time.sleep(1)
    assert sample(metrics, "rlops_hooks_syncs_total", trigger="webhook", outcome="ok") == 1  # duplicates: once
    assert sample(metrics, "rlops_hooks_deliveries_total", result="rejected") == 6
    assert sample(metrics, "rlops_hooks_deliveries_total", result="bad_request") == 2
    assert len(read_manifest(stack, cfg).history) == 1


def test_reconciler_alone_converges_with_receiver_off(stack, test_config, mlflow_client, hooks_service, version,
                                                      tmp_path):
    cfg, reconciler, metrics, url = hooks_service(webhook_enabled=False, reconcile_interval_s=1)
    model = cfg.registry.models[0]
    v1, v2 = version(1), version(2)
    assert httpx.post(f"{url}/webhook", content=b"{}").status_code == 404

    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    assert wait_for(lambda: served(stack, cfg) == v1, 10), "reconciler did not converge"
    # A legacy stage transition (no webhook exists for it) converges too, for the unset `staging`? No:
    # only "Production" maps, and only while the alias is unset -> delete the alias and transition v2.
    mlflow_client.delete_registered_model_alias(model, "production")
    with pytest.warns(FutureWarning):
        mlflow_client.transition_model_version_stage(model, str(v2), "Production")
    assert wait_for(lambda: served(stack, cfg) == v2, 10), "legacy stage not followed"

    # Converged, the next pass has nothing to do: it syncs nothing and says how long it took.
    def settled():
        health = httpx.get(f"{url}/healthz").json()
        last_pass = health["reconciler"]["last_pass"]
        return health if health["reconciler"]["runs"] >= 2 and last_pass and last_pass["models_synced"] == 0 else None

    health = wait_for(settled, 10)
    assert health and health["status"] == "ok" and health["reconciler"]["last_error"] is None
    last_pass = health["reconciler"]["last_pass"]
    assert last_pass["models_seen"] == last_pass["models_registered"] == 1 and last_pass["behind_s"] == 0
    assert 0 < last_pass["seconds"] < 1 and last_pass["interval_s"] == 1 and health["reconciler"]["pass_error"] is None
    state = operations.status(cfg)
    assert state["in_sync"] and state["reconciler"]["last_run_at"] and not state["reconciler"]["stale"]
    assert state["reconciler"]["last_pass"]["models_seen"] == 1  # the heartbeat in _status/reconciler.json
    path = write_config(tmp_path / "mlflow.yaml", cfg.model_dump(exclude_none=True, exclude={"hooks": {"secret"}}))
    shown = CliRunner().invoke(promote_cli, ["--config", str(path), "status"], env=stack.env)
    assert shown.exit_code == 0 and "reconciler: ok" in shown.stdout, shown.output
    assert "1 models seen, 0 synced (0 failed), 0.0 s behind the 1 s interval" in shown.stdout, shown.output

    # The reconciler also settles tracked runs whose process died silently (heartbeat stopped).
    from tracker.heartbeat import TAG_HEARTBEAT

    existing = mlflow_client.get_experiment_by_name(cfg.tracking.experiment)
    experiment_id = existing.experiment_id if existing else mlflow_client.create_experiment(cfg.tracking.experiment)
    dead = mlflow_client.create_run(experiment_id, tags={TAG_HEARTBEAT: str(time.time() - 10 * 3600)})
    assert wait_for(lambda: mlflow_client.get_run(dead.info.run_id).info.status == "FAILED", 10), "stale run not swept"


def test_hooks_serve_command_runs_and_is_stoppable(stack, test_config, tmp_path):
    from rlops.config import AutoCanaryConfig

    cfg = test_config.model_copy(deep=True)
    cfg.hooks.port = free_port()
    cfg.registry.shadow.auto_canary = AutoCanaryConfig(interval_s=0.5)  # its loop starts and stops with the service
    cfg.data_dir = str(tmp_path / "data")  # its own process records; S3 credentials come from stack.env
    path = write_config(tmp_path / "mlflow.yaml", cfg.model_dump(exclude_none=True))
    env = {**stack.env, "RLOPS_CONFIG": str(path), "RLOPS_HOOKS__SECRET": "whsec-cli"}
    proc = subprocess.Popen([sys.executable, "-m", "rlops", "hooks", "serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: processes.read_record(cfg.data_path, "hooks"), 30)
        health = wait_for(lambda: _get_json(f"http://127.0.0.1:{cfg.hooks.port}/healthz"), 30)
        assert health and health["status"] == "ok"
        assert processes.stop(cfg.data_path, "hooks")  # what `rlops down` does
        proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
    missing = subprocess.run([sys.executable, "-m", "rlops", "hooks", "serve"], env={**env, "RLOPS_HOOKS__SECRET": ""},
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "RLOPS_HOOKS__SECRET" in missing.stderr


def _get_json(url: str):
    try:
        return httpx.get(url, timeout=1).json()
    except httpx.HTTPError:
        return None


def test_receiver_answers_any_delivery_without_a_5xx(hooks_service):
    """Property test: forged, replayed, stale, malformed, oversized and valid deliveries with arbitrary
    headers (non-ASCII included) all get a JSON 2xx/4xx, never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cfg, reconciler, metrics, url = hooks_service(reconcile_interval_s=0)
    client = httpx.Client(timeout=10)
    names = st.one_of(st.just(cfg.registry.models[0]), st.text(max_size=12), st.integers(), st.none())
    events = st.builds(lambda entity, action, name: {"entity": entity, "action": action, "data": {"name": name}},
                       st.sampled_from(["model_version_alias", "model_version", "x", ""]),
                       st.sampled_from(["created", "deleted", "updated"]), names)
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=3), max_leaves=8)
    payloads = st.one_of(
        events.map(lambda e: json.dumps(e).encode()),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=512),
        st.integers(MAX_BODY_BYTES - 2, 2 * MAX_BODY_BYTES).map(lambda n: b"{" + b" " * n + b"}"),
    )
    header_chars = st.characters(codec="latin-1", exclude_categories=("Cc",))
    header_text = st.text(alphabet=header_chars, max_size=60).map(str.strip)
    seen_ids: list[str] = []

    @settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(payload=payloads, how=st.sampled_from(["valid", "replay", "wrong-secret", "garbage", "missing", "stale"]),
           delivery=header_text, garbage=header_text)
    def deliver(payload, how, delivery, garbage):
        delivery = delivery or "d"
        if how == "replay" and seen_ids:
            delivery = seen_ids[-1]
        stamp = str(int(time.time()) - (3600 if how == "stale" else 0))
        secret = "not-the-secret" if how == "wrong-secret" else cfg.hooks.secret
        signature = garbage if how == "garbage" else sign(secret, delivery, stamp, payload)
        headers = {} if how == "missing" else {"X-MLflow-Delivery-Id": delivery, "X-MLflow-Timestamp": stamp,
                                               "X-MLflow-Signature": signature}
        response = client.post(f"{url}/webhook", content=payload,
                               headers={k: v.encode("latin-1") for k, v in headers.items()})
        assert response.status_code < 500, (how, response.status_code, response.text)
        body = response.json()
        assert isinstance(body, dict) and ("error" in body or "status" in body), body
        seen_ids.append(delivery)

    deliver()
    assert sample(metrics, "rlops_hooks_deliveries_total", result="rejected") > 0


def test_reconciler_converges_a_canary_set_in_the_registry(stack, test_config, mlflow_client, hooks_service, version):
    """The canary intent is plain registry state: an alias and a tag set by hand reach the manifest."""
    cfg, reconciler, metrics, url = hooks_service(webhook_enabled=False, reconcile_interval_s=1)
    model = cfg.registry.models[0]
    v1, v2 = version(1), version(2)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    mlflow_client.set_registered_model_tag(model, "rlops.canary_weight.production", "20")
    mlflow_client.set_registered_model_alias(model, "production-canary", str(v2))

    def canary():
        manifest = read_manifest(stack, cfg)
        found = manifest.canaries.get("production") if manifest else None
        return (found.version, found.weight) if found else None

    assert wait_for(lambda: canary() == (v2, 20), 15), canary()
    mlflow_client.set_registered_model_tag(model, "rlops.canary_weight.production", "45")  # a reweight alone
    assert wait_for(lambda: canary() == (v2, 45), 15), canary()
    assert operations.status(cfg)["in_sync"]
    triggers = {(h.event, h.trigger) for h in read_manifest(stack, cfg).history}
    assert ("canary", "reconciler") in triggers


def test_history_after_cli_webhook_and_watcher_moves_names_each_actor(stack, test_config, mlflow_client, hooks_service,
                                                                     version, tmp_path):
    """`promote history` after a CLI move and canary, a move that reached serving through an HMAC-signed webhook
    delivery, and a watcher abort: each entry says its trigger and who moved (the CLI's OS user without tracking
    auth, `registry` for a plain client's move, the watcher), with the reasons. The watcher reads its metrics from a
    fixed Prometheus text here (the real scrape and breach are in test_serving_app)."""
    from registry_hooks.watcher import CanaryWatcher
    from rlops.config import CanarySLO

    cfg, reconciler, metrics, url = hooks_service(reconcile_interval_s=0)
    model = cfg.registry.models[0]
    v1, v2 = version(1), version(2)
    path = write_config(tmp_path / "mlflow.yaml", cfg.model_dump(exclude_none=True))

    def cli(*args: str):
        result = CliRunner().invoke(promote_cli, ["--config", str(path), *args], env={"MLFLOW_TRACKING_USERNAME": "eve"})
        assert result.exit_code == 0, result.output
        return result.stdout

    cli(model, "--version", str(v1), "--to", "production", "--reason", "first")
    cli("canary", model, "--version", str(v2), "--weight", "50", "--reason", "try v2")
    mlflow_client.set_registered_model_alias(model, "staging", str(v2))
    body = json.dumps({"entity": "model_version_alias", "action": "created", "timestamp": "now",
                       "data": {"name": model, "alias": "staging", "version": str(v2)}}).encode()
    ts, delivery = str(int(time.time())), "d-" + uuid.uuid4().hex
    posted = httpx.post(f"{url}/webhook", content=body, timeout=5, headers={
        "X-MLflow-Delivery-Id": delivery, "X-MLflow-Timestamp": ts, "X-MLflow-Signature": sign(cfg.hooks.secret, delivery, ts, body)})
    assert posted.status_code == 202, posted.text
    assert wait_for(lambda: served(stack, cfg, "staging") == v2, 15)

    labels = f'registered_model="{model}",alias="production",endpoint="chat"'
    scrapes = iter([
        "",
        f'ray_rlops_serving_requests_total{{{labels},version="{v1}",canary="false"}} 30\n'
        f'ray_rlops_serving_requests_total{{{labels},version="{v2}",canary="true"}} 30\n'
        f'ray_rlops_serving_errors_total{{{labels},version="{v2}",canary="true",status="500"}} 12\n'])
    watched = cfg.model_copy(deep=True)
    watched.registry.canary.slo = CanarySLO(window_s=20, min_requests=10)
    clock = iter([0.0, 5.0])
    watcher = CanaryWatcher(watched, scrape=lambda: next(scrapes), clock=lambda: next(clock))
    assert watcher.tick() == [] and len(watcher.tick()) == 1

    entries = json.loads(cli("history", model, "--json"))
    actor = f"os:{getpass.getuser()}"
    assert [(e["alias"], e["event"], e["version"], e["trigger"], e["actor"]) for e in entries] == [
        ("production", "move", v1, "cli", actor), ("production", "canary", v2, "cli", actor),
        ("staging", "move", v2, "webhook", "registry"),  # a plain MlflowClient's move, published by the webhook
        ("production", "canary_aborted", v2, "watcher", "rlops-hooks/watcher")]
    assert [e["reason"] for e in entries][:3] == ["first", "try v2", None] and "error rate 40.0%" in entries[3]["reason"]
    shown = cli("history", model, "--alias", "production")
    assert f"canary v{v2} dropped" in shown and "rlops-hooks/watcher" in shown and "webhook:" not in shown
    everything = cli("history", model)
    assert all(trigger in everything for trigger in ("cli", "webhook", "watcher"))
    print(everything)  # the README's sample is this output
