"""`rlops runs sweep|status|flush|sync|export`: settle runs whose heartbeat stopped; inspect and drain a run
dir; replay offline runs into MLflow and carry them across networks as one file."""
from __future__ import annotations

import time
from pathlib import Path

import click

from rlops.commands.context import CliContext, machine_output, pass_ctx

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
    rows = [("run", status.run_id or "(none)"), *([("offline id", status.offline_id)] if status.offline_id else []),
            ("synced", "no" if status.unsynced else "yes"), ("spooled points", status.spooled_points),
            ("dead letters", status.dead_letters), ("pending checkpoints", status.pending_checkpoints),
            ("pending tables", status.pending_tables), ("pending registration", status.pending_registrations),
            ("unrecorded end", status.intended_end or "-"), ("last ack", ack),
            ("writer", status.holder.describe() if status.holder else "none")]
    for label, value in rows:
        click.echo(f"{label + ':':<22}{value}")
    verb = "sync" if status.unsynced else "flush"
    click.echo("drained" if status.drained else f"not drained: `rlops runs {verb} {run_dir}` lands the rest")


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
    _echo_report(report)
    if report.left:
        raise click.ClickException(f"still pending: {report.left}")
    click.echo("drained")


def _echo_report(report) -> None:
    click.echo(f"run {report.run_id}: {report.points_landed} metric point(s) and {report.checkpoints_landed} "
               f"checkpoint(s) landed")
    if report.registered:
        click.echo(f"registered: {report.registered}")
    if report.ended:
        click.echo(f"run marked {report.ended}")


@runs_group.command("sync")
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds to wait for MLflow per run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (a report per run).")
@pass_ctx
def runs_sync(obj: CliContext, sources: tuple[Path, ...], timeout_s: float, as_json: bool) -> None:
    """Replay offline runs into MLflow: each SOURCE is a run dir or a bundle from `rlops runs export`. Points
    keep their steps and times, checkpoints become LoggedModels, then the registration rule runs as online.
    Run it again at will (after a kill too): the same run is updated, nothing is logged twice. Exit 1 if
    something is still left."""
    from tracker import BundleError, sync_runs
    from tracker.lock import RunDirBusy

    with machine_output(as_json) as emit:
        try:
            reports = sync_runs(obj.config, list(sources), timeout_s)
        except (FileNotFoundError, RunDirBusy, ConnectionError, BundleError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        if as_json:
            emit([{"run_dir": str(r.run_dir), "run_id": r.run_id, "offline_id": r.offline_id,
                   "points_landed": r.points_landed, "checkpoints_landed": r.checkpoints_landed,
                   "registered": r.registered, "ended": r.ended, "left": r.left} for r in reports])
        else:
            for report in reports:
                _echo_report(report)
                click.echo(f"{report.run_dir}: " + (f"still pending: {report.left}" if report.left else "synced"))
    if any(r.left for r in reports):
        raise SystemExit(1)


@runs_group.command("export")
@RUN_DIR
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The bundle file to write.")
@pass_ctx
def runs_export(obj: CliContext, run_dir: Path, out: Path) -> None:
    """Write RUN_DIR's run (points, checkpoints, tables, registration job, end) to one bundle file with a
    manifest of digests, for `rlops runs sync FILE` on a machine that reaches MLflow."""
    from tracker import export_run_dir
    from tracker.lock import RunDirBusy

    try:
        bundle = export_run_dir(run_dir, out, obj.config.tracking.lock_lease_s)
    except (FileNotFoundError, RunDirBusy) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {bundle.path}: run {bundle.run_label}, {bundle.files} file(s), {bundle.bytes / 1e6:.1f} MB")
