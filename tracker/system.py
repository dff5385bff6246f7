"""What the machine was doing: MLflow's own system metrics monitor (`system/*`: CPU, memory, disk,
network, and GPU where pynvml/amdsmi find one) on its own thread, ended with a bound so a run's end never
waits on it (a server outage stops the monitor; the run's own metrics do not depend on it). An offline
run samples with MLflow's same monitors and spools the points with its own (`SpooledSystemMetrics`)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from tracker.spool import Point

log = logging.getLogger(__name__)

STOP_BOUND_S = 2.0  # the last sample is not worth a slower end (the monitor's client retries for minutes)


class SystemMetrics:
    def __init__(self, run_id: str, tracking_uri: str, interval_s: float, *, resume: bool,
                 node_id: str | None = None):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # resume_logging: a resumed run continues the system metrics' steps instead of restarting at 0
        self._monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=resume,
                                             node_id=node_id, tracking_uri=tracking_uri)
        self._monitor.start()

    def stop(self, timeout_s: float = STOP_BOUND_S) -> bool:
        """Stop sampling and flush what was sampled, waiting at most `timeout_s`."""
        worker = threading.Thread(target=self._monitor.finish, name="rlops-system-metrics-stop", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            log.warning("system metrics did not flush within %.0f s; the last sample may be missing", timeout_s)
        return not worker.is_alive()


class SpooledSystemMetrics(SystemMetrics):
    """MLflow's monitors sampled on their thread, their points handed to `put_points` (the run's spool)
    instead of a server: MLflow's loop asks the server whether the run still runs, an offline run cannot."""

    def __init__(self, put_points: Callable[[list[Point]], None], interval_s: float, *, node_id: str | None = None):
        from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
        from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
        from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        class Monitor(SystemMetricsMonitor):
            def __init__(self):  # MLflow's own opens a client of the tracking URI: there is none
                self.monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
                if gpu_monitor := self._initialize_gpu_monitor():
                    self.monitors.append(gpu_monitor)
                self.sampling_interval, self.samples_before_logging = interval_s, 1
                self._run_id, self._process, self._logging_step = None, None, 0
                self._shutdown_event = threading.Event()
                self._metrics_prefix, self.node_id = "system/", node_id
                self.mlflow_logger = _SpoolLogger(put_points)

            def monitor(self) -> None:  # the last sample is published on stop too: a short run has one
                stopping = False
                while not stopping:
                    self.collect_metrics()
                    stopping = self._shutdown_event.wait(self.sampling_interval)
                    self.publish_metrics(self.aggregate_metrics())

        self._monitor = Monitor()
        self._monitor.start()


class _SpoolLogger:
    """What MLflow's monitor records into (its `BatchMetricsLogger` interface): points for the spool."""

    data = ()  # MLflow's monitor logs how many points its logger holds; this one holds none

    def __init__(self, put_points: Callable[[list[Point]], None]):
        self._put_points = put_points

    def record_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._put_points([Point(key, float(value), now, step) for key, value in metrics.items()])

    def flush(self) -> None:
        pass  # every sample went to the spool when it was recorded


def start(run_id: str, tracking_uri: str, interval_s: float, *, enabled: bool, resume: bool,
          node_id: str | None = None,
          spool_to: Callable[[list[Point]], None] | None = None) -> SystemMetrics | None:
    """The monitor, or None when disabled or when it cannot start (psutil missing): never fails a run.
    `spool_to`: an offline run's `put_points`, which its samples go to (steps count from 0 in each session)."""
    if not enabled:
        return None
    try:
        if spool_to is not None:
            return SpooledSystemMetrics(spool_to, interval_s, node_id=node_id)
        return SystemMetrics(run_id, tracking_uri, interval_s, resume=resume, node_id=node_id)
    except Exception as exc:  # noqa: BLE001 - the run goes on without system metrics
        log.warning("system metrics are off for run %s: %s", run_id, exc)
        return None
