"""`rlops runs sweep|status|flush`: settle runs whose heartbeat stopped; inspect and drain a run dir."""
from __future__ import annotations

import time
from pathlib import Path

import click

from rlops.commands.context import CliContext, pass_ctx

RUN_DIR = click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))


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


@runs_group.command("status")
@RUN_DIR
def runs_status(run_dir: Path) -> None:
    """What a run dir's tracker state holds that MLflow has not taken yet (reads local files only)."""
    from tracker import run_dir_status

    try:
        status = run_dir_status(run_dir)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    ack = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.last_ack_at)) if status.last_ack_at else "never"
    rows = [("run", status.run_id or "(none)"), ("spooled points", status.spooled_points),
            ("dead letters", status.dead_letters), ("pending checkpoints", status.pending_checkpoints),
            ("pending tables", status.pending_tables), ("pending registration", status.pending_registrations),
            ("unrecorded end", status.intended_end or "-"), ("last ack", ack),
            ("writer", status.holder.describe() if status.holder else "none")]
    for label, value in rows:
        click.echo(f"{label + ':':<22}{value}")
    click.echo("drained" if status.drained else f"not drained: `rlops runs flush {run_dir}` lands the rest")


@runs_group.command("flush")
@RUN_DIR
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=None,
              help="Seconds to wait for MLflow (default: tracking.flush_timeout_s).")
@pass_ctx
def runs_flush(obj: CliContext, run_dir: Path, timeout_s: float | None) -> None:
    """Land what a crashed or stopped run left in RUN_DIR: points, checkpoints, a pending registration and
    an end status the server missed. Exit 1 if something is still left."""
    from tracker import flush_run_dir
    from tracker.lock import RunDirBusy

    try:
        report = flush_run_dir(obj.config, run_dir, timeout_s)
    except (FileNotFoundError, RunDirBusy, ConnectionError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"run {report.run_id}: {report.points_landed} metric point(s) and {report.checkpoints_landed} "
               f"checkpoint(s) landed")
    if report.registered:
        click.echo(f"registered: {report.registered}")
    if report.ended:
        click.echo(f"run marked {report.ended}")
    if report.left:
        raise click.ClickException(f"still pending: {report.left}")
    click.echo("drained")
