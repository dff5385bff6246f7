"""The terminal while a command works: our lines on it, everything else written to stdout and stderr
(libraries' warnings, logs and progress bars, C extensions, child processes) in the command's log file.

The redirection is of file descriptors 1 and 2, not of `sys.stdout`: a logging handler or a progress bar made
before the command started holds the old stream object, and a child process inherits descriptors.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, TextIO

CLEAR_LINE = "\r\x1b[K"
DEFAULT_WIDTH = 100


class Terminal:
    """Permanent lines, and one live line rewritten in place; where the stream is not a terminal (a pipe, a
    CI log) the live line is not written, so the output there is the permanent lines alone."""

    def __init__(self, stream: TextIO, owned: bool = False):
        self.stream, self.owned = stream, owned
        self.tty = stream.isatty()
        self._live = False

    def line(self, text: str) -> None:
        self.stream.write((CLEAR_LINE if self._live else "") + text + "\n")
        self.stream.flush()
        self._live = False

    def live(self, text: str) -> None:
        if not self.tty:
            return
        self.stream.write(CLEAR_LINE + text[:self._width() - 1])
        self.stream.flush()
        self._live = True

    def close(self) -> None:
        if self._live:
            self.stream.write("\n")
        if self.owned:
            self.stream.close()
        else:
            self.stream.flush()

    def _width(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except OSError:
            return DEFAULT_WIDTH


@contextmanager
def quiet(log_path: Path, *, verbose: bool, on_stderr: bool = False) -> Iterator[Terminal]:
    """Inside, descriptors 1 and 2 append to `log_path`; the Terminal yielded writes where stdout (or, with
    `on_stderr`, stderr) went before. `verbose` (`-v`) changes nothing: everything stays on the terminal. A
    stream that is not a descriptor (click's CliRunner, an embedding program) keeps our lines."""
    stream = sys.stderr if on_stderr else sys.stdout
    if verbose:
        yield Terminal(stream)
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    ours = 2 if on_stderr else 1
    terminal = Terminal(os.fdopen(os.dup(saved[ours]), "w"), owned=True) if _writes_to(stream, ours) else Terminal(stream)
    with open(log_path, "a") as log:
        for fd in saved:
            os.dup2(log.fileno(), fd)
    try:
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        terminal.close()


def _writes_to(stream: TextIO, fd: int) -> bool:
    try:
        return stream.fileno() == fd
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return False
