"""The `promote` CLI end to end against the real stack: alias moves, guardrail, rollback, list/status, exit codes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from registry_hooks.cli import main as promote_cli
from rlops.layout import version_folder

from conftest import write_config
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
    assert tags["serving.promoted_by"] == "alice" and tags["serving.trigger"] == "cli"
    assert tags["serving.folder"] == version_folder(model, v2)

    # Guardrail: v3 scores worse than production's v2 -> refused (exit 4), alias untouched; --force passes.
    code, _, err = cli(model, "--version", str(v3), "--to", "production")
    assert code == 4 and "does not beat the current" in err and "--force" in err
    assert mlflow_client.get_model_version_by_alias(model, "production").version == str(v2)
    code, _, _ = cli(model, "--version", str(v3), "--to", "production", "--force")
    assert code == 0 and read_manifest(stack, test_config).aliases["production"].version == v3
    assert mlflow_client.get_model_version(model, str(v3)).tags["rlops.force"].startswith("alice at ")

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


def test_promote_sync_unpublishes_models_removed_from_config(stack, test_config, mlflow_client, versions, tmp_path):
    model = test_config.registry.models[0]
    v1 = versions(1, 0.5)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    runner = CliRunner()
    path = write_config(tmp_path / "all.yaml", test_config.model_dump(exclude_none=True))
    result = runner.invoke(promote_cli, ["--config", str(path), "sync", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["reports"][0]["served"] == {"production": v1}

    narrowed = test_config.model_copy(deep=True)
    narrowed.registry.models = [f"{model}-successor"]
    path = write_config(tmp_path / "narrowed.yaml", narrowed.model_dump(exclude_none=True))
    result = runner.invoke(promote_cli, ["--config", str(path), "sync", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["retired"] == [model]
    assert read_manifest(stack, test_config) is None
