"""The `promote` CLI end to end against the real stack: alias moves, guardrail, rollback, list/status, exit codes."""
from __future__ import annotations

import getpass
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from registry_hooks.cli import main as promote_cli
from rlops.layout import version_folder

from conftest import write_config

# The test stack runs without tracking auth: MLFLOW_TRACKING_USERNAME is free text then, the actor the OS user.
ACTOR = f"os:{getpass.getuser()}"
from test_promotion_support import (  # noqa: F401 - fixtures
    assert_manifest_consistent,
    lora_template,
    read_manifest,
    register_version,
    write_adapter,
)


@pytest.fixture
def cli(test_config, tmp_path):
    """Run `promote ...` in-process with this test's config file; returns (exit code, stdout, stderr)."""
    path = write_config(tmp_path / "mlflow.yaml", test_config.model_dump(exclude_none=True))
    runner = CliRunner()

    def run(*args: str):
        result = runner.invoke(promote_cli, ["--config", str(path), *args],
                               env={"MLFLOW_TRACKING_USERNAME": "alice"}, catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr
    run.config_path = path
    return run


@pytest.fixture
def versions(test_config, lora_template, tmp_path):
    def make(seed: int, metric: float, **kwargs) -> int:
        folder = write_adapter(lora_template, tmp_path / f"a{seed}", test_config, seed=seed, **kwargs)
        return register_version(test_config, folder, step=seed, metric=metric)
    return make


def test_promote_cli_end_to_end(stack, test_config, mlflow_client, versions, cli):
    model = test_config.registry.models[0]
    v1, v2, v3 = versions(1, 0.50), versions(2, 0.75), versions(3, 0.25)

    code, out, _ = cli(model, "--version", str(v1), "--to", "staging", "--json")
    assert code == 0 and json.loads(out)["served"] == {"staging": v1}
    code, out, _ = cli(model, "--from", "staging", "--to", "production")
    assert code == 0 and f"production -> v{v1}" in out
    code, out, _ = cli(model, "--version", str(v2), "--to", "production", "--dry-run")
    assert code == 0 and "dry run" in out
    assert mlflow_client.get_model_version_by_alias(model, "production").version == str(v1)

    code, out, _ = cli(model, "--version", str(v2), "--to", "production")
    assert code == 0, out
    manifest = assert_manifest_consistent(stack, test_config)
    assert manifest.aliases["production"].version == v2
    tags = mlflow_client.get_model_version(model, str(v2)).tags
    assert tags["serving.promoted_by"] == ACTOR and tags["serving.trigger"] == "cli"
    assert tags["serving.folder"] == version_folder(model, v2)

    # Guardrail: v3 scores worse than production's v2 -> refused (exit 4), alias untouched; --force passes.
    code, _, err = cli(model, "--version", str(v3), "--to", "production")
    assert code == 4 and "does not beat the current" in err and "--force" in err
    assert mlflow_client.get_model_version_by_alias(model, "production").version == str(v2)
    code, _, _ = cli(model, "--version", str(v3), "--to", "production", "--force")
    assert code == 0 and read_manifest(stack, test_config).aliases["production"].version == v3
    assert mlflow_client.get_model_version(model, str(v3)).tags["rlops.force"].startswith(f"{ACTOR} at ")

    # Rollback: registry alias first (so the reconciler keeps it), then the manifest.
    code, out, _ = cli("rollback", model, "--json")
    assert code == 0 and json.loads(out)["served"]["production"] == v2
    assert mlflow_client.get_model_version_by_alias(model, "production").version == str(v2)
    assert assert_manifest_consistent(stack, test_config).aliases["production"].trigger == "rollback"

    code, out, _ = cli("list", model, "--json")
    listed = json.loads(out)[0]
    assert code == 0 and listed["aliases"]["production"] == {
        "registry": v2, "served": v2, "folder": version_folder(model, v2)}
    assert [v["version"] for v in listed["versions"]] == [v1, v2, v3]
    assert listed["versions"][1]["metric_value"] == "0.75" and listed["versions"][1]["aliases"] == ["production"]
    code, out, _ = cli("status")
    assert code == 0 and "DRIFT" not in out and "reconciler: no heartbeat" in out

    # Drift: the registry moves without a sync -> status says so and exits 6.
    mlflow_client.set_registered_model_alias(model, "staging", str(v2))
    code, out, _ = cli("status", "--json")
    assert code == 6 and json.loads(out)["models"][0]["drift"] == [f"staging: registry v{v2}, served v{v1}"]


def test_promote_cli_errors_have_specific_messages_and_exit_codes(stack, test_config, versions, cli, mlflow_client):
    model = test_config.registry.models[0]
    v1 = versions(1, 0.5)
    bad = versions(2, 0.9, config_overrides={"r": 128})
    cases = [
        ((model, "--version", "99", "--to", "production"), 3, "version 99"),
        (("not-configured", "--version", "1", "--to", "production"), 3, "is not served"),
        ((model, "--from", "nope", "--to", "production"), 3, "alias 'nope' is not set"),
        ((model, "--version", str(v1), "--to", "canary"), 3, "alias 'canary' is not served"),
        ((model, "--version", str(v1), "--to", "latest"), 2, "not a valid alias"),
        ((model, "--version", str(v1), "--from", "staging", "--to", "production"), 2, "exactly one"),
        ((model, "--version", str(bad), "--to", "production"), 4, "rank 128 is above"),
        (("rollback", model), 3, "no earlier target"),
    ]
    for args, want_code, want_text in cases:
        code, _, err = cli(*args)
        assert (code, want_text in err) == (want_code, True), (args, code, err)
    with pytest.raises(Exception):
        mlflow_client.get_model_version_by_alias(model, "production")  # nothing above moved an alias
    assert mlflow_client.get_model_version(model, str(bad)).tags["serving.refused"].startswith("LoRA rank 128")


def test_promote_console_script_runs(stack, cli):
    """The installed `promote` entry point (not just the click object) answers with the documented exit code."""
    promote = Path(sys.executable).parent / "promote"
    proc = subprocess.run([str(promote), "--config", str(cli.config_path), "status", "--json"],
                          env=stack.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["in_sync"] is True


def test_two_deployments_on_one_prefix_never_remove_each_others_routes(stack, test_config, mlflow_client, lora_template,
                                                                       tmp_path):
    """Neither a config edit, a typo, a full `promote sync` nor a running reconciler of one deployment can
    unpublish another's routes; only an explicit, owned `promote retire` removes a manifest."""
    from registry_hooks.service import Metrics, Reconciler
    from test_promotion_hooks import wait_for

    model_a = test_config.registry.models[0]
    a, b = test_config.model_copy(deep=True), test_config.model_copy(deep=True)
    a.registry.owner, b.registry.owner = "deploy-a", "deploy-b"
    b.registry.models = [f"{model_a}-b"]
    runner = CliRunner()

    def promote(cfg, *args: str, name: str = "cfg"):
        path = write_config(tmp_path / f"{name}.yaml", cfg.model_dump(exclude_none=True))
        result = runner.invoke(promote_cli, ["--config", str(path), *args], env={"MLFLOW_TRACKING_USERNAME": "alice"})
        return result.exit_code, result.stdout, result.stderr

    for cfg, seed in ((a, 1), (b, 2)):
        version = register_version(cfg, write_adapter(lora_template, tmp_path / f"a{seed}", cfg, seed=seed), step=seed)
        mlflow_client.set_registered_model_alias(cfg.registry.models[0], "production", str(version))
        code, out, _ = promote(cfg, "sync", "--json")
        assert code == 0 and json.loads(out)["reports"][0]["served"] == {"production": version}
    assert read_manifest(stack, a).owner == "deploy-a" and read_manifest(stack, b, b.registry.models[0]).owner == "deploy-b"

    typo = a.model_copy(deep=True)
    typo.registry.models = [f"{model_a}-typo"]
    assert promote(typo, "sync", "--json", name="typo")[0] == 0
    reconciler = Reconciler(b.model_copy(update={"hooks": b.hooks.model_copy(update={"reconcile_interval_s": 0.2})}),
                            Metrics())
    passes: set[str] = set()

    def two_passes() -> bool:  # a pass with nothing to sync runs no sync, so count passes, not syncs
        if reconciler.last_pass is not None:
            passes.add(reconciler.last_pass.finished_at)
        return len(passes) >= 2

    reconciler.start()
    try:
        assert wait_for(two_passes, 30) and reconciler.pass_error is None
    finally:
        reconciler.stop()
    assert read_manifest(stack, a) is not None and read_manifest(stack, b, b.registry.models[0]) is not None

    # b cannot write or retire a's manifest; a cannot retire a model it still lists.
    both = b.model_copy(deep=True)
    both.registry.models = [*b.registry.models, model_a]
    code, _, err = promote(both, "sync", model_a, name="both")
    assert code == 4 and "belongs to deployment 'deploy-a'" in err
    code, _, err = promote(b, "retire", model_a, name="b")
    assert code == 4 and "belongs to deployment 'deploy-a'" in err
    code, _, err = promote(a, "retire", model_a, name="a")
    assert code == 2 and "still in registry.models" in err

    # The owner retires it deliberately: a dry run changes nothing, then the manifest goes and a record stays.
    code, out, _ = promote(typo, "retire", model_a, "--dry-run", name="typo")
    assert code == 0 and "would unpublish" in out and read_manifest(stack, a) is not None
    code, out, _ = promote(typo, "retire", model_a, "--json", name="typo")
    assert code == 0 and json.loads(out)["retired_by"] == ACTOR
    assert read_manifest(stack, a) is None and read_manifest(stack, b, b.registry.models[0]) is not None
    record = status_record(stack, a, f"retired-{model_a}")
    assert record["served"] and record["owner"] == "deploy-a"
    assert promote(typo, "retire", model_a, name="typo")[0] == 3  # nothing left to retire


def status_record(stack, config, name: str) -> dict:
    from registry_hooks import storage
    from rlops.layout import parse_s3_uri

    return storage.read_status(stack.s3(), parse_s3_uri(config.lora_path), name)


def test_unknown_verb_is_a_usage_error(cli):
    code, _, err = cli("stauts")
    assert code == 2 and "No such command 'stauts'" in err


def test_canary_cli_reweight_abort_promote_and_history(stack, test_config, mlflow_client, versions, cli):
    model = test_config.registry.models[0]
    v1, v2 = versions(1, 0.50), versions(2, 0.75)
    assert cli(model, "--version", str(v1), "--to", "production")[0] == 0

    code, out, _ = cli("canary", model, "--version", str(v2), "--weight", "10", "--reason", "first look", "--json")
    assert code == 0, out
    assert json.loads(out)["canaries"] == {"production": {"version": v2, "weight": 10}}
    manifest = assert_manifest_consistent(stack, test_config)
    assert manifest.schema_version == 2 and manifest.aliases["production"].version == v1
    assert mlflow_client.get_model_version_by_alias(model, "production-canary").version == str(v2)
    assert mlflow_client.get_registered_model(model).tags["rlops.canary_weight.production"] == "10"
    code, out, _ = cli("canary", model, "--version", str(v2), "--weight", "30")
    assert code == 0 and f"production -> v{v1} (canary v{v2} at 30%)" in out
    code, _, _ = cli("canary", model, "--abort", "--reason", "looked wrong")
    assert code == 0 and read_manifest(stack, test_config).canaries == {}
    assert "rlops.canary_weight.production" not in mlflow_client.get_registered_model(model).tags
    assert cli("canary", model, "--version", str(v2), "--weight", "50")[0] == 0
    code, out, _ = cli("canary", model, "--promote", "--reason", "good numbers")
    assert code == 0, out
    manifest = assert_manifest_consistent(stack, test_config)
    assert manifest.aliases["production"].version == v2 and manifest.canaries == {}
    assert "production-canary" not in mlflow_client.get_registered_model(model).aliases

    # Usage and lookup errors: exit codes, nothing changed.
    for args, expected, message in [
        (("--version", str(v1), "--weight", "100"), 2, "strictly between 0 and 100"),
        (("--version", str(v2), "--weight", "10"), 2, f"already serves v{v2}"),
        (("--version", str(v1)), 2, "needs --weight"),
        (("--promote",), 3, "has no canary"),
        (("--version", "99", "--weight", "5"), 3, "does not exist"),
        (("--version", str(v1), "--weight", "5", "--alias", "nope"), 3, "not served"),
        (("--promote", "--abort"), 2, "exactly one of"),
    ]:
        code, _, err = cli("canary", model, *args)
        assert code == expected and message in err, (args, code, err)
    assert read_manifest(stack, test_config).generation == manifest.generation

    code, out, _ = cli("history", model, "--alias", "production", "--json")
    entries = json.loads(out)
    assert code == 0
    assert [(e["event"], e["version"], e["from_version"], e["weight"], e["actor"], e["reason"]) for e in entries] == [
        ("move", v1, None, None, ACTOR, None), ("canary", v2, v1, 10, ACTOR, "first look"),
        ("canary", v2, v1, 30, ACTOR, None), ("canary_aborted", v2, v2, 0, ACTOR, "looked wrong"),
        ("canary", v2, v1, 50, ACTOR, None), ("canary_promoted", v2, v1, None, ACTOR, "good numbers")]
    assert all(e["trigger"] == "cli" and e["eval"] for e in entries)
    code, out, _ = cli("history", model)
    assert code == 0 and f"v{v1} -> v{v2} (canary promoted)" in out and "reason: good numbers" in out


def test_every_json_output_is_one_document_on_stdout(stack, test_config, versions, cli, tmp_path):
    """Issue 37: with --json, stdout parses as one JSON document (answers and errors alike), for each command."""
    model = test_config.registry.models[0]
    v1, v2 = versions(1, 0.5), versions(2, 0.75)
    answers = [
        (model, "--version", str(v1), "--to", "production"),
        (model, "--version", str(v2), "--to", "production", "--dry-run"),
        (model, "--version", str(v2), "--to", "production"),
        ("canary", model, "--version", str(v1), "--weight", "10"),
        ("canary", model, "--abort"),
        ("history", model),
        ("rollback", model, "--dry-run"),
        ("sync", model),
        ("list", model),
        ("status",),
        ("gc", "--dry-run"),
    ]
    errors = [
        ("retire", model, "--dry-run"),  # still in registry.models
        ("verify", model, "--endpoint", "http://127.0.0.1:9"),  # nothing serves there
        (model, "--version", "99", "--to", "production"),  # an unknown version
    ]
    for args in answers + errors:
        code, out, err = cli(*args, "--json")
        document = json.loads(out)  # raises on anything else on stdout
        is_error = isinstance(document, dict) and "error" in document
        assert is_error == (args in errors) and (document["exit_code"] == code != 0 if is_error else code == 0), \
            (args, code, out, err)
    broken = write_config(tmp_path / "broken.yaml", {"serving": {"prot": 1}})
    bad = CliRunner().invoke(promote_cli, ["--config", str(broken), "status", "--json"])
    assert bad.exit_code == 2 and "serving.prot" in json.loads(bad.stdout)["error"]
