"""`promote`: move a served alias to a registered version, safely (copy + verify first, then the alias).

  promote MODEL --version N --to production      promote MODEL --from staging --to production
  promote rollback MODEL [--alias production]    promote list [MODEL]      promote status
  promote sync [MODEL]                           promote gc [--dry-run]
  promote retire MODEL [--dry-run]               (the only way a model's routes are unpublished)
  promote verify MODEL [--alias A | --version N] [--endpoint URL]
  promote canary MODEL --version N --weight W [--alias production]   (W percent of clients get vN)
  promote canary MODEL (--promote | --abort) [--alias production]
  promote history MODEL [--alias A] [--json]
Every move takes --reason TEXT (recorded in the history) and --wait [--timeout S] (return once the endpoint's
/v1/models lists the new version). `promote ... --to` and `canary --version/--promote` take --verify: the
candidate is published as @v<N> (no alias moves) and its eval set replayed through the endpoint first; a
guarded alias refuses a served score below the tracked one or the current target's (registry.guardrail_served_margin).
The actor in the history is the authenticated MLflow user (server.auth), else `os:<user>`.

Exit codes: 0 done; 1 error (MLflow/S3 unreachable, ...); 2 usage; 3 unknown model/version/alias (or --verify:
no tracked eval table); 4 refused (invalid adapter, the eval guardrail without --force, or the live eval gate
of --verify without --force); 5 sync did not converge;
6 `status` found drift (registry intent != served manifest) or refusals; 7 `verify` found served answers
that differ from the tracked eval; 8 MLflow refused the authenticated user the permission the move needs
(EDIT on the registered model; nothing was changed).
"""
from __future__ import annotations

import getpass
import json
import os
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Mapping, NoReturn

import click

if TYPE_CHECKING:
    from rlops.config import Config
    from registry_hooks.operations import LiveGate
    from registry_hooks.sync import SyncReport

EXIT_DRIFT = 6
EXIT_PARITY = 7


class PromoteGroup(click.Group):
    """`promote MODEL ... --to ALIAS` (no subcommand name) is the alias move; any other word must be a
    subcommand, so a typo such as `promote stauts` is a usage error, not a model name."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        index = 0
        while index < len(args) and args[index].startswith("-"):
            index += 2 if args[index] == "--config" else 1
        moves = any(a == "--to" or a.startswith("--to=") for a in args[index:])
        if index < len(args) and args[index] not in self.commands and moves:
            args = [*args[:index], "to", *args[index:]]
        return super().parse_args(ctx, args)


class ShadowGroup(click.Group):
    """`promote shadow MODEL ...` (no subcommand name) starts, reshares or stops a shadow; `promote shadow
    status MODEL` shows its evidence."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["start", *args]
        return super().parse_args(ctx, args)


def actor(config: Config, environ: Mapping[str, str] = os.environ) -> str:
    """Who moves, for the history and audit tags. With tracking auth configured (`server.auth`) every request of
    this command is authenticated by MLflow as the basic-auth user, so that user is the actor. Without it nobody
    is authenticated and MLFLOW_TRACKING_USERNAME would be free text: the OS user, marked `os:`."""
    user = environ.get("MLFLOW_TRACKING_USERNAME")
    return user if config.server.auth and user else f"os:{getpass.getuser()}"


@contextmanager
def handled(as_json: bool) -> Iterator[None]:
    from registry_hooks.sync import PromotionError
    from rlops.config import ConfigError

    try:
        yield
    except PromotionError as exc:
        _fail(str(exc), exc.exit_code, as_json)
    except ConfigError as exc:
        _fail(str(exc), 2, as_json)
    except Exception as exc:  # noqa: BLE001 - MLflow/S3 outages: one line, exit 1, no traceback
        _fail(f"{type(exc).__name__}: {exc}", 1, as_json)


def _fail(message: str, code: int, as_json: bool) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"error": message, "exit_code": code}))
    click.echo(f"promote: {message}", err=True)
    sys.exit(code)


def _config(ctx: click.Context, as_json: bool) -> Config:
    from rlops.config import ConfigError, load_config

    try:
        return load_config(ctx.obj)
    except ConfigError as exc:
        _fail(str(exc), 2, as_json)


@contextmanager
def progress_bar(enabled: bool) -> Iterator:
    from tqdm import tqdm

    with tqdm(unit="B", unit_scale=True, desc="copying", file=sys.stderr, disable=None if enabled else True,
              leave=False) as bar:
        yield bar.update


def _print_report(report: SyncReport, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    served = ", ".join(f"{a} -> v{v}" + (f" (canary v{report.canaries[a]['version']} at "
                                          f"{report.canaries[a]['weight']:g}%)" if a in report.canaries else "")
                       for a, v in sorted(report.served.items())) or "(no aliases)"
    click.echo(f"{report.model}: {served}  [generation {report.generation}, {report.trigger}]")
    for alias, shadow in sorted(report.shadows.items()):
        click.echo(f"  shadow   {alias}: v{shadow['version']} gets a copy of {shadow['percent']:g}% of its requests")
    for alias, version in sorted(report.promoted.items()):
        click.echo(f"  promoted {alias} -> v{version} ({report.copy_mode}, {report.bytes_copied / 1e6:.1f} MB copied)")
    for alias, refusal in sorted(report.refused.items()):
        click.echo(f"  refused  {alias} -> v{refusal['version']}: {refusal['reason']}")
    for alias in report.removed:
        click.echo(f"  removed  {alias} (alias deleted in the registry)")
    if report.verify:
        v = report.verify
        current = (f"; current v{v['current_version']} served {v['current_served_pass_rate']:.4f}"
                   if v["current_served_pass_rate"] is not None else "")
        click.echo(f"  verified {v['served_name']} on {v['data_source']} ({v['items']} items): served "
                   f"{v['served_pass_rate']:.4f}, tracked {v['tracked_pass_rate']:.4f}{current}; margin {v['margin']:g}")
        for note in v["notes"]:
            click.echo(f"  note: {note}")
    for warning in report.warnings:
        click.echo(f"  note: {warning}")


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
dry_run_option = click.option("--dry-run", is_flag=True, help="Validate and show the plan; change nothing.")
reason_option = click.option("--reason", help="Why: recorded in the history (`promote history`).")


verify_option = click.option("--verify", is_flag=True, help="First publish the candidate as @v<N>, replay its eval "
                             "set through the endpoint, and (guarded alias) refuse a worse served score.")
endpoint_option = click.option("--endpoint", help="OpenAI endpoint (default: http://<serving.host>:<serving.port>).")


def wait_options(fn):
    fn = click.option("--timeout", "wait_timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
                      help="Seconds --wait (and --verify, for the endpoint to serve @v<N>) waits.")(fn)
    return click.option("--wait", is_flag=True, help="Return once the endpoint's /v1/models lists the new version "
                        "(exit 1 after --timeout).")(fn)


def endpoint_of(config: Config) -> str:
    return f"http://{config.serving.host}:{config.serving.port}"


def live_gate(config: Config, verify: bool, endpoint: str | None, timeout_s: float) -> LiveGate | None:
    from registry_hooks.operations import LiveGate
    from rlops.config import serving_api_key

    return LiveGate(endpoint or endpoint_of(config), serving_api_key(config), timeout_s) if verify else None


def wait_for(config: Config, report: SyncReport, alias: str, *, canary: bool, timeout_s: float) -> None:
    """--wait: poll /v1/models until the alias (or its canary) is listed at what the sync published."""
    from registry_hooks.operations import wait_served
    from rlops.config import serving_api_key

    version = report.canaries.get(alias, {}).get("version") if canary else report.served.get(alias)
    if version is None:
        return  # nothing to wait for (a dropped canary): the report says what is served
    name = f"{config.serving.base_model_id}:{report.model}@{alias}"
    seconds = wait_served(endpoint_of(config), name, version, canary=canary, timeout_s=timeout_s,
                          api_key=serving_api_key(config))
    report.warnings.append(f"the endpoint lists {name} at v{version}{' as canary' if canary else ''} "
                           f"after {seconds:g} s")


@click.group(cls=PromoteGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="RLOPS_CONFIG",
              help="Config file (default: ./mlflow.yaml, else embedded defaults).")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """Promote registered adapter versions to served aliases (registry alias -> immutable S3 folder).

    \b
      promote MODEL --version N --to production     [--force] [--dry-run] [--json]
      promote MODEL --from staging --to production

    Exit codes: 0 done, 1 error, 2 usage, 3 unknown model/version/alias, 4 refused (invalid adapter, eval
    guardrail, the live eval gate of --verify, or the shadow gate of --require-shadow), 5 no convergence,
    6 status found drift or refusals, 7 verify found served answers that differ from the tracked eval,
    8 MLflow denied the move (permissions).
    """
    ctx.obj = config_path


def shadow_gate_options(fn):
    fn = click.option("--max-p", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=None,
                      help="With --require-shadow: refuse a shadow that loses with a sign-test p below this "
                      "(default: registry.shadow.max_p).")(fn)
    fn = click.option("--min-pairs", type=click.IntRange(min=1), default=None,
                      help="With --require-shadow: scored pairs needed (default: registry.shadow.min_pairs).")(fn)
    return click.option("--require-shadow", is_flag=True, help="Refuse unless the version is the alias's shadow "
                        "and its live pairs do not show it worse (`promote shadow status`).")(fn)


def shadow_gate_of(config: Config, require: bool, min_pairs: int | None, max_p: float | None):
    from registry_hooks.operations import ShadowGate

    if not require:
        return None
    defaults = config.registry.shadow
    return ShadowGate(min_pairs or defaults.min_pairs, max_p or defaults.max_p)


@main.command("to", hidden=True)
@click.argument("model")
@click.option("--to", "to_alias", required=True, help="Served alias to move (e.g. production).")
@click.option("--version", type=click.IntRange(min=1), help="Registered version to promote.")
@click.option("--from", "from_alias", help="Promote the version this alias points at (e.g. staging).")
@click.option("--force", is_flag=True, help="Pass the eval-metric guardrail: tags the version rlops.force (who, when).")
@reason_option
@verify_option
@shadow_gate_options
@endpoint_option
@wait_options
@dry_run_option
@json_option
@click.pass_context
def to_command(ctx, model, to_alias, version, from_alias, force, reason, verify, require_shadow, min_pairs, max_p,
               endpoint, wait, wait_timeout, dry_run, as_json) -> None:
    """promote MODEL (--version N | --from ALIAS) --to ALIAS"""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    with handled(as_json), progress_bar(not as_json) as progress:
        report = operations.promote(config, model, to_alias=to_alias, version=version, from_alias=from_alias,
                                    force=force, actor=actor(config), reason=reason, dry_run=dry_run, progress=progress,
                                    gate=live_gate(config, verify, endpoint, wait_timeout),
                                    shadow_gate=shadow_gate_of(config, require_shadow, min_pairs, max_p))
        if wait and not dry_run:
            wait_for(config, report, to_alias, canary=False, timeout_s=wait_timeout)
    _print_report(report, as_json)


@main.command("canary")
@click.argument("model")
@click.option("--alias", help="Served alias whose traffic is split (default: registry.default_alias).")
@click.option("--version", type=click.IntRange(min=1), help="The canary version.")
@click.option("--weight", type=float, help="Percent of the alias's clients (0 < W < 100) that get the canary.")
@click.option("--promote", "promote_it", is_flag=True, help="Make the canary the alias's whole target.")
@click.option("--abort", is_flag=True, help="Drop the canary; the alias keeps its target.")
@click.option("--force", is_flag=True, help="--promote past the eval-metric guardrail (tags the version rlops.force); "
              "with --verify, past the live eval gate.")
@reason_option
@verify_option
@shadow_gate_options
@endpoint_option
@wait_options
@dry_run_option
@json_option
@click.pass_context
def canary_command(ctx, model, alias, version, weight, promote_it, abort, force, reason, verify, require_shadow,
                   min_pairs, max_p, endpoint, wait, wait_timeout, dry_run, as_json) -> None:
    """Send W percent of ALIAS's clients (sticky per client) to version N; then --promote or --abort."""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    if version is not None and weight is None:
        _fail("--version needs --weight W (percent)", 2, as_json)
    alias = alias or config.registry.default_alias
    with handled(as_json), progress_bar(not as_json) as progress:
        report = operations.canary(config, model, alias=alias, version=version, weight=weight, promote_it=promote_it,
                                   abort=abort, force=force, actor=actor(config), reason=reason, dry_run=dry_run,
                                   progress=progress, gate=live_gate(config, verify, endpoint, wait_timeout),
                                   shadow_gate=shadow_gate_of(config, require_shadow, min_pairs, max_p))
        if wait and not dry_run:
            wait_for(config, report, alias, canary=version is not None, timeout_s=wait_timeout)
    _print_report(report, as_json)


@main.group("shadow", cls=ShadowGroup)
def shadow_group() -> None:
    """Copy P percent of ALIAS's requests to version N, whose answers are never returned; score both.

    \b
      promote shadow MODEL --version N --percent P [--alias production]
      promote shadow MODEL --stop
      promote shadow status MODEL [--json]
    """


@shadow_group.command("start", hidden=True)
@click.argument("model")
@click.option("--alias", help="Served alias whose requests are copied (default: registry.default_alias).")
@click.option("--version", type=click.IntRange(min=1), help="The shadow version.")
@click.option("--percent", type=float, help="Percent of the alias's requests copied to the shadow (0 < P <= 100).")
@click.option("--stop", is_flag=True, help="End the shadow.")
@reason_option
@dry_run_option
@json_option
@click.pass_context
def shadow_start_command(ctx, model, alias, version, percent, stop, reason, dry_run, as_json) -> None:
    """promote shadow MODEL (--version N --percent P | --stop)"""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    if version is not None and percent is None:
        _fail("--version needs --percent P", 2, as_json)
    with handled(as_json), progress_bar(not as_json) as progress:
        report = operations.shadow(config, model, alias=alias, version=version, percent=percent, stop=stop,
                                   actor=actor(config), reason=reason, dry_run=dry_run, progress=progress)
    _print_report(report, as_json)


@shadow_group.command("status")
@click.argument("model")
@click.option("--alias", help="Served alias (default: registry.default_alias).")
@json_option
@click.pass_context
def shadow_status_command(ctx, model, alias, as_json) -> None:
    """Pairs so far: wins, losses, ties, the sign test's p, both versions' latency and error rates."""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    with handled(as_json):
        status = operations.shadow_status(config, model, alias=alias)
    if as_json:
        click.echo(json.dumps(status, indent=2))
        return
    click.echo(f"{model}@{status['alias']}: v{status['primary_version']} answers, v{status['shadow_version']} "
               f"shadows {status['percent']:g}% since {status['since']}")
    click.echo(f"  {status['summary']}")


@main.command("history")
@click.argument("model")
@click.option("--alias", help="Only this alias's moves.")
@json_option
@click.pass_context
def history_command(ctx, model, alias, as_json) -> None:
    """Every published move: when, from -> to, canary weight, trigger, actor, reason, eval figure."""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    with handled(as_json):
        entries = operations.history(config, model, alias=alias)
    if as_json:
        click.echo(json.dumps(entries, indent=2))
        return
    for e in entries:
        moved = f"v{e['from_version']} -> v{e['version']}" if e["from_version"] else f"-> v{e['version']}"
        if e["event"] == "canary":
            what = f"canary v{e['version']} at {e['weight']:g}% (beside v{e['from_version']})"
        elif e["event"] == "canary_aborted":
            what = f"canary v{e['version']} dropped"
        elif e["event"] == "shadow":
            what = f"shadow v{e['version']} at {e['weight']:g}% (beside v{e['from_version']})"
        elif e["event"] == "shadow_stopped":
            what = f"shadow v{e['version']} stopped"
        elif e["event"] == "preview":
            what = f"v{e['version']} published as @v{e['version']} (verify)"
        else:
            what = moved + (" (canary promoted)" if e["event"] == "canary_promoted" else "")
        extra = "; ".join(filter(None, [e["eval"], e["reason"] and f"reason: {e['reason']}"]))
        click.echo(f"{e['at']}  {e['alias']:<12} {what:<44} {e['trigger']:<10} {e['actor'] or '-':<16} {extra}")


@main.command("rollback")
@click.argument("model")
@click.option("--alias", help="Alias to roll back (default: registry.default_alias).")
@reason_option
@wait_options
@dry_run_option
@json_option
@click.pass_context
def rollback_command(ctx, model, alias, reason, wait, wait_timeout, dry_run, as_json) -> None:
    """Move ALIAS back to the version it served before, then sync."""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    alias = alias or config.registry.default_alias
    with handled(as_json), progress_bar(not as_json) as progress:
        report = operations.rollback(config, model, alias=alias, actor=actor(config), reason=reason, dry_run=dry_run,
                                     progress=progress)
        if wait and not dry_run:
            wait_for(config, report, alias, canary=False, timeout_s=wait_timeout)
    _print_report(report, as_json)


@main.command("sync")
@click.argument("model", required=False)
@json_option
@click.pass_context
def sync_command(ctx, model, as_json) -> None:
    """Make serving match the registry now, for MODEL or every configured model (the history credits each
    move to whoever made it: this command only publishes)."""
    from registry_hooks.sync import sync_model

    config = _config(ctx, as_json)
    reports = []
    with handled(as_json):
        for name in [model] if model else config.registry.models:
            reports.append(sync_model(config, name, trigger="cli"))
    if as_json:
        click.echo(json.dumps({"reports": [r.to_dict() for r in reports]}, indent=2))
        return
    for report in reports:
        _print_report(report, False)


@main.command("retire")
@click.argument("model")
@dry_run_option
@json_option
@click.pass_context
def retire_command(ctx, model, dry_run, as_json) -> None:
    """Stop serving MODEL (not in registry.models any more): unpublish its routes manifest, keep its folders."""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    with handled(as_json):
        record = operations.retire(config, model, actor=actor(config), dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return
    served = ", ".join(f"{a} -> v{v}" for a, v in sorted(record["served"].items())) or "no aliases"
    verb = "would unpublish" if dry_run else "unpublished"
    click.echo(f"{model}: {verb} its routes manifest (generation {record['generation']}, {served})")


@main.command("list")
@click.argument("model", required=False)
@json_option
@click.pass_context
def list_command(ctx, model, as_json) -> None:
    """Aliases (registry vs served), versions, folders and eval metrics."""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    with handled(as_json):
        models = operations.list_models(config, model)
    if as_json:
        click.echo(json.dumps(models, indent=2))
        return
    for entry in models:
        click.echo(f"{entry['model']} (manifest generation {entry['generation']})")
        for alias, a in entry["aliases"].items():
            registry_v = f"v{a['registry']}" if a["registry"] else "unset"
            served_v = f"v{a['served']} ({a['folder']})" if a["served"] else "nothing"
            click.echo(f"  @{alias:<12} registry {registry_v:<8} served {served_v}")
        for v in entry["versions"]:
            metric = f"{v['metric_key']}={v['metric_value']}" if v["metric_key"] else "no eval metric"
            flags = " ".join(filter(None, [",".join(v["aliases"]), f"refused: {v['refused']}" if v["refused"] else ""]))
            click.echo(f"  v{v['version']:<4} {metric:<48} {flags}")


@main.command("status")
@json_option
@click.pass_context
def status_command(ctx, as_json) -> None:
    """Drift between registry and served manifests, refusals, and the reconciler's health. Exit 6 on drift."""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    with handled(as_json):
        state = operations.status(config)
    troubled = not state["in_sync"] or any(m["refused"] for m in state["models"])
    if as_json:
        click.echo(json.dumps(state, indent=2))
    else:
        for m in state["models"]:
            served = ", ".join(f"{a} -> v{v}" for a, v in sorted(m["served"].items())) or "nothing served"
            click.echo(f"{m['model']}: {served}" + ("" if m["registered"] else " (not in the registry)"))
            for line in m["drift"]:
                click.echo(f"  DRIFT {line}")
            for alias, r in m["refused"].items():
                click.echo(f"  REFUSED {alias} -> v{r['version']}: {r['reason']}")
        rec = state["reconciler"]
        if rec is None:
            click.echo("reconciler: no heartbeat (is `rlops hooks serve` running?)")
        else:
            health = "STALE" if rec.get("stale") else "ok"
            click.echo(f"reconciler: {health}, last sync {rec['last_run_at'] or 'none yet'}, "
                       f"last error: {rec.get('last_error') or rec.get('pass_error') or 'none'}")
            if rec.get("last_pass"):
                p = rec["last_pass"]
                click.echo(f"  last pass {p['finished_at']}: {p['seconds']:.2f} s, {p['models_seen']} models seen, "
                           f"{p['models_synced']} synced ({p['sync_failures']} failed), "
                           f"{p['behind_s']:.1f} s behind the {p['interval_s']:g} s interval")
    sys.exit(EXIT_DRIFT if troubled else 0)


@main.command("gc")
@dry_run_option
@json_option
@click.pass_context
def gc_command(ctx, dry_run, as_json) -> None:
    """Delete version folders nothing names any more (marked collected first; `@vN` then answers 404)."""
    from registry_hooks import operations

    config = _config(ctx, as_json)
    with handled(as_json):
        report = operations.gc(config, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb}: {', '.join(report.deleted) or 'nothing'}")
    click.echo(f"kept (referenced): {len(report.kept)}, kept (younger than grace): {len(report.too_young)}")
    for label, items in (("left for the next gc (lease ran short)", report.unfinished),
                         ("copied back (named again while deleted)", report.restored),
                         ("skipped (manifest owned by another deployment)", report.not_owned)):
        if items:
            click.echo(f"{label}: {', '.join(items)}")


@main.command("verify")
@click.argument("model")
@click.option("--alias", help="Served alias to check (default: registry.default_alias unless --version).")
@click.option("--version", type=click.IntRange(min=1), help="Check this version, pinned as @v<N>.")
@endpoint_option
@json_option
@click.pass_context
def verify_command(ctx, model, alias, version, endpoint, as_json) -> None:
    """Send the version's fixed eval set through the endpoint (greedy) and compare with the tracked eval."""
    from registry_hooks.parity import verify_served
    from rlops.config import serving_api_key

    config = _config(ctx, as_json)
    if alias is None and version is None:
        alias = config.registry.default_alias
    with handled(as_json):
        report = verify_served(config, model, alias=alias, version=version, api_key=serving_api_key(config),
                               endpoint=endpoint or endpoint_of(config))
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        click.echo(f"{report.served_name} (v{report.version}) on {report.data_source}: served {report.served:.4f}, "
                   f"tracked {report.tracked:.4f}; {report.matching}/{report.items} items agree"
                   + (f"; differing seeds: {', '.join(map(str, report.differing))}" if report.differing else ""))
    if report.differing:
        sys.exit(EXIT_PARITY)


if __name__ == "__main__":
    main()
