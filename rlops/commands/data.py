"""`rlops data build`: write the maze datasets (SkyRL rows, fixed eval sets, local trainer sets);
`rlops data from-traces`: a prompt set from a served version's traces."""
from __future__ import annotations

from pathlib import Path

import click

from rlops.commands.context import CliContext, load_task, machine_output, pass_ctx


@click.group("data")
def data_group() -> None:
    """Datasets for training and evaluation: the task's own, and prompt sets from production traces."""


@data_group.command("build")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Output folder (default: <data_dir>/datasets).")
@click.option("--skyrl-train", "skyrl_train_count", type=click.IntRange(1, 1_000_000), default=4096,
              show_default=True, help="Training prompts for the SkyRL job (9x9 mazes).")
@click.option("--local-train", "local_train_count", type=click.IntRange(1, 1_000_000), default=2048,
              show_default=True, help="Training mazes for the local trainer.")
@click.option("--heldout", "heldout_count", type=click.IntRange(1, 100_000), default=256, show_default=True,
              help="Held-out mazes beyond the fixed local eval set.")
@pass_ctx
def data_build(obj: CliContext, out_dir: str | None, skyrl_train_count: int, local_train_count: int,
               heldout_count: int) -> None:
    """Write SkyRL parquet rows (train + the fixed eval set: seeds 0-63 of maze_2d/easy) and the local
    trainer's sets; print each eval set's layout hash."""
    from tasks.maze import MazeTask
    from tasks.maze.datasets import DatasetSpec, build_datasets

    task = load_task(obj)
    if not isinstance(task, MazeTask):
        raise click.ClickException(f"rlops data build writes the maze's SkyRL datasets; task.path is {obj.config.task.path}")
    root = Path(out_dir) if out_dir else obj.config.data_path / "datasets"
    spec = DatasetSpec(skyrl_train_count=skyrl_train_count, local_sizes=tuple(task.options.train_sizes),
                       local_eval_size=task.options.eval_size, local_train_count=local_train_count,
                       heldout_count=heldout_count)
    try:
        manifest = build_datasets(root, spec)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"data build failed: {exc}") from None
    for name, info in manifest["files"].items():
        click.echo(f"  {name:<14} {info['rows']:>7} rows  {root / info['path']}")
    for source, info in manifest["eval_sets"].items():
        click.echo(f"  eval {source:<24} seeds {info['seeds'][0]}-{info['seeds'][1]}  layout sha256 {info['layout_sha256']}")


@data_group.command("from-traces")
@click.argument("model")
@click.option("--alias", default=None, help="The version the alias points at now (default: production).")
@click.option("--version", type=click.IntRange(min=1), default=None, help="A version by number.")
@click.option("--since", type=click.DateTime(["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S"]), default=None,
              help="Only traces from this time on (UTC).")
@click.option("--failed-only", is_flag=True, help="Only requests the task scored as failed.")
@click.option("--max-score", type=float, default=None, help="Only requests the task scored at most this.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many prompts.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="New folder for the prompt set (prompts.jsonl, images/, manifest.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_ctx
def data_from_traces(obj: CliContext, model: str, alias: str | None, version: int | None, since, failed_only: bool,
                     max_score: float | None, limit: int | None, out_dir: str, as_json: bool) -> None:
    """Write the prompts a served version was asked (its MLflow traces, scored by the task) as a prompt set
    for `rlops train --local --prompts`, and log it to MLflow as a dataset the traces are linked to."""
    from datetime import timezone

    from training.prompt_sets import PromptSetError, export_traces

    if alias is not None and version is not None:
        raise click.UsageError("--alias and --version name the same thing: give one")
    if failed_only and max_score is not None:
        raise click.UsageError("--failed-only and --max-score are two filters on the score: give one")
    task = load_task(obj)
    with machine_output(as_json) as emit:  # MLflow prints run links on stdout
        try:
            result = export_traces(obj.config, task, model, Path(out_dir), alias=alias, version=version,
                                   since=since.replace(tzinfo=timezone.utc) if since else None,
                                   failed_only=failed_only, max_score=max_score, limit=limit)
        except PromptSetError as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        emit({"path": str(result.path), "name": result.name, "sha256": result.digest, "prompts": result.prompts,
              "failed": result.failed, "traces_read": result.traces_read, "unreadable": result.unreadable,
              "run_id": result.run_id})
        return
    click.echo(f"wrote {result.prompts} prompts ({result.failed} failed) to {result.path}, from {result.traces_read} "
               f"traces read ({result.unreadable} the task could not read back)")
    click.echo(f"dataset {result.name} sha256 {result.digest[:12]} logged to run {result.run_id}")
