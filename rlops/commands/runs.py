"""`rlops runs sweep`: mark RUNNING runs whose heartbeat stopped as FAILED."""
from __future__ import annotations

import click

from rlops.commands.context import CliContext, pass_ctx


@click.group("runs")
def runs_group() -> None:
    """Training runs tracked in MLflow."""


@runs_group.command("sweep")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds without heartbeat before a run counts as dead (default: tracking.heartbeat_timeout_s).")
@click.option("--dry-run", is_flag=True, help="Only list the runs that would be marked FAILED.")
@pass_ctx
def runs_sweep(obj: CliContext, timeout_s: float | None, dry_run: bool) -> None:
    """Mark runs of the configured experiment FAILED when their heartbeat is older than the timeout."""
    from tracker.sweep import sweep_stale_runs

    stale = sweep_stale_runs(obj.config, timeout_s=timeout_s, dry_run=dry_run)
    verb = "would mark" if dry_run else "marked"
    for run in stale:
        click.echo(f"{verb} FAILED: {run.run_id} ({run.run_name}), silent {run.silent_s:.0f}s")
    click.echo(f"{len(stale)} stale run(s) in experiment {obj.config.tracking.experiment!r}")
