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
    from registry_hooks.service import serve
    from registry_hooks.subscriptions import HooksError, webhook_url

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
    """Create or update the MLflow webhook that posts alias events to hooks.public_url; warn of webhooks on
    the same events whose URL does not answer (each delays every delivery)."""
    from registry_hooks.subscriptions import HooksError, check_webhooks, register_webhook, webhook_url

    try:
        webhook_id = register_webhook(obj.config)
        checks = check_webhooks(obj.config)
    except HooksError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"webhook {webhook_id} -> {webhook_url(obj.config)} (model_version_alias.created/.deleted)")
    echo_dead_webhooks(checks)


def echo_dead_webhooks(checks) -> None:
    """On stderr: the webhooks on alias events whose URL does not answer, and how to remove them."""
    from registry_hooks.subscriptions import PRUNE_HINT

    dead = [check for check in checks if not check.answers]
    if dead:
        click.echo(f"warning: {len(dead)} webhook(s) on alias events do not answer; MLflow retries each delivery "
                   f"to them for seconds, which delays every live webhook; {PRUNE_HINT}:", err=True)
        for check in dead:
            click.echo(f"  {check.webhook_id}  {check.name}  {check.url}  ({check.detail})", err=True)


@hooks_group.command("prune")
@click.option("--yes", is_flag=True, help="Delete without asking.")
@pass_ctx
def hooks_prune(obj: CliContext, yes: bool) -> None:
    """Delete the MLflow webhooks on alias events whose URL does not answer (each one it deletes is printed)."""
    from registry_hooks.subscriptions import HooksError, check_webhooks, prune_webhooks

    try:
        dead = [check for check in check_webhooks(obj.config) if not check.answers]
        if not dead:
            click.echo("every webhook on alias events answers; nothing to delete")
            return
        for check in dead:
            click.echo(f"  {check.webhook_id}  {check.name}  {check.url}  ({check.detail})")
        if not yes:
            click.confirm(f"delete these {len(dead)} webhook(s)?", abort=True)
        deleted = prune_webhooks(obj.config)
    except HooksError as exc:
        raise click.ClickException(str(exc)) from None
    for check in deleted:
        click.echo(f"deleted webhook {check.webhook_id} ({check.name} -> {check.url})")
