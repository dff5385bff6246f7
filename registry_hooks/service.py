"""`rlops hooks serve`: the webhook receiver (a small ASGI app) and the reconciler loop, in one process.

A webhook only says "reconcile this model"; one worker thread runs the sync for queued models (coalesced,
so a burst of deliveries costs one sync). Each `hooks.reconcile_interval_s` the reconciler loop runs a pass
(reconcile.py): bulk reads of the registry and the manifests, then syncs, `hooks.reconcile_concurrency` at
a time, of only the models whose manifest differs from their intent, so a dropped delivery or a legacy
stage transition still converges and a pass with nothing to do stays cheap at 10k models.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from registry_hooks import storage
from registry_hooks.auto_canary import AutoCanary
from registry_hooks.reconcile import ManifestCache, PassReport, run_pass
from registry_hooks.operations import RECONCILER_STATUS
from registry_hooks.subscriptions import WEBHOOK_PATH, HooksError
from registry_hooks.sync import Promoter, SyncReport, sync_model
from registry_hooks.trace_retention import prune_traces
from registry_hooks.watcher import CanaryWatcher
from registry_hooks.webhook import (
    ALIAS_EVENTS,
    MAX_BODY_BYTES,
    Rejected,
    SeenDeliveries,
    authenticate,
    parse_delivery,
)
from rlops.config import Config, mask_text
from rlops.layout import utc_now
from tracker import sweep_stale_runs

ERROR_TEXT_LIMIT = 300
TRACE_PRUNE_EVERY_S = 3600.0


def describe_error(context: str, exc: BaseException, config: Config) -> str:
    """What /healthz and the heartbeat show of a failure: masked (secrets, URI passwords) and bounded."""
    return mask_text(f"{context}: {type(exc).__name__}: {exc}", [config.hooks.secret])[:ERROR_TEXT_LIMIT]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.deliveries = Counter("rlops_hooks_deliveries", "Webhook deliveries by result", ["result"],
                                  registry=self.registry)
        self.syncs = Counter("rlops_hooks_syncs", "Syncs run, by trigger and outcome", ["trigger", "outcome"],
                             registry=self.registry)
        self.sync_seconds = Histogram("rlops_hooks_sync_seconds", "Duration of one model sync", registry=self.registry)
        self.last_reconcile = Gauge("rlops_hooks_last_reconcile_timestamp_seconds", "End of the last reconciler pass",
                                    registry=self.registry)


class Reconciler:
    """Runs syncs on one worker thread; `request(model, trigger)` queues (coalescing), `loop` re-queues all.
    The trigger is the publisher; the history names who moved each alias from the registry (plan.next_manifest)."""

    def __init__(self, config: Config, metrics: Metrics, sync: Callable[..., SyncReport] = sync_model):
        self.config, self.metrics, self._sync = config, metrics, sync
        self._pending: dict[str, str] = {}  # model -> trigger
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._promoter: Promoter | None = None  # clients for the bulk reads, made on the loop's thread
        self._manifests = ManifestCache()
        self.last_run_at: str | None = None
        self.last_ok_at: str | None = None
        self.last_error: str | None = None
        self.runs = 0
        self.last_pass: PassReport | None = None
        self.pass_error: str | None = None  # why the latest pass could not read the registry or S3
        self._count = threading.Lock()  # pass syncs run on several threads
        self._next_prune = 0.0  # the first pass prunes expired traces, then every TRACE_PRUNE_EVERY_S

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._work, name="rlops-sync-worker", daemon=True)]
        if self.config.hooks.reconcile_interval_s > 0:
            self._threads.append(threading.Thread(target=self._loop, name="rlops-reconciler", daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        for thread in self._threads:
            thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def request(self, model: str, trigger: str) -> None:
        with self._wake:
            self._pending.setdefault(model, trigger)
            self._wake.notify()

    def _loop(self) -> None:
        # Never retires anything: a model missing from this config may be another deployment's (`promote retire`).
        while not self._stop.is_set():
            try:
                # A Ray task can die without handlers: settle runs whose tracker heartbeat stopped.
                sweep_stale_runs(self.config)
            except Exception as exc:  # noqa: BLE001 - same: reported, never fatal to the loop
                self.last_error = describe_error("sweeping stale runs", exc, self.config)
            started = time.monotonic()
            if started >= self._next_prune:
                self._prune_traces()
                self._next_prune = started + TRACE_PRUNE_EVERY_S
            self._pass()
            # A fixed cadence: a pass longer than the interval is followed at once (health says how far behind).
            self._stop.wait(max(0.0, self.config.hooks.reconcile_interval_s - (time.monotonic() - started)))

    def _prune_traces(self) -> None:
        try:
            prune_traces(self.config)
        except Exception as exc:  # noqa: BLE001 - MLflow unreachable: the next round retries
            self.last_error = describe_error("trace retention", exc, self.config)

    def _pass(self) -> None:
        try:
            if self._promoter is None:
                self._promoter = Promoter(self.config)
            self.last_pass = run_pass(self._promoter, self._manifests, lambda m: self._run(m, "reconciler"),
                                      self.config.hooks.reconcile_concurrency)
            self.pass_error = None
        except Exception as exc:  # noqa: BLE001 - MLflow/S3 unreachable: reported, the next pass retries
            self.pass_error = describe_error("reconciler pass", exc, self.config)
        self.metrics.last_reconcile.set_to_current_time()
        self._heartbeat()

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                while not self._pending and not self._stop.is_set():
                    self._wake.wait()
                if self._stop.is_set():
                    return
                model, trigger = next(iter(self._pending.items()))
                del self._pending[model]
            self._run(model, trigger)

    def _run(self, model: str, trigger: str) -> bool:
        started = time.monotonic()
        ok = True
        try:
            self._sync(self.config, model, trigger=trigger)
            self.metrics.syncs.labels(trigger, "ok").inc()
            self.last_ok_at, self.last_error = utc_now(), None
        except Exception as exc:  # noqa: BLE001 - an outage must not kill the loop; it is reported instead
            self.metrics.syncs.labels(trigger, "error").inc()
            self.last_error = describe_error(model, exc, self.config)
            ok = False
        with self._count:
            self.runs += 1
        self.last_run_at = utc_now()
        self.metrics.sync_seconds.observe(time.monotonic() - started)
        return ok

    def health(self) -> dict:
        return {"last_run_at": self.last_run_at, "last_ok_at": self.last_ok_at, "last_error": self.last_error,
                "runs": self.runs, "interval_s": self.config.hooks.reconcile_interval_s, "alive": self.alive,
                "last_pass": self.last_pass.to_dict() if self.last_pass else None, "pass_error": self.pass_error}

    def _heartbeat(self) -> None:
        """What `promote status` shows as the reconciler's health (it may run in another pod)."""
        try:
            promoter = self._promoter or Promoter(self.config)
            storage.write_status(promoter.dest, promoter.location, RECONCILER_STATUS, self.health())
        except Exception as exc:  # noqa: BLE001 - best effort; /healthz still has it
            self.last_error = describe_error("heartbeat", exc, self.config)


def create_app(config: Config, reconciler: Reconciler, metrics: Metrics, clock: Callable[[], float] = time.time) -> Starlette:
    if config.hooks.webhook_enabled and not config.hooks.secret:
        raise HooksError("hooks.secret is not set: export RLOPS_HOOKS__SECRET (the same secret `rlops hooks "
                         "register` gives MLflow), or set hooks.webhook_enabled: false")
    seen = SeenDeliveries(config.hooks.timestamp_tolerance_s)
    served = set(config.registry.models)

    async def webhook(request: Request) -> Response:
        if not config.hooks.webhook_enabled:
            return JSONResponse({"error": "webhook receiver disabled"}, status_code=404)
        try:
            body = await read_bounded(request, MAX_BODY_BYTES)
            delivery_id = authenticate(request.headers, body, config.hooks.secret or "", clock(),
                                       config.hooks.timestamp_tolerance_s)
            delivery = parse_delivery(delivery_id, body)
        except Rejected as exc:
            metrics.deliveries.labels("rejected" if exc.status == 401 else "bad_request").inc()
            return JSONResponse({"error": exc.reason}, status_code=exc.status)
        if not seen.first_time(delivery.delivery_id, clock()):
            metrics.deliveries.labels("duplicate").inc()
            return JSONResponse({"status": "duplicate"})
        if delivery.event not in ALIAS_EVENTS or delivery.model not in served:
            metrics.deliveries.labels("ignored").inc()
            return JSONResponse({"status": "ignored"})
        reconciler.request(delivery.model, "webhook")
        metrics.deliveries.labels("accepted").inc()
        return JSONResponse({"status": "queued"}, status_code=202)

    async def healthz(request: Request) -> Response:
        ok = reconciler.alive
        return JSONResponse({"status": "ok" if ok else "down", "webhook_enabled": config.hooks.webhook_enabled,
                             "reconciler": reconciler.health()}, status_code=200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route(WEBHOOK_PATH, webhook, methods=["POST"]), Route("/healthz", healthz),
                             Route("/metrics", prometheus)])


async def read_bounded(request: Request, limit: int) -> bytes:
    """The body, refused (413) from its Content-Length before reading, or as soon as the stream passes `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise Rejected(400, "malformed Content-Length")
        if int(declared) > limit:
            raise Rejected(413, "payload too large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Rejected(413, "payload too large")
    return bytes(body)


def serve(config: Config) -> None:
    """Run the receiver, the reconciler, and the canary watcher (with `registry.canary.slo`) and the auto canary
    (with `registry.shadow.auto_canary`) until interrupted."""
    import uvicorn

    metrics = Metrics()
    reconciler = Reconciler(config, metrics)
    app = create_app(config, reconciler, metrics)
    loops = ([CanaryWatcher(config)] if config.registry.canary.slo is not None else []) + \
        ([AutoCanary(config)] if config.registry.shadow.auto_canary is not None else [])
    reconciler.start()
    for loop in loops:
        loop.start()
    try:
        uvicorn.run(app, host=config.hooks.host, port=config.hooks.port, log_level="warning")
    finally:
        for loop in loops:
            loop.stop()
        reconciler.stop()
