"""MLflow on PostgreSQL: the SQL-sensitive subset against a real PostgreSQL server and an MLflow server
that `rlops up` starts on it, with basic-auth on: registration and aliases, webhooks (they need a SQL
store) with signed delivery, run resume, and per-model permissions (no EDIT -> cannot move an alias).

The database password is generated here and travels only through the environment
(`RLOPS_SERVER__BACKEND_STORE_URI`) and 0600 files; the tests check that it never reaches a command line,
a process record or a log. PostgreSQL comes from Debian's `postgresql` package (scripts/install.sh).
"""
from __future__ import annotations

import base64
import glob
import hashlib
import hmac
import http.server
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import psycopg
import pytest

from rlops.config import Config, load_config
from rlops.processes import free_port

from conftest import write_config
from test_promotion_support import lora_template  # noqa: F401 - a fixture

RLOPS = [str(Path(sys.executable).parent / "rlops")]  # the installed console script, as users run it
PG_USER = "rlops"
ADMIN = "admin"


# -------------------------------------------------------------------------------------------- PostgreSQL


def _pg_bindir() -> Path | None:
    """Debian keeps the server binaries off PATH, in /usr/lib/postgresql/<major>/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(candidates[-1]).parent if candidates else None


def _write_private(path: Path, text: str, owner: pwd.struct_passwd | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    if owner is not None:
        os.chown(path, owner.pw_uid, owner.pw_gid)


@dataclass
class Postgres:
    port: int
    password: str
    root: Path

    def uri(self, database: str) -> str:
        return f"postgresql://{PG_USER}:{self.password}@127.0.0.1:{self.port}/{database}"


def _start_postgres(bindir: Path, root: Path, password: str, user: str | None, log) -> tuple[subprocess.Popen, int]:
    """initdb with the password from a 0600 file (never argv), then the server on a free loopback port."""
    pwfile = root / "pwfile"
    _write_private(pwfile, password + "\n", pwd.getpwnam(user) if user else None)
    data = root / "data"
    init = subprocess.run(
        [str(bindir / "initdb"), "-D", str(data), "-U", PG_USER, f"--pwfile={pwfile}", "-E", "UTF8",
         "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", "--no-sync"],
        user=user, capture_output=True, text=True, cwd=root,
    )
    pwfile.unlink()
    assert init.returncode == 0, f"initdb failed: {init.stderr[-2000:]}"
    port = free_port()
    # Test-only durability settings: nothing here must survive a crash, and fsync costs seconds on 2 cores.
    server = subprocess.Popen(
        [str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-c", "listen_addresses=127.0.0.1",
         "-c", f"unix_socket_directories={root}", "-c", "fsync=off", "-c", "synchronous_commit=off",
         "-c", "full_page_writes=off", "-c", "max_connections=50"],
        user=user, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root,
    )
    return server, port


def _connect_when_ready(server: subprocess.Popen, port: int, password: str, log_path: Path) -> psycopg.Connection:
    deadline = time.monotonic() + 30
    while True:
        try:
            return psycopg.connect(host="127.0.0.1", port=port, user=PG_USER, password=password,
                                   dbname="postgres", autocommit=True)
        except psycopg.OperationalError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start:\n{log_path.read_text()[-2000:]}") from None
            time.sleep(0.2)


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL cluster on a free loopback port, password auth (scram) only."""
    bindir = _pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries not found: run scripts/install.sh (apt-get install postgresql)")
    # PostgreSQL refuses to run as root: as root, run it as the `postgres` account the package creates.
    user = "postgres" if os.geteuid() == 0 else None
    try:
        owner = pwd.getpwnam(user) if user else None
    except KeyError:
        pytest.skip("running as root needs the `postgres` account (Debian's postgresql package creates it)")
    root = Path(tempfile.mkdtemp(prefix="rlops-pg-"))
    if owner:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    password = secrets.token_urlsafe(24)
    log_path = root / "postgres.log"
    server = None
    try:
        with open(log_path, "ab") as log:
            server, port = _start_postgres(bindir, root, password, user, log)
        with _connect_when_ready(server, port, password, log_path) as conn:
            conn.execute("CREATE DATABASE mlflow")
            conn.execute("CREATE DATABASE mlflow_auth")
        yield Postgres(port, password, root)
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)  # fast shutdown: ends any leftover session
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------------- MLflow via rlops up


@dataclass
class PgMlflow:
    config: Config
    admin_password: str
    env: dict[str, str]
    up_output: str

    @property
    def tracking_uri(self) -> str:
        return self.config.tracking_uri

    @property
    def data_path(self) -> Path:
        return self.config.data_path


def run_cli(args, env, timeout=120):
    return subprocess.run([*RLOPS, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pg_mlflow(postgres: Postgres, stack, tmp_path_factory):
    """`rlops up` with the backend store on PostgreSQL (URI from the environment only), basic-auth on,
    artifacts in the session stack's S3 (storage not managed here: this data dir starts only MLflow)."""
    root = tmp_path_factory.mktemp("pg-mlflow")
    port = free_port()
    config_path = write_config(root / "mlflow.yaml", {
        "data_dir": str(root / "data"),
        "server": {"port": port, "auth": True, "artifacts_destination": f"s3://{stack.config.storage.bucket}/pg-artifacts"},
        "storage": {"managed": False, "endpoint_url": stack.config.storage.endpoint_url,
                    "bucket": stack.config.storage.bucket},
    })
    (root / "data").mkdir()
    admin_password = secrets.token_urlsafe(18)
    auth_ini = root / "data" / "basic_auth.ini"
    # The auth store's URI carries no password: libpq takes it from PGPASSWORD, as docker/compose.yaml does.
    _write_private(auth_ini, "\n".join([
        "[mlflow]", "default_permission = READ",
        f"database_uri = postgresql://{PG_USER}@127.0.0.1:{postgres.port}/mlflow_auth",
        f"admin_username = {ADMIN}", "authorization_function = mlflow.server.auth:authenticate_request_basic_auth",
        # Each request otherwise re-runs PBKDF2 on the password: seconds per test on 2 loaded cores.
        "auth_cache_ttl_seconds = 60", "",
    ]))
    env = stack.env
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(
        RLOPS_CONFIG=str(config_path),
        RLOPS_SERVER__BACKEND_STORE_URI=postgres.uri("mlflow"),
        MLFLOW_AUTH_CONFIG_PATH=str(auth_ini),
        MLFLOW_AUTH_ADMIN_PASSWORD=admin_password,
        PGPASSWORD=postgres.password,
    )
    up = run_cli(["up", "--timeout", "120"], env, timeout=180)
    config = load_config(config_path, environ=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield PgMlflow(config, admin_password, env, up.stdout + up.stderr)
    finally:
        down = run_cli(["down"], env)
        assert down.returncode == 0, down.stdout + down.stderr


@contextmanager
def as_user(monkeypatch, username: str, password: str):
    """MLflow clients read basic-auth credentials from the environment on every request."""
    with monkeypatch.context() as m:
        m.setenv("MLFLOW_TRACKING_USERNAME", username)
        m.setenv("MLFLOW_TRACKING_PASSWORD", password)
        yield


@pytest.fixture
def client(pg_mlflow: PgMlflow, monkeypatch):
    """An MlflowClient on the PostgreSQL-backed server, acting as the admin unless `as_user` says otherwise."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", pg_mlflow.admin_password)
    return MlflowClient(tracking_uri=pg_mlflow.tracking_uri, registry_uri=pg_mlflow.tracking_uri)


def _new_version(client, model: str, run_id: str | None = None):
    return client.create_model_version(model, source=f"s3://bucket/adapters/{uuid.uuid4().hex}", run_id=run_id)


# ------------------------------------------------------------------------------------------------- tests


def test_server_runs_on_postgres_and_password_stays_out_of_argv_and_logs(postgres, pg_mlflow):
    with psycopg.connect(host="127.0.0.1", port=postgres.port, user=PG_USER, password=postgres.password,
                          dbname="mlflow") as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'registered_model_aliases'")
        assert cur.fetchone()[0] == 1, "MLflow did not create its schema in PostgreSQL"
        cur.execute("SELECT version_num FROM alembic_version")
        assert cur.fetchone()[0]
    with psycopg.connect(host="127.0.0.1", port=postgres.port, user=PG_USER, password=postgres.password,
                         dbname="mlflow_auth") as conn:
        assert conn.execute("SELECT count(*) FROM users WHERE username = %s", (ADMIN,)).fetchone()[0] == 1
    record = json.loads((pg_mlflow.data_path / "run" / "mlflow.json").read_text())
    server = psutil.Process(record["pid"])
    cmdlines = [" ".join(p.cmdline()) for p in [server, *server.children(recursive=True)]]
    assert len(cmdlines) >= 1
    for secret in (postgres.password, pg_mlflow.admin_password):
        assert all(secret not in line for line in cmdlines)
        assert secret not in json.dumps(record)
        assert secret not in pg_mlflow.up_output
        for log in [*(pg_mlflow.data_path / "logs").glob("*.log"), postgres.root / "postgres.log"]:
            assert secret not in log.read_text(errors="replace"), f"{secret[:3]}... leaked into {log}"
    # `rlops status` shows the backend with the password masked.
    status = run_cli(["status"], pg_mlflow.env)
    assert postgres.password not in status.stdout + status.stderr
    assert f"postgresql://{PG_USER}:****@127.0.0.1:{postgres.port}/mlflow" in status.stdout


def test_registration_and_alias_moves_on_postgres(client, unique_name):
    model = f"pg-{unique_name}"
    client.create_registered_model(model)
    v1, v2 = _new_version(client, model), _new_version(client, model)
    client.set_model_version_tag(model, v2.version, "rlops.metric_value", "0.75")
    client.set_registered_model_alias(model, "production", v1.version)
    client.set_registered_model_alias(model, "staging", v2.version)
    assert client.get_model_version_by_alias(model, "production").version == v1.version
    # Moving an alias is one call; the old version loses it.
    client.set_registered_model_alias(model, "production", v2.version)
    assert client.get_model_version_by_alias(model, "production").version == v2.version
    assert client.get_model_version(model, v1.version).aliases == []
    assert sorted(client.get_model_version(model, v2.version).aliases) == ["production", "staging"]
    tagged = client.search_model_versions(f"name = '{model}' and tag.`rlops.metric_value` = '0.75'")
    assert [v.version for v in tagged] == [v2.version]
    client.delete_registered_model_alias(model, "staging")
    assert client.get_registered_model(model).aliases == {"production": v2.version}
    with pytest.raises(Exception, match="(?i)alias"):
        client.get_model_version_by_alias(model, "staging")


class _Receiver(http.server.BaseHTTPRequestHandler):
    deliveries: list[tuple[dict, bytes]] = []
    arrived = threading.Event()

    def do_POST(self):  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).deliveries.append(({k.lower(): v for k, v in self.headers.items()}, body))
        type(self).arrived.set()
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_hooks_register_creates_one_webhook_and_mlflow_delivers_signed(client, pg_mlflow, unique_name):
    """`rlops hooks register` (the product path) on the PostgreSQL store: idempotent, and MLflow delivers
    alias events signed with the hooks secret, which travels only through the environment."""
    model = f"pg-hook-{unique_name}"
    client.create_registered_model(model)
    version = _new_version(client, model)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    secret = secrets.token_hex(16)
    url = f"http://127.0.0.1:{server.server_port}/webhook"
    env = dict(pg_mlflow.env, RLOPS_HOOKS__SECRET=secret, RLOPS_HOOKS__PUBLIC_URL=url,
               RLOPS_SERVING__DYNAMIC_LORA_LOADING_PATH=f"s3://bucket/lora-{unique_name}",  # its own webhook name
               MLFLOW_TRACKING_USERNAME=ADMIN, MLFLOW_TRACKING_PASSWORD=pg_mlflow.admin_password)
    try:
        first, again = run_cli(["hooks", "register"], env), run_cli(["hooks", "register"], env)
        assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
        assert secret not in first.stdout + first.stderr + again.stdout + again.stderr
        # Reading webhooks back needs the server's persistent encryption key (mlflow#19896).
        mine = [w for w in client.list_webhooks() if w.url == url]
        assert len(mine) == 1, "re-registering must update the webhook, not add one"
        assert mine[0].webhook_id in first.stdout and mine[0].webhook_id in again.stdout
        # The server caches the webhook list (MLFLOW_WEBHOOK_CACHE_TTL=2 in the embedded stack).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            client.set_registered_model_alias(model, "production", version.version)
            if _Receiver.arrived.wait(timeout=3):
                break
            client.delete_registered_model_alias(model, "production")
        assert _Receiver.arrived.is_set(), "no webhook delivery within 30 s"
        headers, body = next((h, b) for h, b in _Receiver.deliveries
                             if json.loads(b)["data"]["name"] == model and json.loads(b)["action"] == "created")
        payload = json.loads(body)
        assert payload["entity"] == "model_version_alias"
        assert payload["data"] == {"name": model, "alias": "production", "version": version.version}
        signed = f"{headers['x-mlflow-delivery-id']}.{headers['x-mlflow-timestamp']}.{body.decode()}"
        expected = base64.b64encode(hmac.new(secret.encode(), signed.encode(), hashlib.sha256).digest()).decode()
        assert headers["x-mlflow-signature"] == f"v1,{expected}"
    finally:
        server.shutdown()
        server.server_close()
        for w in client.list_webhooks():
            if w.url == url:
                client.delete_webhook(w.webhook_id)


def test_run_resume_on_postgres(client, unique_name):
    from mlflow.entities import Metric, RunStatus

    experiment_id = client.create_experiment(f"pg-{unique_name}")
    run = client.create_run(experiment_id, run_name="grpo", tags={"rlops.resumable": "true"})
    run_id = run.info.run_id
    client.log_batch(run_id, metrics=[Metric("reward/avg_raw_reward", 0.1 * s, 0, s) for s in range(3)],
                     params=[])
    client.log_param(run_id, "lora_rank", "32")
    client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.KILLED))
    assert client.get_run(run_id).info.status == "KILLED"
    # Resume: same run id, RUNNING again, steps continue, re-logging an identical param is accepted.
    client.update_run(run_id, status="RUNNING")
    client.log_param(run_id, "lora_rank", "32")
    client.log_batch(run_id, metrics=[Metric("reward/avg_raw_reward", 0.1 * s, 0, s) for s in range(3, 6)])
    with pytest.raises(Exception, match="(?i)param"):
        client.log_param(run_id, "lora_rank", "64")
    client.set_terminated(run_id)
    resumed = client.get_run(run_id)
    assert resumed.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "reward/avg_raw_reward")
    assert sorted(m.step for m in history) == list(range(6))
    assert resumed.data.params == {"lora_rank": "32"}


def test_tracker_session_resumes_the_same_run_on_postgres(client, pg_mlflow, tmp_path, unique_name):
    """The tracker's own resume path (run id kept in the trainer's output dir) over basic-auth + PostgreSQL."""
    from tracker import RunSession

    config = pg_mlflow.config.model_copy(deep=True)
    config.tracking.experiment = f"pg-tracker-{unique_name}"
    run_dir = tmp_path / "checkpoints"
    with pytest.raises(KeyboardInterrupt):
        with RunSession.start(config, run_dir, params={"lora_rank": 32}, run_name="grpo") as session:
            first_run = session.run_id
            for step in range(3):
                session.log_metrics({"reward/avg_raw_reward": 0.1 * step}, step)
            assert session.flush(30)
            raise KeyboardInterrupt
    assert client.get_run(first_run).info.status == "KILLED"
    with RunSession.start(config, run_dir, params={"lora_rank": 32}) as session:
        assert session.run_id == first_run
        for step in range(3, 6):
            session.log_metrics({"reward/avg_raw_reward": 0.1 * step}, step)
        assert session.flush(30)
    run = client.get_run(first_run)
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlops.resumes"] == "1"
    history = client.get_metric_history(first_run, "reward/avg_raw_reward")
    assert sorted(m.step for m in history) == list(range(6))


def test_user_without_edit_cannot_move_alias(client, pg_mlflow, monkeypatch, unique_name):
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    model = f"pg-perm-{unique_name}"
    client.create_registered_model(model)
    v1, v2 = _new_version(client, model), _new_version(client, model)
    client.set_registered_model_alias(model, "production", v1.version)
    auth = get_app_client("basic-auth", tracking_uri=pg_mlflow.tracking_uri)
    reader, editor = f"reader-{unique_name}", f"editor-{unique_name}"
    passwords = {reader: secrets.token_urlsafe(12), editor: secrets.token_urlsafe(12)}
    for user, pw in passwords.items():
        auth.create_user(user, pw)
    auth.grant_user_permission(reader, "registered_model", model, "READ")
    auth.grant_user_permission(editor, "registered_model", model, "EDIT")
    assert auth.get_user_permission(reader, "registered_model", model).permission == "READ"

    with as_user(monkeypatch, reader, passwords[reader]):
        assert client.get_model_version_by_alias(model, "production").version == v1.version
        with pytest.raises(MlflowException) as denied:
            client.set_registered_model_alias(model, "production", v2.version)
        assert denied.value.get_http_status_code() == 403
        with pytest.raises(MlflowException) as denied_delete:
            client.delete_registered_model_alias(model, "production")
        assert denied_delete.value.get_http_status_code() == 403
    assert client.get_model_version_by_alias(model, "production").version == v1.version

    with as_user(monkeypatch, editor, passwords[editor]):
        client.set_registered_model_alias(model, "production", v2.version)
    assert client.get_model_version_by_alias(model, "production").version == v2.version

    with as_user(monkeypatch, reader, "wrong-password"):
        with pytest.raises(MlflowException) as unauthenticated:
            client.get_registered_model(model)
        assert unauthenticated.value.get_http_status_code() == 401


def test_promote_by_a_user_mlflow_denies_changes_nothing_and_the_history_names_who_moved(
        client, pg_mlflow, stack, unique_name, lora_template, tmp_path):
    """Two real MLflow users: `promote` acts within MLflow's permissions. A READ user is refused with exit 8
    before anything is copied or tagged; an EDIT user promotes, and the history credits that user."""
    from click.testing import CliRunner
    from mlflow.server import get_app_client

    from registry_hooks.cli import main as promote_cli
    from test_promotion_support import folder_objects, read_manifest, register_version, write_adapter

    model = f"pg-promote-{unique_name}"
    config = pg_mlflow.config.model_copy(deep=True)
    config.registry.models = [model]
    config.tracking.experiment = f"pg-promote-{unique_name}"
    config.serving.dynamic_lora_loading_path = f"s3://{config.storage.bucket}/lora-pg-{unique_name}"
    config_path = write_config(tmp_path / "mlflow.yaml", config.model_dump(exclude_none=True))
    version = register_version(config, write_adapter(lora_template, tmp_path / "a1", config), step=1)
    auth = get_app_client("basic-auth", tracking_uri=pg_mlflow.tracking_uri)
    passwords = {role: secrets.token_urlsafe(12) for role in ("reader", "editor")}
    for role, password in passwords.items():
        auth.create_user(f"{role}-{unique_name}", password)
        auth.grant_user_permission(f"{role}-{unique_name}", "registered_model", model,
                                   "READ" if role == "reader" else "EDIT")

    def promote_as(role: str) -> tuple[int, str]:
        env = {**pg_mlflow.env, "MLFLOW_TRACKING_USERNAME": f"{role}-{unique_name}",
               "MLFLOW_TRACKING_PASSWORD": passwords[role]}
        result = CliRunner().invoke(promote_cli, ["--config", str(config_path), model, "--version", str(version),
                                                  "--to", "production", "--json"], env=env)
        return result.exit_code, result.stdout + result.stderr

    code, output = promote_as("reader")
    assert code == 8 and f"reader-{unique_name}" in output and "nothing was changed" in output, output
    assert "production" not in client.get_registered_model(model).aliases
    assert not [key for key in client.get_registered_model(model).tags if key.startswith("rlops.move.")]
    assert read_manifest(stack, config, model) is None
    assert folder_objects(stack, config, f"{model}-v{version}") == {}  # nothing copied

    code, output = promote_as("editor")
    assert code == 0, output
    assert client.get_model_version_by_alias(model, "production").version == str(version)
    history = CliRunner().invoke(promote_cli, ["--config", str(config_path), "history", model, "--json"],
                                 env={**pg_mlflow.env, "MLFLOW_TRACKING_USERNAME": ADMIN,
                                      "MLFLOW_TRACKING_PASSWORD": pg_mlflow.admin_password})
    assert [e["actor"] for e in json.loads(history.stdout)] == [f"editor-{unique_name}"], history.output
