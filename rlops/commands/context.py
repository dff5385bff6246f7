"""The CLI's shared context: the config, loaded lazily so `--help` works even with a broken file."""
from __future__ import annotations

import click

from rlops.config import Config, ConfigError, load_config


class CliContext:
    """Holds `--config`; `.config` loads it once and turns a ConfigError into one clear CLI message."""

    def __init__(self, path: str | None):
        self.path = path
        self._config: Config | None = None

    @property
    def config(self) -> Config:
        if self._config is None:
            try:
                self._config = load_config(self.path)
            except ConfigError as exc:
                raise click.ClickException(str(exc)) from None
        return self._config


pass_ctx = click.make_pass_decorator(CliContext)
