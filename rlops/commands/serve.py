"""`rlops serve`: the OpenAI endpoint on Ray Serve LLM (foreground), or its RayService config."""
from __future__ import annotations

import os

import click
import yaml

from rlops.commands.context import CliContext, pass_ctx, verbose_option
from rlops.processes import forget, log_path, record_current_process


@click.command("serve")
@click.option("--print-config", is_flag=True, help="Print the RayService serveConfigV2 YAML (secrets as references) and exit.")
@verbose_option
@pass_ctx
def serve_command(obj: CliContext, print_config: bool, verbose: bool) -> None:
    """Serve registry aliases as OpenAI models on http://<serving.host>:<serving.port>/v1 (Ctrl-C or `rlops down` stops it)."""
    import serving
    from rlops.config import ConfigError
    from rlops.terminal import quiet

    config = obj.config
    try:
        if print_config:
            click.echo(yaml.safe_dump(serving.serve_config_v2(config), sort_keys=False).rstrip())
            return
        url = f"http://{config.serving.host}:{config.serving.port}/v1"
        record_current_process(config.data_path, "serve", urls={"openai": url})
        log = log_path(config.data_path, "serve")
        with quiet(log, verbose=verbose) as terminal:
            if not verbose:
                terminal.line(f"details and Ray's output: {log}")
            terminal.line(f"serving {config.serving.base_model_id} at {url} (adapters from {config.lora_path})")
            serving.run(config, os.environ, on_ready=lambda: terminal.line(f"ready: {url} answers (vLLM replica loaded)"))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if not print_config:
            forget(config.data_path, "serve")
