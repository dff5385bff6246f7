"""Shared test harness: one real stack (MLflow server + SeaweedFS) per session on free ports, a loopback
TCP proxy that can cut and restore a connection to it, and per-test isolation (experiment, registered
model, S3 prefix). Under CI=true a skipped test counts as a failure: missing infrastructure must fail.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from rlops import stack as rlops_stack
from rlops.config import RAY_TOKEN_FILE, Config, load_config, s3_environment
from rlops.processes import ProcessError, free_port, wait_healthy
from rlops.processes import stop as stop_process

REPO = Path(__file__).resolve().parents[1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI", "").lower() == "true" and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI=true (missing infrastructure must fail, not skip): {reason}"


@pytest.fixture(autouse=True)
def _environ_as_before():
    """Each test leaves os.environ as it found it. Code run in-process sets variables that every later
    subprocess would inherit: importing TRL sets VLLM_LOGGING_LEVEL=ERROR (the cluster's vLLM engines then
    logged no INFO line in a full run), MLflow's fluent API MLFLOW_EXPERIMENT_ID, the trace writer its
    retry settings. Session fixtures are set up before this snapshot, so what they set stays."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_addoption(parser):
    parser.addoption("--shuffle-seed", type=int, default=None,
                     help="Run the tests in an order shuffled by this seed (`make test-shuffled`): order must not matter.")


def pytest_collection_modifyitems(config, items):
    """Modules in a shuffled order, and the tests of each module shuffled (as pytest-randomly does), so a
    module-scoped fixture (a PostgreSQL server, a cluster) still starts once."""
    seed = config.getoption("--shuffle-seed")
    if seed is None:
        return
    rng = random.Random(seed)
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(modules.values())
    rng.shuffle(order)
    for tests in order:
        rng.shuffle(tests)
    items[:] = [item for tests in order for item in tests]


def pytest_report_header(config):
    seed = config.getoption("--shuffle-seed")
    return f"test order shuffled with --shuffle-seed={seed}" if seed is not None else None


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process with pytest's own status once it is done: after a full run (Ray, vLLM, torch and
    their threads loaded in this process) the interpreter's finalisation segfaulted (exit 139 after
    "295 passed"), and a clean run must not read as a failure."""
    status = getattr(config, "_rlops_exitstatus", None)
    if status is None:  # no session ran (a usage error): pytest's own exit path
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(status))


def pytest_sessionfinish(session, exitstatus):
    session.config._rlops_exitstatus = exitstatus


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class StackHandle:
    """The session's running stack. `env` is what a subprocess (CLI, trainer) needs to reach it."""

    config: Config
    config_path: Path

    @property
    def tracking_uri(self) -> str:
        return self.config.tracking_uri

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(s3_environment(self.config))
        env["RLOPS_CONFIG"] = str(self.config_path)
        env["MLFLOW_TRACKING_URI"] = self.tracking_uri
        return env

    def s3(self):
        return rlops_stack.s3_client(self.config, timeout_s=10)


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> StackHandle:
    """The real embedded stack, started once for the whole test session."""
    root = tmp_path_factory.mktemp("stack")
    data = {
        "data_dir": str(root / "data"),
        "server": {"port": free_port()},
        "storage": {"endpoint_url": f"http://127.0.0.1:{rlops_stack.free_s3_port()}", "bucket": "rlops-test"},
    }
    path = write_config(root / "mlflow.yaml", data)
    config = load_config(path, environ={})
    rlops_stack.up(config, timeout_s=240)  # MLflow takes > 90 s to start on a loaded 2-core machine
    handle = StackHandle(config, path)
    yield handle
    rlops_stack.down(config)


@dataclass
class RayClusterHandle:
    """The session's local Ray cluster (`rlops up` with ray.nodes = 2) beside the session stack. `secrets`
    are values its nodes hold in their env (as the cluster's Secret refs do), which Ray must never show."""

    config: Config
    config_path: Path
    secrets: dict[str, str]

    @property
    def env(self) -> dict[str, str]:
        """A client shell: this config, no credentials (train_job.sh reads the cluster env from the config)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RLOPS_", "MLFLOW_", "AWS_", "RAY_"))}
        env.update(RLOPS_CONFIG=str(self.config_path), PYTHON=str(Path(sys.executable)),
                   PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        return env

    def job_client(self):
        from ray.job_submission import JobSubmissionClient

        # The token as a header: Ray keeps the auth mode and token this process first loaded (the session's
        # serving tests ran their own Ray), so the env alone does not reach an already-initialised client.
        token = (self.config.data_path / RAY_TOKEN_FILE).read_text().strip()
        return JobSubmissionClient(self.config.ray_dashboard_url, headers={"authorization": f"Bearer {token}"})


def ray_records(client, temp_dir: Path) -> dict[str, str]:
    """Everything a Ray cluster shows or keeps: each job's info and logs from the job API, and every file of
    its session dir (logs, runtime_env records, job tables), by where it was found."""
    jobs = client.list_jobs()
    shown = {"job list": json.dumps([j.__dict__ for j in jobs], default=str)}
    # a driver job (a Serve app's, a plain `ray.init`) has no submission id and no logs on the job API: its
    # record is the job list entry above
    for job in (j for j in jobs if j.submission_id):
        shown[f"job info {job.submission_id}"] = json.dumps(client.get_job_info(job.submission_id).__dict__, default=str)
        shown[f"job logs {job.submission_id}"] = client.get_job_logs(job.submission_id)
    for path in Path(temp_dir).rglob("*"):
        if path.is_file() and not path.is_symlink() and path.suffix not in {".sock", ".so"}:
            try:
                shown[str(path.relative_to(temp_dir))] = path.read_bytes().decode("utf-8", "replace")
            except OSError:
                continue
    return shown


def llm_replica_logs(temp_dir: Path) -> dict[str, str]:
    """Each LLM replica's own Serve log under a Ray temp dir (one file per replica, on whichever node it runs)."""
    return {str(path.resolve()): path.read_text(errors="replace")
            for path in Path(temp_dir).glob("session_*/logs/serve/replica_rlops_PreloadingLLMServer*.log")}


def preload_lines(temp_dir: Path, model_id: str) -> list[str]:
    """What the LLM replicas logged about preloading `model_id`: the message of a failed wait for it."""
    quoted = json.dumps(model_id)
    return [line for text in llm_replica_logs(temp_dir).values() for line in text.splitlines()
            if "preload" in line and (model_id in line or quoted in line)]


def niceness(process: psutil.Process) -> set[int]:
    """The niceness of a process and of its descendants still alive."""
    found = set()
    for p in [process, *process.children(recursive=True)]:
        try:
            found.add(p.nice())
        except psutil.NoSuchProcess:
            pass
    return found


def wait_preloaded(temp_dir: Path, model_id: str, replicas: int, timeout_s: float) -> float:
    """Wait until `replicas` LLM replicas have logged `model_id` preloaded; a timeout fails with what they
    logged about it."""
    quoted = json.dumps(model_id)

    def held() -> bool:
        return sum(any('"adapter_preloaded"' in line and quoted in line for line in text.splitlines())
                   for text in llm_replica_logs(temp_dir).values()) == replicas

    try:
        return wait_healthy(None, held, timeout_s=timeout_s, what=f"{model_id} preloaded on {replicas} LLM replica(s)")
    except ProcessError as exc:
        raise AssertionError("\n".join([str(exc), *preload_lines(temp_dir, model_id)])) from None


@pytest.fixture(scope="module")
def ray_cluster(stack: StackHandle, tmp_path_factory) -> RayClusterHandle:
    """A 2-node local Ray cluster (head + 1 worker raylet, 2 CPUs and 2 logical GPUs each: slots for a SkyRL
    dry run's bundles) started by the stack supervisor, with the secrets in its nodes' environment; its nodes
    are stopped after the module (an idle cluster would take CPU from every later test)."""
    root = tmp_path_factory.mktemp("ray")
    data = yaml.safe_load(stack.config_path.read_text())
    data["ray"] = {"nodes": 2, "cpus_per_node": 2, "gpus_per_node": 2, "port": free_port(), "dashboard_port": free_port()}
    path = write_config(root / "mlflow.yaml", data)
    config = load_config(path, environ={})
    secrets = {"AWS_SECRET_ACCESS_KEY": s3_environment(config)["AWS_SECRET_ACCESS_KEY"],
               "MLFLOW_TRACKING_PASSWORD": f"mlflow-pw-{uuid.uuid4().hex}",
               "RLOPS_HOOKS__SECRET": f"hooks-secret-{uuid.uuid4().hex}",
               "WANDB_API_KEY": f"wandb-key-{uuid.uuid4().hex}"}  # SkyRL copies this one into its ray.init
    started = time.monotonic()
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("MLFLOW_TRACKING_USERNAME", "trainer")
            for name, value in secrets.items():
                env.setenv(name, value)
            rlops_stack.up(config, timeout_s=300)
        print(f"ray cluster of 2 nodes up in {time.monotonic() - started:.0f} s")
        secrets["ray token"] = (config.data_path / RAY_TOKEN_FILE).read_text().strip()
        yield RayClusterHandle(config, path, secrets)
    finally:
        for name in reversed(rlops_stack.ray_node_names(config)):
            stop_process(config.data_path, name)
        shutil.rmtree(rlops_stack.ray_temp_dir(config), ignore_errors=True)  # Ray's session logs of this run


@pytest.fixture
def unique_name(request) -> str:
    """A short name unique to this test, valid as experiment, registered model and S3 prefix."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    return f"{base}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def test_config(stack: StackHandle, unique_name: str) -> Config:
    """The stack's config with this test's own experiment, registered model and adapter prefix."""
    cfg = stack.config.model_copy(deep=True)
    cfg.tracking.experiment = f"exp-{unique_name}"
    cfg.registry.models = [f"model-{unique_name}"]
    cfg.serving.dynamic_lora_loading_path = f"s3://{cfg.storage.bucket}/lora-{unique_name}"
    return cfg


@pytest.fixture
def mlflow_client(stack: StackHandle):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=stack.tracking_uri, registry_uri=stack.tracking_uri)


# -------------------------------------------------------------------------------------- loopback TCP proxy


class LoopbackProxy:
    """Forwards 127.0.0.1:<port> to a target; `cut()` drops live connections and refuses new ones until
    `restore()` (an outage as seen by the client, while the real server keeps running for other tests)."""

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept_loop, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            for conn in list(self._conns):
                _close(conn)
            self._conns.clear()

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        _close(self._listener)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                _close(client)  # RST: the client sees the connection refused/reset
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns.update({client, upstream})
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)
                with self._lock:
                    self._conns.discard(sock)


def _close(sock: socket.socket) -> None:
    # shutdown() wakes a thread blocked in recv() on this socket; close() alone does not.
    for end in (lambda: sock.shutdown(socket.SHUT_RDWR), sock.close):
        try:
            end()
        except OSError:
            pass


@pytest.fixture
def tcp_proxy():
    """Factory: `tcp_proxy(port)` -> a LoopbackProxy to 127.0.0.1:port, closed after the test."""
    proxies: list[LoopbackProxy] = []

    def make(target_port: int, target_host: str = "127.0.0.1") -> LoopbackProxy:
        proxy = LoopbackProxy(target_host, target_port)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()


@pytest.fixture
def mlflow_proxy(stack: StackHandle, tcp_proxy) -> LoopbackProxy:
    """A cuttable connection to the session's MLflow server."""
    return tcp_proxy(stack.config.server.port)


# ------------------------------------------------------------------------------------ adapters on the tiny VLM
# (the served tests' base: training.tiny_vlm)

TEXT_PROMPT = "navigate the maze to the red square"
LORA_TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def maze_image():
    from PIL import Image

    from tasks.maze.env import generate_maze, render

    return Image.fromarray(render(generate_maze(seed=3, size=9)))


def offline_inputs(processor, with_image: bool):
    """The same conversation built directly with the processor (independent of the engine's code)."""
    content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": TEXT_PROMPT}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                           add_generation_prompt=True)
    return processor(text=[prompt], images=[maze_image()] if with_image else None, return_tensors="pt")


def train_adapter(base_dir: Path, out: Path, target: str, seed: int, steps: int = 15) -> Path:
    """A few Adam steps of LoRA on the tiny base towards `target`, on a text and an image prompt."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(str(base_dir))
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(str(base_dir)),
                           LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    batches = []
    for with_image in (False, True):
        prompt_inputs = offline_inputs(processor, with_image)
        answer = processor.tokenizer([target + "<|im_end|>"], return_tensors="pt", add_special_tokens=False)
        inputs = dict(prompt_inputs)
        inputs["input_ids"] = torch.cat([prompt_inputs["input_ids"], answer["input_ids"]], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" in inputs:
            inputs["mm_token_type_ids"] = torch.cat(
                [prompt_inputs["mm_token_type_ids"], torch.zeros_like(answer["input_ids"])], dim=1)
        labels = inputs["input_ids"].clone()
        labels[:, : prompt_inputs["input_ids"].shape[1]] = -100
        batches.append((inputs, labels))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(steps):
        for inputs, labels in batches:
            model(**inputs, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # peft's model card: not an adapter file
    return out


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def register_adapter(config: Config, adapter_dir: Path, step: int) -> int:
    """Log the adapter as the tracker does (LoggedModel + rlops tags) and register it; return the version."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(config.tracking.experiment)
    run = client.create_run(experiment_id)
    tags = {"rlops.step": str(step), "rlops.base_model": config.base_model_source, "rlops.lora_rank": "8",
            **{f"rlops.sha256.{p.name}": sha256_file(p) for p in adapter_dir.iterdir() if p.is_file()}}
    logged = client.create_logged_model(experiment_id, name=f"lora-step-{step}", source_run_id=run.info.run_id,
                                        tags=tags, model_type="lora-adapter")
    client.log_model_artifacts(logged.model_id, str(adapter_dir))
    client.finalize_logged_model(logged.model_id, "READY")
    client.set_terminated(run.info.run_id)
    mlflow.set_tracking_uri(config.tracking_uri)
    mlflow.set_registry_uri(config.tracking_uri)
    version = mlflow.register_model(f"models:/{logged.model_id}", config.registry.models[0],
                                    tags={"rlops.step": str(step), "rlops.run_id": run.info.run_id})
    return int(version.version)
