"""The canary watcher of `rlops hooks serve`: each published canary against its alias's baseline version over
a window of the serving metrics; on an SLO breach (`registry.canary.slo`) it aborts the canary through the
registry (trigger `watcher`), tags the version with the reason and figures, and the history records it.

Pure parts (parse, window delta, p95, breach) apart from the thin loop (scrape, read manifest, abort).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from rlops.config import CanarySLO, Config
from rlops.layout import canary_alias

log = logging.getLogger(__name__)

ROLLBACK_TAG = "serving.canary_rollback"  # on the version: why the watcher dropped it, with the figures
WATCHER_ACTOR = "rlops-hooks/watcher"
CLIENT_GONE = "499"  # not the version's fault

Key = tuple[str, str, int, bool]  # registered model, alias, version, canary


@dataclass
class Series:
    """One (model, alias, version, canary) summed over endpoints: answers, errors, latency buckets (le -> count)."""

    requests: float = 0.0
    errors: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)

    def minus(self, earlier: "Series") -> "Series":
        if self.requests < earlier.requests:  # the exporter restarted: everything is new
            return self
        return Series(self.requests - earlier.requests, self.errors - earlier.errors,
                      {le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()})

    def p95_ms(self) -> float | None:
        """The upper bound of the bucket holding the 95th percentile (the last finite one for +Inf)."""
        total = self.buckets.get(float("inf"), 0.0)
        if total <= 0:
            return None
        finite = sorted(le for le in self.buckets if le != float("inf"))
        for le in finite:
            if self.buckets[le] >= 0.95 * total:
                return le
        return finite[-1] if finite else None


def parse_metrics(text: str) -> dict[Key, Series]:
    """Prometheus text -> the ingress's rlops_serving_* series by (model, alias, version, canary)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Key, Series] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("ray_rlops_serving_"):
            continue
        for sample in family.samples:
            labels = sample.labels
            version = labels.get("version", "")
            if not version.isdigit() or not labels.get("alias"):
                continue
            key = (labels.get("registered_model", ""), labels["alias"], int(version), labels.get("canary") == "true")
            series = out.setdefault(key, Series())
            if sample.name == "ray_rlops_serving_requests_total":
                series.requests += sample.value
            elif sample.name == "ray_rlops_serving_errors_total" and labels.get("status") != CLIENT_GONE:
                series.errors += sample.value
            elif sample.name == "ray_rlops_serving_latency_ms_bucket":
                le = float(labels["le"])
                series.buckets[le] = series.buckets.get(le, 0.0) + sample.value
    return out


def window(now: Mapping[Key, Series], then: Mapping[Key, Series]) -> dict[Key, Series]:
    return {key: series.minus(then[key]) if key in then else series for key, series in now.items()}


def breach(canary: Series, baseline: Series, slo: CanarySLO) -> str | None:
    """Why the canary breaks the SLO against the baseline over the window, with the figures; None if it holds."""
    if canary.requests < slo.min_requests:
        return None
    canary_rate = canary.errors / canary.requests
    baseline_rate = baseline.errors / baseline.requests if baseline.requests else 0.0
    if canary_rate - baseline_rate > slo.max_error_rate_increase:
        return (f"error rate {canary_rate:.1%} over {canary.requests:.0f} requests vs the baseline's {baseline_rate:.1%} "
                f"over {baseline.requests:.0f} (allowed +{slo.max_error_rate_increase:.1%}) in {slo.window_s:g} s")
    canary_p95, baseline_p95 = canary.p95_ms(), baseline.p95_ms()
    if (canary_p95 is not None and baseline_p95 is not None and canary_p95 > slo.min_p95_ms
            and canary_p95 > slo.max_p95_ratio * baseline_p95):
        return (f"p95 latency <= {canary_p95:g} ms vs the baseline's <= {baseline_p95:g} ms (allowed x{slo.max_p95_ratio:g}) "
                f"over {canary.requests:.0f} requests in {slo.window_s:g} s")
    return None


def canaries_in(stats: Mapping[Key, Series]) -> set[tuple[str, str, int]]:
    return {(model, alias, version) for model, alias, version, canary in stats if canary}


class Periodic:
    """A daemon thread that calls `tick` every `interval_s` until stopped; an error is logged and kept in
    `last_error`, never the end of the loop (a metrics or registry outage passes)."""

    name = "rlops-periodic"

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    def tick(self) -> list[dict]:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - an outage must not stop the loop
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("%s: %s", self.name, self.last_error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


class CanaryWatcher(Periodic):
    """Scrapes every `window_s / 6` (at least 1 s); keeps the snapshots of one window; `tick` decides."""

    name = "rlops-canary-watcher"

    def __init__(self, config: Config, *, scrape: Callable[[], str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        assert config.registry.canary.slo is not None
        super().__init__(max(1.0, config.registry.canary.slo.window_s / 6))
        self.config, self.slo = config, config.registry.canary.slo
        self._scrape = scrape or self._http_scrape
        self._clock = clock
        self._snapshots: deque[tuple[float, dict[Key, Series]]] = deque()
        self.aborted: list[dict] = []

    def _http_scrape(self) -> str:
        import httpx

        serving = self.config.serving
        url = self.slo.metrics_url or f"http://{serving.host}:{serving.metrics_port}/metrics"
        response = httpx.get(url, timeout=5)
        response.raise_for_status()
        return response.text

    def tick(self) -> list[dict]:
        """One scrape and decision; returns the canaries aborted by it."""
        now = self._clock()
        current = parse_metrics(self._scrape())
        self._snapshots.append((now, current))
        while len(self._snapshots) > 1 and self._snapshots[1][0] <= now - self.slo.window_s:
            self._snapshots.popleft()  # keep one snapshot at or before the window's start
        stats = window(current, self._snapshots[0][1])
        aborted = []
        for model, alias, version in sorted(canaries_in(stats)):
            if model in self.config.registry.models:
                record = self._judge(model, alias, version, stats)
                if record:
                    aborted.append(record)
        self.aborted.extend(aborted)
        return aborted

    def _judge(self, model: str, alias: str, version: int, stats: Mapping[Key, Series]) -> dict | None:
        from registry_hooks import operations, registry, storage
        from registry_hooks.sync import Promoter

        promoter = Promoter(self.config)
        manifest, _ = storage.read_manifest(promoter.dest, promoter.location, model)
        live, baseline_route = manifest.canaries.get(alias), manifest.aliases.get(alias)
        if live is None or live.version != version or baseline_route is None:
            return None  # already gone, or another canary now: its own figures will decide
        baseline = stats.get((model, alias, baseline_route.version, False), Series())
        reason = breach(stats[(model, alias, version, True)], baseline, self.slo)
        if reason is None:
            return None
        intent = registry.read_intent(promoter.mlflow, model, self.config.registry.served_aliases) or {}
        if intent.get(canary_alias(alias)) != version:
            return None  # someone changed the canary in the registry meanwhile: theirs to decide
        text = f"canary v{version} of {model}@{alias} aborted by the SLO watcher: {reason}"
        log.warning("%s", text)
        registry.set_tags(promoter.mlflow, model, version, {ROLLBACK_TAG: f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {reason}"})
        report = operations.canary(self.config, model, alias=alias, abort=True, trigger="watcher",
                                   actor=WATCHER_ACTOR, reason=reason)
        return {"model": model, "alias": alias, "version": version, "baseline": baseline_route.version,
                "reason": reason, "generation": report.generation}
