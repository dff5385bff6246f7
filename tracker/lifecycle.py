"""How a session ends: the end status and tags of each way out, and the guards that catch SIGTERM and an
interpreter exit without an end (clean exit -> FINISHED, exception -> FAILED, SIGTERM/Ctrl-C -> KILLED)."""
from __future__ import annotations

import atexit
import signal
import threading
from typing import Callable

from mlflow.entities import RunStatus

from rlops.config import mask_value

TAG_END_REASON = "rlops.end_reason"
TAG_EXCEPTION_TYPE = "rlops.exception_type"
TAG_EXCEPTION_MESSAGE = "rlops.exception_message"
MAX_TAG_VALUE = 5000
FINISHED = RunStatus.to_string(RunStatus.FINISHED)
FAILED = RunStatus.to_string(RunStatus.FAILED)
KILLED = RunStatus.to_string(RunStatus.KILLED)


class RunTerminated(BaseException):
    """Raised on the main thread by SIGTERM while a session is open; ends the run KILLED."""


def completed() -> tuple[str, dict[str, str]]:
    return FINISHED, {TAG_END_REASON: "completed"}


def killed(reason: str) -> tuple[str, dict[str, str]]:
    return KILLED, {TAG_END_REASON: reason}


def failed(exc: BaseException) -> tuple[str, dict[str, str]]:
    message = str(mask_value("message", str(exc)))[:MAX_TAG_VALUE]
    return FAILED, {TAG_END_REASON: "exception", TAG_EXCEPTION_TYPE: type(exc).__name__,
                    TAG_EXCEPTION_MESSAGE: message}


def end_of(exc: BaseException | None) -> tuple[str, dict[str, str]]:
    """The end a `with` block's exit means."""
    if exc is None:
        return completed()
    if isinstance(exc, RunTerminated):
        return killed("SIGTERM")
    if isinstance(exc, KeyboardInterrupt):
        return killed("KeyboardInterrupt")
    return failed(exc)


class ExitGuard:
    """While armed: SIGTERM raises RunTerminated on the main thread (so the `with` block ends the run
    KILLED), and an interpreter exit without an end runs `at_exit` (land what is spooled, bounded)."""

    def __init__(self, at_exit: Callable[[], None]):
        self._at_exit = at_exit
        self._previous_sigterm = None
        atexit.register(self._at_exit)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)

    def disarm(self) -> None:
        atexit.unregister(self._at_exit)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def _on_sigterm(signum, frame) -> None:
    raise RunTerminated("SIGTERM")
