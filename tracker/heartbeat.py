"""The run's heartbeat: a background thread that tags the run every `tracking.heartbeat_interval_s`, so
`rlops runs sweep` can tell a live run from one whose process died silently."""
from __future__ import annotations

import threading
import time

from tracker.rest import MlflowRest

TAG_HEARTBEAT = "rlops.heartbeat"


def beat() -> str:
    """A heartbeat value: the time in ms resolution (a whole second of rounding would count as silence)."""
    return f"{time.time():.3f}"


class Heartbeat:
    def __init__(self, rest: MlflowRest, run_id: str, interval_s: float):
        self._rest = rest
        self._run_id = run_id
        self._interval_s = interval_s
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="rlops-tracker-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._rest.set_tags(self._run_id, {TAG_HEARTBEAT: beat()})
            except Exception:  # noqa: BLE001 - a missed beat is retried next interval
                pass
