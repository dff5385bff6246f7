"""`rlops demo`: train -> track -> register -> promote -> serve -> answer, on embedded defaults."""
from __future__ import annotations

import click

from rlops.commands.context import CliContext, machine_output, pass_ctx, verbose_option


@click.command("demo")
@click.option("--fast", is_flag=True, help="Tiny base without SFT and a few GRPO steps (CI: under 4 minutes).")
@click.option("--task", "task", default=None, metavar="NAME",
              help="Run the loop on another task: a shipped one (maze, shapes) or 'package.module:Class'; its "
                   "runs go to the experiment and registered model <name>-grpo.")
@click.option("--json", "as_json", is_flag=True, help="Stdout: the summary as one JSON document; the stage lines go to stderr.")
@verbose_option
@pass_ctx
def demo_command(obj: CliContext, fast: bool, task: str | None, as_json: bool, verbose: bool) -> None:
    """Run the whole loop on this machine; leaves MLflow, S3, hooks and the endpoint running (`rlops down` stops them)."""
    from rlops.demo import DemoError, for_task, run_demo, where_to_look
    from rlops.processes import ProcessError, log_path
    from rlops.stack import StackError
    from rlops.task import TaskError
    from rlops.terminal import quiet

    config, env = obj.config, {}
    try:
        if task is not None:
            config, env = for_task(config, task)
        config.load_task()
    except TaskError as exc:
        raise click.BadParameter(str(exc), param_hint="--task" if task else "task.path") from None
    log = log_path(config.data_path, "demo")
    with machine_output(as_json) as emit, quiet(log, verbose=verbose, on_stderr=as_json) as terminal:
        if not verbose:
            terminal.line(f"details and library output: {log}")
        try:
            summary = run_demo(config, fast=fast, terminal=terminal, config_path=obj.path, env=env)
        except (DemoError, ProcessError, StackError) as exc:
            raise click.ClickException(f"demo stopped: {exc}\nDetails: {log}. Everything it started is still "
                                       "recorded; `rlops down` stops it.") from None
        terminal.line(where_to_look(config, summary))
    if as_json:
        emit(summary.to_dict())
