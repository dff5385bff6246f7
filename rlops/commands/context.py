"""The CLI's shared context: the config, loaded lazily so `--help` works even with a broken file and answers
before pydantic builds the config models."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager, redirect_stdout
from typing import TYPE_CHECKING, Callable, Iterator

import click

if TYPE_CHECKING:
    from rlops.config import Config
    from rlops.task import Task


class CliContext:
    """Holds `--config`; `.config` loads it once and turns a ConfigError into one clear CLI message."""

    def __init__(self, path: str | None):
        self.path = path
        self._config: Config | None = None

    @property
    def config(self) -> Config:
        if self._config is None:
            from rlops.config import ConfigError, load_config

            try:
                self._config = load_config(self.path)
            except ConfigError as exc:
                raise click.ClickException(str(exc)) from None
        return self._config


pass_ctx = click.make_pass_decorator(CliContext)
verbose_option = click.option("-v", "--verbose", is_flag=True,
                              help="Leave libraries' warnings, logs and progress bars on the terminal too.")


def load_task(obj: CliContext) -> Task:
    """The configured task, or a usage error naming the `task` key and what is wrong."""
    from rlops.task import TaskError

    try:
        return obj.config.load_task()
    except TaskError as exc:
        raise click.ClickException(str(exc)) from None


@contextmanager
def machine_output(as_json: bool) -> Iterator[Callable[[object], None]]:
    """With `--json`, stdout holds exactly one JSON document: everything printed inside the block (our
    messages, the libraries' prints and progress bars) goes to stderr, and the document is written with the
    `emit` it yields. Without `--json`, `emit` prints the document as it is."""
    stdout = sys.stdout

    def emit(document: object) -> None:
        stdout.write(json.dumps(document, indent=2) + "\n")
        stdout.flush()

    if not as_json:
        yield emit
        return
    with redirect_stdout(sys.stderr):
        yield emit
