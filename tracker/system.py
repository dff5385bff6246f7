"""What the machine was doing: MLflow's own system metrics monitor (`system/*`: CPU, memory, disk,
network, and GPU where pynvml/amdsmi find one) on its own thread, ended with a bound so a run's end never
waits on it (a server outage stops the monitor; the run's own metrics do not depend on it)."""
from __future__ import annotations

import logging
import threading

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


def start(run_id: str, tracking_uri: str, interval_s: float, *, enabled: bool, resume: bool,
          node_id: str | None = None) -> SystemMetrics | None:
    """The monitor, or None when disabled or when it cannot start (psutil missing): never fails a run."""
    if not enabled:
        return None
    try:
        return SystemMetrics(run_id, tracking_uri, interval_s, resume=resume, node_id=node_id)
    except Exception as exc:  # noqa: BLE001 - the run goes on without system metrics
        log.warning("system metrics are off for run %s: %s", run_id, exc)
        return None
