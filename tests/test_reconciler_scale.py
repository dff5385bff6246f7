"""The reconciler pass at a few hundred registered models, against the real MLflow server and SeaweedFS:
a pass with nothing to do makes no per-model registry or S3 request (counted at the clients), a moved
alias among many is synced in the next pass, and refusals are still recorded (and stay sticky)."""
from __future__ import annotations

import math
import sys
from collections import Counter

import mlflow.utils.rest_utils as rest_utils
import pytest

from registry_hooks.sync import sync_model
from registry_hooks.reconcile import ManifestCache, run_pass
from registry_hooks.registry import name_filters
from registry_hooks.sync import Promoter

from conftest import REPO
from test_promotion_support import assert_manifest_consistent, read_manifest, register_version, write_adapter  # noqa: F401
from test_promotion_support import lora_template  # noqa: F401

sys.path.insert(0, str(REPO / "bench"))
from _many_models import move_aliases, register_models  # noqa: E402

MODELS = 50  # the bench covers 1k and 10k; the claim here (no per-model request) holds at any count


class Requests:
    """Every MLflow REST call (endpoint, model name) and S3 call (operation, key) a pass makes."""

    def __init__(self, monkeypatch, s3_client):
        self.mlflow: list[tuple[str, str | None]] = []
        self.s3: list[tuple[str, str | None]] = []
        real = rest_utils.http_request

        def counted(host_creds, endpoint, method, *args, **kwargs):
            body = kwargs.get("params") or kwargs.get("json") or {}
            self.mlflow.append((endpoint, body.get("name")))
            return real(host_creds, endpoint, method, *args, **kwargs)

        monkeypatch.setattr(rest_utils, "http_request", counted)
        s3_client.meta.events.register("provide-client-params.s3", self._on_s3)

    def _on_s3(self, model, params, **kwargs):
        self.s3.append((model.name, params.get("Key")))

    def clear(self) -> None:
        self.mlflow.clear()
        self.s3.clear()

    def per_model(self) -> set[str]:
        """Models named by a registry request or a manifest GET (bulk searches and listings name none)."""
        return {n for _, n in self.mlflow if n} | {k.rsplit("/", 1)[-1].removesuffix(".json")
                                                  for op, k in self.s3 if op == "GetObject" and k}


def syncs(config):
    def sync(model: str) -> bool:
        sync_model(config, model, trigger="reconciler")
        return True
    return sync


@pytest.mark.slow  # most of it registering the models and publishing their first folders
def test_noop_pass_makes_no_per_model_request_and_changes_are_synced(
        stack, test_config, mlflow_client, lora_template, tmp_path, monkeypatch, unique_name):
    # One real adapter version (LoggedModel with the tracker's sha256 tags); every generated model's v1 is it.
    seed = register_version(test_config, write_adapter(lora_template, tmp_path / "a1", test_config, seed=1))
    model_id = mlflow_client.get_model_version(test_config.registry.models[0], str(seed)).source[len("models:/"):]
    bad = register_version(test_config, write_adapter(lora_template, tmp_path / "a2", test_config, seed=2),
                           checksums={"adapter_config.json": "0" * 64, "adapter_model.safetensors": "0" * 64})
    bad_id = mlflow_client.get_model_version(test_config.registry.models[0], str(bad)).source[len("models:/"):]
    names = [f"scale-{unique_name[-6:]}-{i:04d}" for i in range(MODELS)]
    register_models(stack.tracking_uri, names, model_id)
    cfg = test_config.model_copy(deep=True)
    cfg.registry.models = names
    cfg.hooks.reconcile_concurrency = 8

    promoter = Promoter(cfg)
    requests = Requests(monkeypatch, promoter.dest)
    cache = ManifestCache()
    first = run_pass(promoter, cache, syncs(cfg), cfg.hooks.reconcile_concurrency)
    assert first.models_seen == first.models_registered == first.models_synced == MODELS and first.sync_failures == 0
    for name in (names[0], names[-1]):
        assert assert_manifest_consistent(stack, cfg, name).aliases["production"].version == 1

    print(f"first pass, {MODELS} folders published: {first.seconds:.1f}s")
    # The next pass fetches the manifests the first one published (new ETags) and finds nothing to sync.
    settle = run_pass(promoter, cache, syncs(cfg), cfg.hooks.reconcile_concurrency)
    assert settle.manifests_fetched == MODELS and settle.models_synced == 0

    # Nothing changed: a handful of bulk requests, none about one model, no manifest fetched.
    requests.clear()
    idle = run_pass(promoter, cache, syncs(cfg), cfg.hooks.reconcile_concurrency)
    assert idle.models_synced == 0 and idle.manifests_fetched == 0 and idle.models_seen == MODELS
    searches = len(name_filters(names))
    assert Counter(e for e, _ in requests.mlflow) == {"/api/2.0/mlflow/registered-models/search": searches}
    assert Counter(op for op, _ in requests.s3) == {"ListObjectsV2": math.ceil(MODELS / 1000)}
    assert requests.per_model() == set()
    print(f"no-op pass over {MODELS} models: {idle.seconds:.2f}s, {searches} registry searches, 1 S3 listing")

    # One alias moves to a good version, another to a version whose checksums do not match its files.
    moved, refused = names[17], names[-9]
    new_versions = move_aliases(stack.tracking_uri, [moved], model_id)
    move_aliases(stack.tracking_uri, [refused], bad_id)
    requests.clear()
    changed = run_pass(promoter, cache, syncs(cfg), cfg.hooks.reconcile_concurrency)
    assert changed.models_synced == 2 and changed.sync_failures == 0
    assert requests.per_model() == {moved, refused}  # only the two changed models cost per-model requests
    assert assert_manifest_consistent(stack, cfg, moved).aliases["production"].version == new_versions[moved]
    manifest = read_manifest(stack, cfg, refused)
    assert manifest.aliases["production"].version == 1  # the refused version never replaces what is served
    assert manifest.refused["production"].version == 2 and "checksum" in manifest.refused["production"].reason
    tags = mlflow_client.get_model_version(refused, "2").tags
    assert "checksum" in tags["serving.refused"]

    # The refusal is sticky: the next pass has nothing to do, and fetches only the two republished manifests.
    requests.clear()
    after = run_pass(promoter, cache, syncs(cfg), cfg.hooks.reconcile_concurrency)
    assert after.models_synced == 0 and after.manifests_fetched == 2
    assert requests.per_model() == {moved, refused}
    requests.clear()
    assert run_pass(promoter, cache, syncs(cfg), cfg.hooks.reconcile_concurrency).manifests_fetched == 0
    assert requests.per_model() == set()


def test_a_missing_or_invalid_manifest_is_synced_and_reported(stack, test_config, mlflow_client, lora_template, tmp_path):
    """A manifest deleted by hand is republished; a corrupted one is reported, never silently skipped."""
    from registry_hooks.operations import status
    from rlops.layout import parse_s3_uri, routes_key

    model = test_config.registry.models[0]
    v1 = register_version(test_config, write_adapter(lora_template, tmp_path / "a1", test_config, seed=1))
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    promoter, cache = Promoter(test_config), ManifestCache()
    assert run_pass(promoter, cache, syncs(test_config), 2).models_synced == 1
    location = parse_s3_uri(test_config.lora_path)
    s3 = stack.s3()
    s3.delete_object(Bucket=location.bucket, Key=routes_key(location, model))
    assert run_pass(promoter, cache, syncs(test_config), 2).models_synced == 1
    assert read_manifest(stack, test_config).aliases["production"].version == v1

    s3.put_object(Bucket=location.bucket, Key=routes_key(location, model), Body=b'{"schema_version": 7}')
    failures = []
    report = run_pass(promoter, cache, lambda m: failures.append(m) or False, 2)
    assert report.models_synced == 1 and report.sync_failures == 1 and failures == [model]
    state = status(test_config)
    assert not state["in_sync"] and any("invalid routes manifest" in d for d in state["models"][0]["drift"])


@pytest.mark.parametrize("count", [1, 700])
def test_name_filters_stay_short_and_cover_every_name(count):
    names = [f"model-{i:06d}-with-a-longer-name" for i in range(count)]
    filters = name_filters(names)
    assert all(len(f) < 6100 for f in filters)
    covered = [n.strip("'") for f in filters for n in f[len("name IN ("):-1].split(",")]
    assert covered == names
