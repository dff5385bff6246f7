"""`rlops data build`: write the maze datasets (SkyRL rows, fixed eval sets, local trainer sets)."""
from __future__ import annotations

from pathlib import Path

import click

from rlops.commands.context import CliContext, load_task, pass_ctx


@click.group("data")
def data_group() -> None:
    """Maze datasets for training and evaluation."""


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
