"""Shared test harness: one real stack (MLflow server + SeaweedFS) per session on free ports, a loopback
TCP proxy that can cut and restore a connection to it, and per-test isolation (experiment, registered
model, S3 prefix). Under CI=true a skipped test counts as a failure: missing infrastructure must fail.
"""
from __future__ import annotations

import os
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from rlops import stack as rlops_stack
from rlops.config import Config, load_config, s3_environment
from rlops.processes import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI", "").lower() == "true" and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI=true (missing infrastructure must fail, not skip): {reason}"


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
