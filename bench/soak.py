"""The whole system under faults: a seeded soak with invariants checked on its recorded history (issue 34).

On a scratch stack (MLflow + S3) with a 2-node local Ray cluster (`rlops up`, ray.nodes 2, 2 CPUs each), all at
once for `--minutes`:
- the alias app (2 ingress + 2 LLM replicas, Ray Serve LLM with the echo engine of bench/echo_engine.py: the
  engine costs nothing, the ingress, routes and replicas are the real ones), with bounded client load: `--clients`
  threads, each request from one of 40 sticky OpenAI `user`s to `<base>:<model>` (production);
- `rlops hooks serve` (webhook receiver + reconciler every 5 s), its S3 traffic through a stall proxy;
- training through the tracker: bench/tracker_chaos.py's trainer (20 metrics per 0.1 s step, a checkpoint and an
  eval every 100 steps, restarted on the same run dir when it dies), its MLflow traffic through a stall proxy;
- a promotion programme every 2-5 s: register a version (a real peft adapter of the tiny VLM), promote it,
  move staging with a plain MLflow client (the webhook path), start / promote / abort a canary, roll back, gc.
Faults, each `--fault-every` s (on average) after the one before has converged, kinds in a seeded order (every
kind once per shuffled round, a node kill only every `--node-kill-rounds` rounds): SIGKILL and SIGSTOP of the
MLflow server, the S3 server, the hooks service and one Serve replica; SIGKILL of the Ray worker node (raylet and
its workers); a stall of either proxy; SIGKILL of the trainer; the tracker's disk full (a 16 MiB tmpfs, root
only). A SIGSTOP, a stall or a full disk lasts `--hold` s.
A killed part is started again the way an operator would (`rlops up` for the stack and the node, the same
command for the hooks service and the trainer; Serve replaces its own replicas). `--nodes 1` (one raylet with
4 CPUs, no node kill) is the suite's short variant (tests/test_soak.py).

Everything lands in one history (answers, manifest intents seen in S3, folder checks, operations, faults,
recoveries, convergence), checked afterwards by `check()`; the checker names the first violation. Invariants:
every answer's version is one the routes intent allowed within the staleness bound of its request (longer only
while the ingress cannot read S3); no user's version changes without an intent change between its two answers (or, next to a fault that keeps the
watcher from reading S3, by the fault's end);
no folder a manifest references is missing; every fault converges within its bound (all parts healthy, both Ray
nodes, every Serve deployment healthy, production answering a version of the current intent, the trainer
stepping); no 5xx outside a fault; no metric point lost, duplicated or wrong; the run FINISHED; the registered
candidate is the best checkpoint; at the end the manifest's production equals the registry's.

Figures (bench/results.json): violations (goal 0) against the faults injected; convergence p50/max against its
bound; availability during serving faults against availability outside faults.

Usage: python bench/soak.py [--minutes 20] [--faults N] [--seed 1] [--fault-every 10] [--hold 3] [--nodes 2]
       [--clients 4] [--node-kill-rounds 1] [--kinds a,b,...] [--history PATH] [--no-record]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))
from _results import record  # noqa: E402
from ingress_overhead import echo_args  # noqa: E402
from tracker_chaos import Chaos, fill_disk, mount_tmpfs  # noqa: E402
from tracker_chaos import count as count_points  # noqa: E402
from vllm_lora import MODEL, write_adapters  # noqa: E402

from registry_hooks import storage  # noqa: E402
from rlops import processes, stack  # noqa: E402
from rlops.config import Config, load_config, ray_client_env  # noqa: E402
from rlops.layout import ADAPTER_CONFIG, RoutesManifest, parse_s3_uri  # noqa: E402

USERS = [f"soak-user-{i:02d}" for i in range(40)]
# A raylet's restart imports Ray's agents, a replacement replica vLLM's modules: minutes on 2 loaded cores.
CONVERGE_BOUND_S = {"node_kill": 240.0, "replica_kill": 120.0}
DEFAULT_BOUND_S = 60.0
WATCH_S = 0.25  # the manifest watcher's period
# A checkpoint every 100 steps of 0.1 s: at tracker_chaos's 10, a checkpoint a second, uploads fell behind on 2
# loaded cores and the backlog filled the trainer's 16 MiB disk within 20 minutes (a real run saves every minutes).
CKPT_EVERY = 100
# Kinds that keep the ingress from reading the routes (its staleness bound cannot hold while they last).
ROUTES_BLIND = {"s3_kill", "s3_stop"}
SERVING_FAULTS = {"replica_kill", "replica_stop", "node_kill", "s3_kill", "s3_stop"}
KINDS = ["mlflow_kill", "mlflow_stop", "s3_kill", "s3_stop", "hooks_kill", "hooks_stop", "replica_kill",
         "replica_stop", "node_kill", "stall_tracker", "stall_hooks", "trainer_kill", "disk_full"]


# ------------------------------------------------------------------------------------------- history


class History:
    """Append-only, thread-safe list of events, each {"t": seconds since start, "kind": ..., ...}."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self.started = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.started

    def add(self, kind: str, **fields) -> dict:
        event = {"t": round(self.now(), 4), "kind": kind, **fields}
        with self._lock:
            self.events.append(event)
        return event

    def dump(self, path: Path) -> None:
        with self._lock:
            path.write_text("".join(json.dumps(e) + "\n" for e in self.events))


# ------------------------------------------------------------------------------------------- checker


def _windows(events: list[dict], kinds: set[str] | None = None) -> list[tuple[float, float, str]]:
    """(start, end, kind) of each fault from its injection to its convergence (or the end of the history)."""
    end_of = {e["fault_id"]: e["t"] for e in events if e["kind"] == "converged"}
    last = max((e["t"] for e in events), default=0.0)
    return [(e["t"], end_of.get(e["fault_id"], last), e["fault"]) for e in events
            if e["kind"] == "fault" and (kinds is None or e["fault"] in kinds)]


def _intents(events: list[dict]) -> list[tuple[float, float, frozenset]]:
    """(seen, until, allowed versions) of each routes intent the watcher saw, in order."""
    seen = sorted((e["t"], frozenset(e["allowed"])) for e in events if e["kind"] == "intent")
    ends = [t for t, _ in seen[1:]] + [float("inf")]
    return [(t, end, allowed) for (t, allowed), end in zip(seen, ends)]


def check(events: list[dict], staleness_s: float, slack_s: float = 0.5) -> tuple[list[str], dict]:
    """(violations in time order, figures) of a soak's history. An answer may carry any version allowed by an
    intent seen in [sent - staleness - slack, received + slack]; while a routes-blind fault lasts (and
    staleness after it) the window starts before that fault. `slack` covers the watcher's own lag."""
    violations: list[tuple[float, str]] = []
    intents = _intents(events)
    blind = _windows(events, ROUTES_BLIND)
    faults = _windows(events)
    bound = staleness_s + slack_s

    def blind_around(t: float) -> list[tuple[float, float]]:
        """The routes-blind faults whose window (widened by the bound on both sides) holds `t`."""
        return [(b0, b1) for b0, b1, _ in blind if b0 - bound <= t <= b1 + bound]

    def window(sent: float, received: float) -> tuple[float, float]:
        return min([sent - bound] + [b0 - bound for b0, _ in blind_around(sent)]), received + slack_s

    def allowed(start: float, end: float) -> set:
        return set().union(*[a for seen, until, a in intents if seen <= end and until >= start]) if intents else set()

    def watched_until(end: float) -> float:
        # A move published just before a routes-blind fault can reach the ingress and not the watcher, which
        # sees it once S3 is back: until the fault's end (and the bound), a switch may wait for its intent.
        return max([end] + [b1 + bound for _, b1 in blind_around(end)])

    def intent_changed(start: float, end: float) -> bool:
        return any(start <= seen <= end for seen, _, _ in intents[1:])

    answers = sorted((e for e in events if e["kind"] == "answer"), key=lambda e: e["sent"])
    last_by_user: dict[str, dict] = {}
    causes: Counter = Counter()
    for a in answers:
        if a["status"] != 200:
            cause = "+".join(sorted({k for s, e, k in faults if s <= a["received"] and a["sent"] <= e})) or "none"
            if a["status"] >= 500 or a["status"] == 0:
                causes[cause] += 1
                if cause == "none":
                    violations.append((a["sent"], f"answer at {a['sent']:.2f} s: {a['status']} {a.get('error', '')!r} "
                                                  "with no fault under way"))
            continue
        start, end = window(a["sent"], a["received"])
        ok = allowed(start, end)
        if a["version"] not in ok:
            violations.append((a["sent"], f"answer at {a['sent']:.2f} s (user {a['user']}) is v{a['version']}; the "
                                          f"routes intent allowed {sorted(ok)} between {start:.2f} and {end:.2f} s"))
        before = last_by_user.get(a["user"])
        if before is not None and before["version"] != a["version"]:
            # the two may overlap (one user, several clients): the move may come until the later one returned
            start = window(before["sent"], before["received"])[0]
            if not intent_changed(start, watched_until(max(before["received"], a["received"]) + slack_s)):
                violations.append((a["sent"], f"user {a['user']} switched v{before['version']} -> v{a['version']} "
                                              f"between {before['sent']:.2f} and {a['sent']:.2f} s without a move"))
        last_by_user[a["user"]] = a
    for e in events:
        if e["kind"] == "folder_missing":
            violations.append((e["t"], f"folder {e['folder']} was missing at {e['t']:.2f} s while the manifest "
                                       f"(generation {e['generation']}) referenced it"))
        elif e["kind"] == "not_converged":
            violations.append((e["t"], f"{e['fault']} (fault {e['fault_id']}) did not converge within "
                                       f"{e['bound_s']:.0f} s: {e['waiting_for']}"))
        elif e["kind"] == "end_state" and e["problems"]:
            violations += [(e["t"], f"end state: {p}") for p in e["problems"]]
    converged = [e for e in events if e["kind"] == "converged"]
    converge = [e["seconds"] for e in converged]
    worst = max(converged, key=lambda e: e["seconds"] / e.get("bound_s", 1), default=None)
    def during(a: dict, windows: list) -> bool:  # in flight at any moment of one of the windows
        return any(s <= a["received"] and a["sent"] <= e for s, e, _ in windows)

    serving_faults = _windows(events, SERVING_FAULTS)
    in_serving = [a for a in answers if during(a, serving_faults)]
    outside = [a for a in answers if not during(a, faults)]
    figures = {
        "faults": dict(Counter(e["fault"] for e in events if e["kind"] == "fault")),
        "requests": len(answers),
        "availability_serving_faults": _availability(in_serving),
        "availability_outside_faults": _availability(outside),
        "converge_p50_s": statistics.median(converge) if converge else None,
        "converge_max_s": max(converge) if converge else None,
        "converge_worst": {k: worst[k] for k in ("fault", "seconds", "bound_s")} if worst else None,
        "converge_by_kind": {kind: max(e["seconds"] for e in converged if e["fault"] == kind)
                             for kind in sorted({e["fault"] for e in converged})},
        "errors_by_cause": dict(causes),
        "operations": dict(Counter(f"{e['op']}:{e['outcome']}" for e in events if e["kind"] == "op")),
        "intents": len(intents),
    }
    return [message for _, message in sorted(violations, key=lambda v: v[0])], figures


def _availability(answers: list[dict]) -> float | None:
    return sum(a["status"] == 200 for a in answers) / len(answers) if answers else None


# ------------------------------------------------------------------------------------------- the parts


class StallProxy:
    """127.0.0.1:<port> -> 127.0.0.1:target; `stall(s)` holds every byte both ways for s seconds (connections stay
    open, as on a congested or partitioned link), then lets them through."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self, seconds: float) -> None:
        self._open.clear()
        time.sleep(seconds)
        self._open.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:  # the target is down: the client sees its connection closed, as without the proxy
                client.close()
                continue
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                self._open.wait()
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


class Soak:
    def __init__(self, config: Config, root: Path, history: History, rng: random.Random, args):
        self.config, self.root, self.history, self.rng, self.args = config, root, history, rng, args
        self.location = parse_s3_uri(config.lora_path)
        self.url = f"http://127.0.0.1:{config.serving.port}"
        self.name = f"{config.serving.base_model_id}:{MODEL}"
        self.stop = threading.Event()
        self.allowed: frozenset = frozenset()
        self.manifest: RoutesManifest | None = None
        self.versions: list[int] = []
        self.tracker_proxy = StallProxy(config.server.port)
        self.hooks_proxy = StallProxy(int(config.storage.endpoint_url.rsplit(":", 1)[1]))
        self.tmpfs = mount_tmpfs(root / "tmpfs") if "disk_full" in args.kinds else None
        # the trainer, restarted on its run dir whenever it dies, as in bench/tracker_chaos.py
        self.training = Chaos(config, root / "trainer.json", root, self.tmpfs, ckpt_every=CKPT_EVERY)
        self.secret = secrets.token_urlsafe(32)

    # -- parts

    def mlflow(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.config.tracking_uri, registry_uri=self.config.tracking_uri)

    def start_hooks(self) -> None:
        env = {**os.environ, **self.args.environ, "RLOPS_HOOKS__SECRET": self.secret,
               "RLOPS_STORAGE__ENDPOINT_URL": f"http://127.0.0.1:{self.hooks_proxy.port}"}
        processes.start(self.config.data_path, "hooks", [sys.executable, "-m", "rlops", "hooks", "serve"], env,
                        cwd=self.root)

    def hooks_ok(self) -> bool:
        return stack.http_ok(f"http://127.0.0.1:{self.config.hooks.port}/healthz")

    def start(self) -> None:
        from registry_hooks import operations
        from registry_hooks.subscriptions import register_webhook
        from serving.app import APP_NAME
        from training.tiny_vlm import build_tiny_vlm
        from vllm_lora import register

        base = build_tiny_vlm(self.root / "base")
        self.adapters = write_adapters(base, self.root)
        self.config.serving.model_source = str(base)
        self.args.environ["RLOPS_SERVING__MODEL_SOURCE"] = str(base)
        stack.up(self.config, timeout_s=300)
        self.s3 = stack.s3_client(self.config, timeout_s=2)
        trainer_config = self.config.model_copy(deep=True)
        trainer_config.server.port = self.tracker_proxy.port
        trainer_config.tracking.registered_model = "soak-train"
        self.training.config_path.write_text(json.dumps(trainer_config.model_dump(mode="json")))
        self.training.start_trainer()
        self.start_hooks()
        self.app_name = APP_NAME
        deployed: list[BaseException] = []
        deploy = threading.Thread(target=self.deploy, args=(deployed,))  # Serve's replicas start meanwhile
        deploy.start()
        import mlflow

        mlflow.set_tracking_uri(self.config.tracking_uri)
        mlflow.set_registry_uri(self.config.tracking_uri)
        client = self.mlflow()
        self.register = lambda: register(self.config, client, self.rng.choice(self.adapters))
        self.versions = [self.register() for _ in range(3)]
        operations.promote(self.config, MODEL, to_alias="production", version=self.versions[0], trigger="soak")
        processes.wait_healthy(None, self.hooks_ok, 120, "hooks service")
        register_webhook(self.config.model_copy(update={"hooks": self.config.hooks.model_copy(
            update={"secret": self.secret})}))
        deploy.join()
        if deployed:
            raise deployed[0]

    def deploy(self, failed: list[BaseException]) -> None:
        """The alias app on the echo engine, on the cluster `rlops up` started."""
        try:
            os.environ.update(ray_client_env(self.config))
            import ray
            from ray import serve
            from ray.serve.llm import build_openai_app

            ray.init(address=self.config.ray_address, logging_level="WARNING", log_to_driver=False)
            serve.start(http_options={"host": "127.0.0.1", "port": self.config.serving.port},
                        proxy_location="HeadOnly")
            serve.run(build_openai_app(echo_args(self.config)), name=self.app_name, route_prefix="/")
        except BaseException as exc:  # noqa: BLE001 - raised again in start()
            failed.append(exc)

    # -- the loops

    def watch(self) -> None:
        """Record every change of production's allowed versions, and check each folder the manifest references."""
        from botocore.exceptions import BotoCoreError, ClientError

        while not self.stop.is_set():
            try:
                manifest = self.read_manifest()
                allowed = {manifest.aliases["production"].version} if "production" in manifest.aliases else set()
                if "production" in manifest.canaries:
                    allowed.add(manifest.canaries["production"].version)
                if frozenset(allowed) != self.allowed:
                    self.allowed = frozenset(allowed)
                    self.history.add("intent", allowed=sorted(allowed), generation=manifest.generation)
                self.manifest = manifest
                for folder in self.folders(manifest):
                    if not self.exists(folder) and folder in self.folders(self.read_manifest()):
                        self.history.add("folder_missing", folder=folder, generation=manifest.generation)
            except (BotoCoreError, ClientError, OSError):
                pass  # S3 down: the ingress cannot see a change either
            time.sleep(WATCH_S)

    def read_manifest(self) -> RoutesManifest:
        return storage.read_manifest(self.s3, self.location, MODEL)[0]

    @staticmethod
    def folders(manifest: RoutesManifest) -> set[str]:
        routes = [*manifest.aliases.values(), *manifest.canaries.values(), *manifest.shadows.values()]
        return {r.folder for r in routes}

    def exists(self, folder: str) -> bool:
        """Complete, as `Promoter.folder_complete` tells it: adapter_config.json is copied last."""
        return ADAPTER_CONFIG in storage.list_folder(self.s3, self.location.bucket, self.location.key(folder))

    def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        with httpx.Client(timeout=15) as http:
            while not self.stop.is_set():
                user = rng.choice(USERS)
                sent = self.history.now()
                try:
                    r = http.post(f"{self.url}/v1/chat/completions", json={
                        "model": self.name, "user": user, "max_tokens": 2,
                        "messages": [{"role": "user", "content": "soak"}]})
                    status, version = r.status_code, r.headers.get("x-rlops-model-version")
                    error = "" if status == 200 else r.text[:200]
                except httpx.HTTPError as exc:
                    status, version, error = 0, None, type(exc).__name__
                self.history.add("answer", sent=sent, received=self.history.now(), user=user, status=status,
                                 version=int(version) if version else None, error=error)
                time.sleep(0.05)

    def programme(self) -> None:
        """A promotion operation every 2-5 s, seeded; failures during faults are expected and recorded."""
        from registry_hooks import operations

        rng = random.Random(self.args.seed + 1)
        while not self.stop.wait(rng.uniform(2, 5)):
            production = self.manifest.aliases["production"].version if self.manifest else None
            in_canary = self.manifest is not None and "production" in self.manifest.canaries
            op = rng.choice(["canary_promote", "canary_abort", "promote"] if in_canary else
                            ["register", "promote", "promote", "stage", "canary", "rollback", "gc"])
            others = [v for v in self.versions if v != production] or self.versions
            version = rng.choice(others)
            started = self.history.now()
            try:
                if op == "register":
                    self.versions.append(self.register())
                    detail = f"v{self.versions[-1]}"
                elif op == "promote":
                    operations.promote(self.config, MODEL, to_alias="production", version=version, trigger="soak")
                    detail = f"v{version}"
                elif op == "stage":  # the webhook path: a plain MLflow client moves the alias
                    self.mlflow().set_registered_model_alias(MODEL, "staging", str(version))
                    detail = f"v{version}"
                elif op == "canary":
                    operations.canary(self.config, MODEL, version=version, weight=30.0, trigger="soak")
                    detail = f"v{version} at 30%"
                elif op in ("canary_promote", "canary_abort"):
                    operations.canary(self.config, MODEL, promote_it=op == "canary_promote",
                                      abort=op == "canary_abort", trigger="soak")
                    detail = ""
                elif op == "rollback":
                    operations.rollback(self.config, MODEL)
                    detail = ""
                else:
                    detail = str(operations.gc(self.config))[:200]
                outcome = "ok"
            except Exception as exc:  # noqa: BLE001 - a refused or failed operation is part of the programme
                outcome, detail = type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else ""
            self.history.add("op", op=op, outcome=outcome, detail=detail, started=started)

    # -- faults

    def pgid(self, name: str) -> int:
        return processes.read_record(self.config.data_path, name).pid  # its own session: pgid = pid

    def replica_pid(self, rng: random.Random) -> int:
        from ray.util.state import list_actors

        actors = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                  if a.class_name.startswith(f"ServeReplica:{self.app_name}:")]
        return rng.choice(sorted(actors, key=lambda a: a.actor_id)).pid

    def inject(self, fault: str, rng: random.Random) -> str:
        """Inject `fault` and undo it (restart, SIGCONT, unstall); returns what was hit."""
        if fault in ("mlflow_kill", "s3_kill", "hooks_kill", "node_kill"):
            name = {"mlflow_kill": stack.MLFLOW, "s3_kill": stack.S3, "hooks_kill": "hooks",
                    "node_kill": stack.ray_node_names(self.config)[-1]}[fault]
            os.killpg(self.pgid(name), signal.SIGKILL)
            time.sleep(1.0)
            deadline = time.monotonic() + 60
            while fault == "node_kill" and stack.ray_alive_nodes(self.config) >= self.config.ray.nodes \
                    and time.monotonic() < deadline:  # the restart must not count the dead node as alive
                time.sleep(0.5)
            if fault == "hooks_kill":
                self.start_hooks()
            else:
                stack.up(self.config, timeout_s=CONVERGE_BOUND_S.get(fault, DEFAULT_BOUND_S) + 60)
            return name
        if fault in ("mlflow_stop", "s3_stop", "hooks_stop"):
            name = {"mlflow_stop": stack.MLFLOW, "s3_stop": stack.S3, "hooks_stop": "hooks"}[fault]
            pgid = self.pgid(name)
            os.killpg(pgid, signal.SIGSTOP)
            time.sleep(self.args.hold)
            os.killpg(pgid, signal.SIGCONT)
            return name
        if fault in ("replica_kill", "replica_stop"):
            pid = self.replica_pid(rng)
            if fault == "replica_kill":
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while not self.serve_unwhole() and time.monotonic() < deadline:  # until Serve has noticed
                    time.sleep(0.2)
            else:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(self.args.hold)
                os.kill(pid, signal.SIGCONT)
            return f"pid {pid}"
        if fault.startswith("stall_"):
            (self.tracker_proxy if fault == "stall_tracker" else self.hooks_proxy).stall(self.args.hold)
            return fault.removeprefix("stall_")
        if fault == "trainer_kill":
            self.training.inject(fault)
            return "trainer"
        fill_disk(self.tmpfs, self.args.hold, time.sleep)  # disk_full
        return str(self.tmpfs)

    def serve_unwhole(self) -> str:
        """'' when every deployment is healthy with all its replicas running, else what is not."""
        from ray import serve

        try:
            app = serve.status().applications[self.app_name]
        except Exception as exc:  # noqa: BLE001 - the controller busy or restarting counts as not whole
            return f"status ({type(exc).__name__})"
        for name, deployment in app.deployments.items():
            want = self.config.serving.min_replicas if name.startswith("PreloadingLLMServer") \
                else self.config.serving.ingress_replicas
            states = {str(k).rsplit(".", 1)[-1]: n for k, n in deployment.replica_states.items() if n}
            status = str(deployment.status).rsplit(".", 1)[-1]
            if status != "HEALTHY" or set(states) != {"RUNNING"} or states["RUNNING"] < want:
                return f"{name} {status} {states}"
        return ""

    def waiting_for(self, steps_before: int) -> list[str]:
        """What is not yet back to normal (empty: converged)."""
        missing = []
        if not stack.mlflow_healthy(self.config.tracking_uri):
            missing.append("MLflow")
        if not stack.s3_healthy(self.config):
            missing.append("S3")
        if not self.hooks_ok():
            missing.append("hooks")
        if stack.ray_alive_nodes(self.config) < self.config.ray.nodes:
            missing.append("Ray nodes")
        unwhole = self.serve_unwhole()
        if unwhole:
            missing.append(f"Serve {unwhole}")
        try:
            r = httpx.post(f"{self.url}/v1/chat/completions", timeout=5, json={
                "model": self.name, "max_tokens": 1, "messages": [{"role": "user", "content": "probe"}]})
            if r.status_code != 200 or int(r.headers.get("x-rlops-model-version", 0)) not in self.allowed:
                missing.append(f"production answer ({r.status_code}, v{r.headers.get('x-rlops-model-version')})")
        except httpx.HTTPError as exc:
            missing.append(f"production answer ({type(exc).__name__})")
        self.training.keep_trainer_running()
        if self.training.steps_logged() <= steps_before:
            missing.append("training steps")
        return missing

    def fault(self, fault_id: int, fault: str, rng: random.Random) -> None:
        injected = self.history.add("fault", fault_id=fault_id, fault=fault)
        try:
            target = self.inject(fault, rng)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is recorded, not hidden
            self.history.add("inject_failed", fault_id=fault_id, fault=fault, error=f"{type(exc).__name__}: {exc}")
            target = None
        self.history.add("recovered", fault_id=fault_id, fault=fault, target=target)
        steps, bound = self.training.steps_logged(), CONVERGE_BOUND_S.get(fault, DEFAULT_BOUND_S)
        waited: dict[str, float] = {}  # what was not back yet, and when it last was not
        while True:
            missing = self.waiting_for(steps)
            waited.update({m: round(self.history.now() - injected["t"], 1) for m in missing})
            if not missing:  # timed from the fault itself: a kill's restart is part of its recovery
                self.history.add("converged", fault_id=fault_id, fault=fault, waited=waited, bound_s=bound,
                                 seconds=round(self.history.now() - injected["t"], 3))
                return
            if self.history.now() - injected["t"] > bound:
                self.history.add("not_converged", fault_id=fault_id, fault=fault, bound_s=bound,
                                 waiting_for=missing)
                return
            time.sleep(0.5)

    # -- the end

    def end_state(self) -> list[str]:
        """Stop the trainer at its next checkpoint and check what it left; the manifest's production against
        the registry's once the reconciler has had a pass."""
        from tracker import flush_run_dir

        problems, training = [], self.training
        training.stop_file.write_text("stop")
        deadline = time.monotonic() + 180
        while training.final is None and time.monotonic() < deadline:
            training.wait(0.5)
        if training.final is None:
            return ["the trainer did not finish within 180 s of its stop"]
        counting = load_config(training.config_path, environ={})
        counting.server.port = self.config.server.port
        flush_run_dir(counting, training.run_dir, timeout_s=120)
        counts = count_points(counting, training.run_dir, int(training.final.split()[1]), CKPT_EVERY)
        self.counts = counts
        for what in ("lost", "duplicated", "wrong_values", "wrong_registrations"):
            if counts[what]:
                problems.append(f"{counts[what]} metric points {what.replace('_', ' ')} (of {counts['expected']})"
                                if what != "wrong_registrations" else "the candidate is not the best checkpoint")
        if counts["status"] != "FINISHED":
            problems.append(f"the training run ended {counts['status']}")
        deadline = time.monotonic() + 2 * self.config.hooks.reconcile_interval_s + 10
        while True:
            registry = int(self.mlflow().get_model_version_by_alias(MODEL, "production").version)
            served = self.read_manifest().aliases["production"].version
            if registry == served or time.monotonic() > deadline:
                break
            time.sleep(1)
        if registry != served:
            problems.append(f"the registry's production is v{registry}, the manifest's v{served}")
        return problems


def soak_environ(root: Path, nodes: int, hooks_reconcile_s: float = 5.0) -> dict[str, str]:
    """The scratch stack's settings: free ports, 2 + 2 replicas on 4 logical CPUs split over `nodes` raylets."""
    return {"RLOPS_DATA_DIR": str(root / "data"), "RLOPS_SERVER__PORT": str(processes.free_port()),
            "RLOPS_STORAGE__ENDPOINT_URL": f"http://127.0.0.1:{stack.free_s3_port()}",
            "RLOPS_STORAGE__BUCKET": "soak", "RLOPS_SERVING__PORT": str(processes.free_port()),
            "RLOPS_SERVING__REPLICA_CPUS": "0.5", "RLOPS_SERVING__MIN_REPLICAS": "2",
            "RLOPS_SERVING__MAX_REPLICAS": "2", "RLOPS_SERVING__INGRESS_REPLICAS": "2",
            "RLOPS_SERVING__TRACES__SAMPLE_RATE": "0", "RLOPS_REGISTRY__MODELS": f"[{MODEL}]",
            "RLOPS_REGISTRY__GUARDED_ALIASES": "[]", "RLOPS_REGISTRY__GC_GRACE_S": "0",
            "RLOPS_REGISTRY__GC_RETENTION_S": "60",
            "RLOPS_RAY__NODES": str(nodes), "RLOPS_RAY__CPUS_PER_NODE": str(4 // nodes), "RLOPS_RAY__PORT": str(processes.free_port()),
            "RLOPS_RAY__DASHBOARD_PORT": str(processes.free_port()),
            "RLOPS_HOOKS__PORT": str(processes.free_port()), "RLOPS_HOOKS__RECONCILE_INTERVAL_S": str(hooks_reconcile_s),
            "RLOPS_TRACKING__EXPERIMENT": "soak", "RLOPS_TRACKING__REQUEST_TIMEOUT_S": "5",
            "RLOPS_TRACKING__RETRY_MAX_BACKOFF_S": "2", "RLOPS_TRACKING__FLUSH_TIMEOUT_S": "30",
            "RLOPS_TRACKING__HEARTBEAT_INTERVAL_S": "5", "RLOPS_TRACKING__SYSTEM_METRICS": "false"}


def run(args) -> tuple[list[str], dict, History]:
    root = Path(tempfile.mkdtemp(prefix="rlops-soak-"))
    args.environ = soak_environ(root, args.nodes)
    config = load_config(environ=args.environ)
    history, rng = History(), random.Random(args.seed)
    soak = Soak(config, root, history, rng, args)
    threads: list[threading.Thread] = []
    try:
        soak.start()
        print(f"stack, cluster, hooks, trainer and app up in {time.monotonic() - history.started:.0f} s", flush=True)
        history.started = time.monotonic()
        threads = [threading.Thread(target=soak.watch, daemon=True), threading.Thread(target=soak.programme, daemon=True)]
        threads += [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        logging.disable(logging.WARNING)  # the parts' retries during faults are expected; the history has the outcome
        kinds = [k for k in args.kinds if (k != "disk_full" or soak.tmpfs) and (k != "node_kill" or args.nodes > 1)]
        order: list[str] = []
        deadline = args.minutes * 60
        fault_id = rounds = 0
        while history.now() < deadline and fault_id < (args.faults or float("inf")):
            time.sleep(rng.uniform(0.5, 1.5) * args.fault_every)
            if history.now() >= deadline:
                break
            if not order:  # a node kill only every --node-kill-rounds rounds: it converges in minutes, not seconds
                this_round = [k for k in kinds if k != "node_kill" or rounds % args.node_kill_rounds == 0]
                order, rounds = rng.sample(this_round, len(this_round)), rounds + 1
            fault_id += 1
            fault = order.pop()
            print(f"[{history.now():7.1f} s] fault {fault_id}: {fault}", flush=True)
            soak.fault(fault_id, fault, rng)
        time.sleep(1.0)  # answers after the last convergence
        soak.stop.set()
        for thread in threads:
            thread.join(timeout=30)
        ending = time.monotonic()
        history.add("end_state", problems=soak.end_state())
        print(f"end state checked in {time.monotonic() - ending:.0f} s", flush=True)
    finally:
        soak.stop.set()
        if soak.training.child is not None and soak.training.child.poll() is None:
            soak.training.child.kill()
        try:
            import ray

            ray.shutdown()  # the app goes with the cluster's nodes below
        finally:
            stack.down(config)
            if soak.tmpfs:
                subprocess.run(["umount", str(soak.tmpfs)], capture_output=True)
            if args.history:
                history.dump(Path(args.history))
            shutil.rmtree(root, ignore_errors=True)
    violations, figures = check(history.events, config.serving.routes_staleness_s)
    figures["points"] = getattr(soak, "counts", {})
    figures["trainer_restarts"] = soak.training.restarts
    figures["minutes"] = max((e["t"] for e in history.events), default=0.0) / 60
    return violations, figures, history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--faults", type=int, help="stop after this many faults (or --minutes, whichever first)")
    parser.add_argument("--nodes", type=int, default=2, choices=(1, 2, 4), help="Ray nodes sharing 4 logical CPUs")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fault-every", type=float, default=10.0, help="mean seconds between faults")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds a SIGSTOP, a stall or a full disk lasts")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--node-kill-rounds", type=int, default=1,
                        help="a node kill in every Nth round of kinds only (it takes 1-3 min to converge on 2 cores)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds")
    parser.add_argument("--history", help="write the history here (JSON lines)")
    parser.add_argument("--no-record", action="store_true", help="print, do not write bench/results.json")
    args = parser.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.node_kill_rounds < 1:
        parser.error(f"--node-kill-rounds must be at least 1, got {args.node_kill_rounds}")
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    started = time.monotonic()
    violations, figures, _ = run(args)
    print(json.dumps(figures, indent=1))
    faults = sum(figures["faults"].values())
    print(f"{faults} faults in {figures['minutes']:.1f} min (seed {args.seed}), {figures['requests']} requests; "
          f"convergence p50 {figures['converge_p50_s']} s, max {figures['converge_max_s']} s; "
          f"availability during serving faults {figures['availability_serving_faults']}; "
          f"{len(violations)} violations ({time.monotonic() - started:.0f} s in all)")
    for message in violations[:20]:
        print(f"VIOLATION: {message}")
    if not args.no_record:
        record("soak.py", len(violations), f"invariant violations in a {args.minutes:g}-minute soak (seed {args.seed})",
               faults, len(violations) / max(faults, 1), "0 violations with >= 100 faults in 20 minutes "
               "(baseline = faults injected)")
        worst = figures["converge_worst"]
        record("soak.py:converge", worst["seconds"], f"s from a fault to convergence, the fault closest to its bound "
               f"({worst['fault']}; p50 of all {figures['converge_p50_s']:.1f} s)", worst["bound_s"],
               worst["seconds"] / worst["bound_s"], f"<= {DEFAULT_BOUND_S:g} s from the fault (node kill: "
               f"{CONVERGE_BOUND_S['node_kill']:g} s, replica kill: {CONVERGE_BOUND_S['replica_kill']:g} s)")
        inside, outside = figures["availability_serving_faults"], figures["availability_outside_faults"]
        record("soak.py:availability", inside, "share of 200 answers sent during serving faults", outside,
               inside / outside if inside is not None and outside else None, "reported (baseline: outside faults)")
    if violations:
        print(f"first violation: {violations[0]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
