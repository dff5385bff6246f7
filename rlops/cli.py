"""`rlops`: thin commands that parse, call one library function, and print."""
from __future__ import annotations

import sys

from typing import TYPE_CHECKING

import click

from rlops.commands.context import CliContext, pass_ctx

if TYPE_CHECKING:
    from rlops.config import Config
    from rlops.stack import PartStatus


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="RLOPS_CONFIG",
              help="Config file (default: ./mlflow.yaml, else embedded defaults).")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """MLOps backbone for RL post-training of VLMs: track, promote, serve."""
    ctx.obj = CliContext(config_path)


@main.group("config")
def config_group() -> None:
    """Inspect the effective configuration."""


@config_group.command("show")
@pass_ctx
def config_show(obj: CliContext) -> None:
    """Print the effective config (file + RLOPS_* overrides + defaults), secrets masked."""
    import yaml

    from rlops.config import masked_dict

    click.echo(yaml.safe_dump(masked_dict(obj.config), sort_keys=False).rstrip())


def echo_keys_file(config: Config) -> None:
    import serving
    from rlops.config import ConfigError

    try:
        click.echo(f"  keys file {config.serving.keys_file}: {serving.check_keys_file(config)} keys")
    except ConfigError as exc:
        click.echo(f"  keys file: {exc} (a running endpoint keeps the last good one; a new one will not start)")


def echo_traces(config: Config) -> None:
    import serving

    counts = serving.trace_status(config)
    if isinstance(counts, str):
        click.echo(f"  traces: not counted: {counts}")
    else:
        click.echo(f"  traces at {config.serving.traces.sample_rate:.0%}: {counts['recorded']} recorded "
                   f"({counts['scored']} scored), {counts['dropped']} dropped (queue full), {counts['failed']} failed")


def _print_status(parts: list[PartStatus]) -> None:
    for part in parts:
        state = "healthy" if part.healthy else ("running, unhealthy" if part.running else "down")
        origin = "" if part.managed else " (external)"
        click.echo(f"  {part.name:<8} {state:<18} {part.url}{origin}  {part.detail}")


@main.command()
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for health checks.")
@pass_ctx
def up(obj: CliContext, timeout: float) -> None:
    """Start MLflow, the S3 server (managed parts only) and, with ray.nodes >= 1, a local Ray cluster; wait
    until all are healthy."""
    from rlops import stack

    try:
        parts = stack.up(obj.config, timeout_s=timeout)
    except stack.StackError as exc:
        raise click.ClickException(f"rlops up failed, nothing left running: {exc}") from None
    _print_status(parts)
    click.echo(f"MLflow UI:   {obj.config.tracking_uri}")
    click.echo(f"S3 endpoint: {obj.config.storage.endpoint_url or '(AWS default)'}  bucket: {obj.config.storage.bucket}")
    if obj.config.ray_address:
        click.echo(f"Ray cluster: {obj.config.ray_address} ({obj.config.ray.nodes} nodes), "
                   f"jobs: {obj.config.ray_dashboard_url}")
    unhealthy = [p.name for p in parts if p.name in (*stack.STACK_PARTS, stack.RAY_HEAD) and not p.healthy]
    if unhealthy:
        raise click.ClickException(f"not healthy: {', '.join(unhealthy)} (external parts are not started by rlops)")


@main.command()
@pass_ctx
def down(obj: CliContext) -> None:
    """Stop everything rlops started from this data dir (stack, serving, hooks), and nothing else. The MLflow
    webhook that points at this config's local hooks service goes with it (a dead one delays every delivery)."""
    from rlops import stack

    config = obj.config
    if stack.mlflow_healthy(config.tracking_uri):
        from mlflow.exceptions import MlflowException

        from registry_hooks.subscriptions import forget_local_webhook

        try:
            webhook_id = forget_local_webhook(config)
        except MlflowException as exc:
            click.echo(f"warning: could not delete the local hooks' webhook: {exc.message}", err=True)
        else:
            if webhook_id:
                click.echo(f"deleted webhook {webhook_id} (it pointed at the local hooks service)")
    stopped = stack.down(config)
    click.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@main.command()
@pass_ctx
def status(obj: CliContext) -> None:
    """Report each part of the stack; exit 1 if a managed part is not healthy."""
    from rlops import stack

    parts = stack.status(obj.config)
    _print_status(parts)
    if stack.mlflow_healthy(obj.config.tracking_uri):
        from registry_hooks.subscriptions import HooksError, check_webhooks

        try:
            checks = check_webhooks(obj.config)
        except HooksError as exc:
            click.echo(f"  webhooks: {exc}", err=True)
        else:
            click.echo(f"  webhooks {sum(c.answers for c in checks)}/{len(checks)} on alias events answer")
            echo_dead_webhooks(checks)
    if obj.config.serving.keys_file:
        echo_keys_file(obj.config)
    if obj.config.serving.traces.sample_rate > 0 and any(p.name == "serve" and p.running for p in parts):
        echo_traces(obj.config)
    down = [p.name for p in parts if p.managed and not p.healthy]
    if down:
        click.echo(f"not running: {', '.join(down)} (`rlops up` starts the stack)", err=True)
        sys.exit(1)


from rlops.commands.data import data_group  # noqa: E402
main.add_command(data_group)
from rlops.commands.train import base_group, train  # noqa: E402
main.add_command(base_group)
main.add_command(train)
from rlops.commands.serve import serve_command  # noqa: E402
main.add_command(serve_command)
from rlops.commands.hooks import echo_dead_webhooks, hooks_group  # noqa: E402
main.add_command(hooks_group)

from rlops.commands.demo import demo_command  # noqa: E402
main.add_command(demo_command)
from rlops.commands.runs import runs_group  # noqa: E402
main.add_command(runs_group)


if __name__ == "__main__":
    main()
