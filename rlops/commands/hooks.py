"""`rlops hooks serve` (webhook receiver + reconciler, foreground) and `rlops hooks register`."""
from __future__ import annotations

import click

from rlops.commands.context import CliContext, pass_ctx
from rlops.processes import forget, record_current_process

PROCESS_NAME = "hooks"


@click.group("hooks")
def hooks_group() -> None:
    """Promotion triggers: MLflow webhook receiver and the reconciler loop."""


@hooks_group.command("serve")
@pass_ctx
def hooks_serve(obj: CliContext) -> None:
    """Receive alias webhooks and reconcile every hooks.reconcile_interval_s (Ctrl-C or `rlops down` stops it)."""
    from registry_hooks.service import HooksError, serve, webhook_url

    config = obj.config
    url = f"http://{config.hooks.host}:{config.hooks.port}"
    record_current_process(config.data_path, PROCESS_NAME, urls={"hooks": url})
    click.echo(f"hooks at {url} (webhook {webhook_url(config) if config.hooks.webhook_enabled else 'off'}, "
               f"reconcile every {config.hooks.reconcile_interval_s:g}s)")
    try:
        serve(config)
    except HooksError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        forget(config.data_path, PROCESS_NAME)


@hooks_group.command("register")
@pass_ctx
def hooks_register(obj: CliContext) -> None:
    """Create or update the MLflow webhook that posts alias events to hooks.public_url."""
    from registry_hooks.service import HooksError, register_webhook, webhook_url

    try:
        webhook_id = register_webhook(obj.config)
    except HooksError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"webhook {webhook_id} -> {webhook_url(obj.config)} (model_version_alias.created/.deleted)")
