"""Promotion sync against the real stack: immutable folders, the routes manifest, refusals, races."""
from __future__ import annotations

import threading

import pytest
import torch

from registry_hooks.sync import NotFound, sync_model
from registry_hooks.sync import Promoter
from rlops.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, version_folder

from test_promotion_support import (  # noqa: F401 - fixtures
    assert_manifest_consistent,
    folder_objects,
    lora_template,
    register_version,
    write_adapter,
)


@pytest.fixture
def registered(test_config, lora_template, tmp_path):
    """Factory: register a version of the test's model; `register(seed=..., **write_adapter kwargs)`."""
    def register(seed: int = 1, *, metric: float = 0.5, checksums=None, **adapter_kwargs) -> int:
        folder = write_adapter(lora_template, tmp_path / f"adapter-{seed}-{len(list(tmp_path.iterdir()))}",
                               test_config, seed=seed, **adapter_kwargs)
        return register_version(test_config, folder, step=seed, metric=metric, checksums=checksums)
    return register


def test_sync_publishes_alias_as_verified_immutable_folder(stack, test_config, mlflow_client, registered):
    model = test_config.registry.models[0]
    v1 = registered(seed=1)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))

    report = sync_model(test_config, model, trigger="test")

    assert report.changed and report.promoted == {"production": v1} and report.copy_mode == "server_side"
    manifest = assert_manifest_consistent(stack, test_config)
    route = manifest.aliases["production"]
    assert route.folder == version_folder(model, v1) and route.trigger == "test"
    assert set(route.files) == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    assert [(h.alias, h.version) for h in manifest.history] == [("production", v1)]
    tags = mlflow_client.get_model_version(model, str(v1)).tags
    assert tags["serving.folder"] == route.folder and tags["serving.trigger"] == "test"
    assert tags["serving.promoted_at"] == route.promoted_at and tags["serving.promoted_by"] == "registry"  # a plain-client move

    again = sync_model(test_config, model, trigger="test")  # idempotent: no rewrite, no generation bump
    assert not again.changed and again.generation == manifest.generation and again.bytes_copied == 0


def test_server_side_copy_hashes_each_source_once_and_never_reads_the_copy_back(stack, test_config, mlflow_client,
                                                                              registered):
    model = test_config.registry.models[0]
    v1 = registered(seed=1)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    promoter = Promoter(test_config)
    full_reads = []
    promoter.source.meta.events.register(
        "before-parameter-build.s3.GetObject",
        lambda params, **_: full_reads.append((params["Key"], params.get("IfMatch"))) if "Range" not in params else None)

    report = promoter.sync(model, trigger="test")

    assert report.copy_mode == "server_side" and report.served == {"production": v1}
    folder = version_folder(model, v1)
    assert not [key for key, _ in full_reads if f"/{folder}/" in key]  # the copies are never read back
    weights = [(key, etag) for key, etag in full_reads if key.endswith(ADAPTER_WEIGHTS)]
    assert len(weights) == 1 and weights[0][1]  # the source weights hashed once, pinned to the listed ETag


def test_copy_and_hash_refuse_a_source_replaced_since_listing(stack, test_config):
    from botocore.exceptions import ClientError

    from registry_hooks import storage
    from rlops.stack import s3_client

    s3 = s3_client(test_config)
    bucket = test_config.storage.bucket
    prefix = f"scratch/{test_config.registry.models[0]}"
    src, dst = storage.ObjectRef(bucket, f"{prefix}/src"), storage.ObjectRef(bucket, f"{prefix}/dst")
    s3.put_object(Bucket=bucket, Key=src.key, Body=b"first")
    listed = s3.head_object(Bucket=bucket, Key=src.key)["ETag"]
    s3.put_object(Bucket=bucket, Key=src.key, Body=b"second")  # replaced after it was listed
    for attempt in (lambda: storage.sha256_of(s3, src, if_match=listed),
                    lambda: storage.server_side_copy(s3, src, dst, 6, if_match=listed)):
        with pytest.raises(ClientError, match="PreconditionFailed|412"):
            attempt()
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix=dst.key)


def test_sync_follows_alias_moves_and_deletes(stack, test_config, mlflow_client, registered):
    model = test_config.registry.models[0]
    v1, v2 = registered(seed=1), registered(seed=2)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    mlflow_client.set_registered_model_alias(model, "staging", str(v2))
    sync_model(test_config, model, trigger="test")
    mlflow_client.set_registered_model_alias(model, "production", str(v2))
    report = sync_model(test_config, model, trigger="test")
    assert report.served == {"production": v2, "staging": v2} and report.promoted == {"production": v2}
    v1_files = folder_objects(stack, test_config, version_folder(model, v1))
    assert ADAPTER_CONFIG in v1_files  # the old folder stays (rollback, in-flight requests); gc removes it later

    mlflow_client.delete_registered_model_alias(model, "staging")
    report = sync_model(test_config, model, trigger="test")
    manifest = assert_manifest_consistent(stack, test_config)
    assert report.removed == ["staging"] and set(manifest.aliases) == {"production"}
    assert [(h.alias, h.version) for h in manifest.history] == [("production", v1), ("staging", v2), ("production", v2)]

    mlflow_client.delete_registered_model(model)  # a deleted registered model serves nothing any more
    report = sync_model(test_config, model, trigger="test")
    assert report.served == {} and report.removed == ["production"]
    assert assert_manifest_consistent(stack, test_config).aliases == {}


def test_legacy_production_stage_counts_only_without_alias(stack, test_config, mlflow_client, registered):
    model = test_config.registry.models[0]
    v1, v2 = registered(seed=1), registered(seed=2)
    with pytest.warns(FutureWarning):
        mlflow_client.transition_model_version_stage(model, str(v1), "Production")
    assert sync_model(test_config, model, trigger="test").served == {"production": v1}
    mlflow_client.set_registered_model_alias(model, "production", str(v2))
    assert sync_model(test_config, model, trigger="test").served == {"production": v2}


def test_unconfigured_model_is_never_touched(test_config):
    with pytest.raises(NotFound, match="not served"):
        sync_model(test_config, "some-other-model", trigger="test")


BAD_ADAPTERS = {
    "rank above max": dict(config_overrides={"r": 64}),
    "not a lora": dict(config_overrides={"peft_type": "IA3"}),
    "wrong base": dict(config_overrides={"base_model_name_or_path": "meta-llama/Llama-3-8B"}),
    "unknown target module": dict(config_overrides={"target_modules": ["model.layers.0.self_attn.q_proj", "lm_head_x"]}),
    "pickle file": dict(extra_files={"training_args.bin": b"\x80\x04pickle"}),
    "vision tower weights": dict(extra_tensors={f"base_model.model.model.visual.blocks.0.attn.qkv.lora_{ab}.weight":
                                                torch.zeros(shape) for ab, shape in (("A", (8, 32)), ("B", (96, 8)))}),
}
# What the refusal must say, where the issue asks for a specific message.
REFUSAL_REASONS = {"vision tower weights": "vision tower/connector (visual.blocks.*.attn.qkv) are applied by vLLM "
                                           "only with serving.enable_tower_connector_lora: true"}


@pytest.mark.parametrize("kind", [*BAD_ADAPTERS, "checksum mismatch"])
def test_refused_adapter_keeps_previous_target(stack, test_config, mlflow_client, registered, kind):
    model = test_config.registry.models[0]
    v1 = registered(seed=1)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    sync_model(test_config, model, trigger="test")
    if kind == "checksum mismatch":
        v2 = registered(seed=2, checksums={ADAPTER_CONFIG: "0" * 64, ADAPTER_WEIGHTS: "1" * 64})
    else:
        v2 = registered(seed=2, **BAD_ADAPTERS[kind])
    mlflow_client.set_registered_model_alias(model, "production", str(v2))

    report = sync_model(test_config, model, trigger="test")

    manifest = assert_manifest_consistent(stack, test_config)
    assert manifest.aliases["production"].version == v1 and report.served == {"production": v1}
    refusal = manifest.refused["production"]
    assert refusal.version == v2 and refusal.reason and REFUSAL_REASONS.get(kind, "") in refusal.reason
    assert mlflow_client.get_model_version(model, str(v2)).tags["serving.refused"] == refusal.reason
    assert ADAPTER_CONFIG not in folder_objects(stack, test_config, version_folder(model, v2))
    again = sync_model(test_config, model, trigger="test")  # the refusal is stable, not re-copied each time
    assert not again.changed and again.bytes_copied == 0


def test_racing_syncs_end_on_the_newest_intent(stack, test_config, mlflow_client, registered):
    """Sync A read alias -> v1 and is about to publish when the alias moves to v2 and sync B publishes v2:
    A's conditional write loses, it re-reads the registry, and the manifest ends on v2."""
    model = test_config.registry.models[0]
    v1, v2 = registered(seed=1), registered(seed=2)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    slow = Promoter(test_config)
    about_to_publish, go = threading.Event(), threading.Event()

    def hold_first_manifest_put(params, **_):
        if params["Key"].endswith(f"_routes/{model}.json") and not about_to_publish.is_set():
            about_to_publish.set()
            go.wait(30)

    slow.dest.meta.events.register("before-parameter-build.s3.PutObject", hold_first_manifest_put)
    result = {}
    racer = threading.Thread(target=lambda: result.update(a=slow.sync(model, trigger="slow")))
    racer.start()
    assert about_to_publish.wait(30)
    mlflow_client.set_registered_model_alias(model, "production", str(v2))
    assert sync_model(test_config, model, trigger="fast").served == {"production": v2}
    go.set()
    racer.join(30)

    assert result["a"].served == {"production": v2}
    manifest = assert_manifest_consistent(stack, test_config)
    assert manifest.aliases["production"].version == v2


def test_concurrent_syncs_converge(stack, test_config, mlflow_client, registered):
    model = test_config.registry.models[0]
    v1 = registered(seed=1)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    mlflow_client.set_registered_model_alias(model, "staging", str(v1))
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(sync_model(test_config, model, trigger="t")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(reports) == 3 and all(r.served == {"production": v1, "staging": v1} for r in reports)
    manifest = assert_manifest_consistent(stack, test_config)
    assert manifest.generation == 1 and len(manifest.history) == 2


def test_complete_folder_with_other_content_is_never_rewritten(stack, test_config, mlflow_client, registered):
    """Replicas may have cached a complete folder: a mismatch is refused, never fixed by overwriting."""
    from rlops.layout import parse_s3_uri

    model = test_config.registry.models[0]
    v1 = registered(seed=1)
    location = parse_s3_uri(test_config.lora_path)
    for name, body in {ADAPTER_CONFIG: b"{}", ADAPTER_WEIGHTS: b"stale"}.items():
        stack.s3().put_object(Bucket=location.bucket, Key=location.key(version_folder(model, v1), name), Body=body)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))

    report = sync_model(test_config, model, trigger="test")

    assert report.served == {} and "not rewritten" in report.refused["production"]["reason"]
    assert version_folder(model, v1) not in report.refused["production"]["reason"]
    assert folder_objects(stack, test_config, version_folder(model, v1)) == {ADAPTER_CONFIG: b"{}", ADAPTER_WEIGHTS: b"stale"}


def test_version_whose_logged_model_was_deleted_is_refused(stack, test_config, mlflow_client, registered):
    model = test_config.registry.models[0]
    v1 = registered(seed=1)
    mlflow_client.delete_logged_model(mlflow_client.get_model_version(model, str(v1)).source[len("models:/"):])
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    report = sync_model(test_config, model, trigger="test")
    assert report.served == {} and "no longer exists" in report.refused["production"]["reason"]


def test_guardrail_refuses_scores_of_different_eval_sets_and_versions_mirror_the_routes(
        stack, test_config, mlflow_client, registered):
    """Scores measured on different eval sets never compare: the refusal names both layout hashes. Each
    version whose routes changed carries where it is served and its promotion history as tags."""
    model = test_config.registry.models[0]
    served, other_set = registered(seed=1, metric=0.5), registered(seed=2, metric=0.9)
    mlflow_client.set_model_version_tag(model, str(served), "rlops.eval_set_sha256", "a" * 64)
    mlflow_client.set_model_version_tag(model, str(other_set), "rlops.eval_set_sha256", "b" * 64)
    mlflow_client.set_registered_model_alias(model, "production", str(served))
    sync_model(test_config, model, trigger="cli")
    tags = mlflow_client.get_model_version(model, str(served)).tags
    assert tags["serving.aliases"] == "production" and tags["serving.history"].startswith("production 20")
    assert tags["serving.history"].endswith("(cli)")

    mlflow_client.set_registered_model_alias(model, "production", str(other_set))
    mlflow_client.set_registered_model_alias(model, "staging", str(other_set))
    report = sync_model(test_config, model, trigger="webhook")
    assert report.served == {"production": served, "staging": other_set}
    reason = report.refused["production"]["reason"]
    assert "different eval sets" in reason and "a" * 64 in reason and "b" * 64 in reason
    assert mlflow_client.get_model_version(model, str(other_set)).tags["serving.aliases"] == "staging"

    mlflow_client.delete_registered_model_alias(model, "staging")
    sync_model(test_config, model, trigger="reconciler")
    assert mlflow_client.get_model_version(model, str(other_set)).tags["serving.aliases"] == "none"
    assert "staging" in mlflow_client.get_model_version(model, str(other_set)).tags["serving.history"]


def test_guardrail_holds_for_every_trigger(stack, test_config, mlflow_client, registered):
    """An alias moved to a worse version in the MLflow UI (then a webhook or reconciler sync) is refused the
    same as `promote` would be: the old target stays, the refusal is in the manifest and on the version."""
    from registry_hooks import operations

    model = test_config.registry.models[0]
    good, worse = registered(seed=1, metric=0.6), registered(seed=2, metric=0.4)
    mlflow_client.set_registered_model_alias(model, "production", str(good))
    sync_model(test_config, model, trigger="webhook")
    mlflow_client.set_registered_model_alias(model, "production", str(worse))
    mlflow_client.set_registered_model_alias(model, "staging", str(worse))  # not guarded: follows
    for trigger in ("webhook", "reconciler"):
        report = sync_model(test_config, model, trigger=trigger)
        assert report.served == {"production": good, "staging": worse}
        assert "does not beat the current" in report.refused["production"]["reason"]
    manifest = assert_manifest_consistent(stack, test_config)
    assert manifest.refused["production"].kind == "guardrail" and manifest.refused["production"].version == worse
    assert mlflow_client.get_model_version(model, str(worse)).tags["serving.refused"].startswith("production: v")
    state = operations.status(test_config)
    assert state["models"][0]["refused"]["production"]["version"] == worse  # `promote status` exits 6 on it

    # The policy is configurable: lower-is-better (a loss metric) lets the lower score through.
    lower = test_config.model_copy(deep=True)
    lower.registry.guardrail_direction = "lower"
    assert sync_model(lower, model, trigger="reconciler").served["production"] == worse
    # served now: the earlier refusal is no longer on the version (`promote list` would show it beside it)
    assert "serving.refused" not in mlflow_client.get_model_version(model, str(worse)).tags
    mlflow_client.set_registered_model_alias(model, "production", str(good))
    assert sync_model(lower, model, trigger="reconciler").served["production"] == worse  # 0.6 loses now

    # An override is a registry-visible act: the rlops.force tag on the version, whoever set it.
    mlflow_client.set_model_version_tag(model, str(good), "rlops.force", "bob: the eval set was wrong")
    assert sync_model(lower, model, trigger="reconciler").served["production"] == good
