"""`rlops base build`, `rlops train --local` (the local CPU trainer, training.local_trainer) and
`rlops train --skyrl-dry-run` (the production SkyRL recipe shrunk to minutes on CPU, training.skyrl_dry_run)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import click

from rlops.commands.context import CliContext, load_task, machine_output, pass_ctx, verbose_option


@click.group("base")
def base_group() -> None:
    """The local trainer's base model."""


@base_group.command("build")
@pass_ctx
def base_build(obj: CliContext) -> None:
    """Build the tiny offline Qwen3-VL and SFT-warm-start it on the task's demonstrations (cached in the
    data dir; a set `training.local.base_model` is only checked against this machine)."""
    from training.base import TrainingError, ensure_base

    task = load_task(obj)
    try:
        path = ensure_base(obj.config, task, log=click.echo)
    except TrainingError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"base model: {path}")


@click.command("train")
@click.option("--local", "local", is_flag=True, help="Train on this machine (TRL GRPO + LoRA on CPU).")
@click.option("--skyrl-dry-run", "dry_run", is_flag=True,
              help="Run the production SkyRL recipe (mlflow.yaml) for a few steps on this machine's CPU with the "
              "tiny Qwen3-VL and the real tracker; says what only the GPU job checks.")
@click.option("--steps", type=click.IntRange(1, 1_000_000), default=None,
              help="GRPO steps (default: training.local.steps; --skyrl-dry-run: 3).")
@click.option("--budget", "budget_s", type=click.FloatRange(min=1.0), default=None,
              help="Time budget in seconds for GRPO (default: training.local.budget_s).")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Checkpoint/output folder (default: a new <data_dir>/runs/<timestamp>). An existing one whose "
              "run did not finish is resumed from its latest checkpoint; one whose run FINISHED starts a new run.")
@click.option("--resume", "resume", flag_value=True, default=None,
              help="Continue the run in --run-dir even if it FINISHED (e.g. with more --steps).")
@click.option("--new-run", "resume", flag_value=False,
              help="Start a new MLflow run in --run-dir even if its run did not finish (its checkpoints move aside).")
@click.option("--run-name", default=None, help="MLflow name of a new run (default: grpo-<base>-r<rank>-<date>).")
@click.option("--fast", is_flag=True, help="Skip SFT: random-init tiny base (smoke tests).")
@click.option("--json", "as_json", is_flag=True,
              help="Stdout: the result as one JSON document (keys: README, 'rlops train --local --json'); "
              "messages go to stderr.")
@click.option("--prompts", "prompts_dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="A prompt set from `rlops data from-traces`: part of the GRPO prompts (a dataset input of the run).")
@click.option("--prompts-share", type=click.FloatRange(0, 1, min_open=True), default=0.5, show_default=True,
              help="Share of the GRPO prompts taken from --prompts; the rest are the task's own.")
@verbose_option
@pass_ctx
def train(obj: CliContext, local: bool, dry_run: bool, steps: int | None, budget_s: float | None,
          run_dir: str | None, resume: bool | None, run_name: str | None, fast: bool, as_json: bool,
          prompts_dir: str | None, prompts_share: float, verbose: bool) -> None:
    """Train a LoRA adapter with GRPO on the configured task and register the best checkpoint (alias `candidate`)."""
    if dry_run:
        if local:
            raise click.UsageError("--local and --skyrl-dry-run are two different trainers: pick one")
        return skyrl_dry_run(obj, steps, run_dir, as_json)
    if prompts_dir is not None and not local:
        raise click.UsageError("--prompts trains the local trainer: add --local")
    if not local:
        raise click.ClickException(
            "the production job runs on a Ray cluster: submit it with `bash training/train_job.sh` "
            "(see its header); use `rlops train --local` to train on this machine")
    from training.base import TrainingError
    from training.local_trainer import train as run_training

    from rlops.terminal import quiet
    from tracker.lock import RunDirBusy

    if resume is not None and not run_dir:
        raise click.UsageError("--resume and --new-run need --run-dir (the default is a new folder)")
    load_task(obj)  # a wrong task.path or task.options fails here, before anything is built
    prompts = None
    if prompts_dir is not None:
        from training.prompt_sets import PromptSetError, load_prompt_set

        try:
            prompts = load_prompt_set(Path(prompts_dir))
        except PromptSetError as exc:
            raise click.ClickException(str(exc)) from None
    folder = Path(run_dir) if run_dir else obj.config.data_path / "runs" / time.strftime("%Y%m%d-%H%M%S")
    log = folder / "train.log"
    with machine_output(as_json) as emit, quiet(log, verbose=verbose, on_stderr=as_json) as terminal:
        if not verbose:
            terminal.line(f"details and library output: {log}")
        try:
            result = run_training(obj.config, folder, budget_s=budget_s, steps=steps, fast=fast, resume=resume,
                                  run_name=run_name, log=terminal.line, report=lambda p: terminal.live(p.line()),
                                  prompts=prompts, prompts_share=prompts_share)
        except (TrainingError, RunDirBusy) as exc:
            raise click.ClickException(f"{exc} (details: {log})") from None
    if as_json:
        emit(result.to_dict())
        return
    click.echo(f"run {result.run_id}: {result.steps} GRPO steps in {result.seconds:.0f} s "
               f"({result.seconds_per_step:.2f} s/step)")
    for label, points in (("greedy", result.curve), ("sampled pass@1", result.sampled_curve)):
        if points:
            curve = ", ".join(f"{step}: {rate:.3f}" for step, rate in points)
            click.echo(f"eval {result.eval_data_source} {label} pass rate by step: {curve}")
    if result.offline:
        click.echo(f"tracked offline: `rlops runs sync {folder}` (or `rlops runs export {folder} -o run.tgz` to "
                   "carry it) sends the run to MLflow, where the best checkpoint is registered")
        return
    if result.registration_refused:
        click.echo(f"registered version: none: {result.registration_refused}")
        return
    pending = ("(none: no checkpoint was evaluated, or the registration waits for pending uploads: "
               f"`rlops runs status {folder}`)")
    click.echo(f"registered version: {result.registered_version or pending}")


def skyrl_dry_run(obj: CliContext, steps: int | None, run_dir: str | None, as_json: bool) -> None:
    from training.skyrl_cpu import CPUModeError
    from training.skyrl_dry_run import DEFAULT_STEPS, run_dry_run, runs_as_ray_job

    folder = Path(run_dir) if run_dir else obj.config.data_path / "skyrl-dry-run" / time.strftime("%Y%m%d-%H%M%S")
    with machine_output(as_json) as emit:
        try:
            result = run_dry_run(obj.config, folder, steps=steps or DEFAULT_STEPS,
                                 join_cluster=runs_as_ray_job(os.environ), log=click.echo)
        except CPUModeError as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        emit(result.to_dict())
        return
    click.echo(f"SkyRL dry run: {result.steps} GRPO steps in {result.seconds:.0f} s; folder {result.folder}")
    click.echo(f"MLflow run:  {result.run_url}")
    click.echo("  metrics: reward/*, policy/*, generate/*, environment/*, timing/*; eval/<data_source>/*; "
               "LoggedModels with sha256 tags per checkpoint and HF export")
    click.echo(f"registered version: none (a dry run leaves the registry alone); the GPU job registers the "
               f"checkpoint with the best {result.registration_key} into {obj.config.registered_model}")
    click.echo("checked on GPU only: " + "; ".join(result.checked_on_gpu_only))
