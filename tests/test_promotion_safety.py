"""Crash safety and garbage collection of promotion against the real stack.

Invariant: whatever instant a sync dies at, the published manifest names only complete folders whose
files match its sha256s, and a rerun completes the promotion."""
from __future__ import annotations

import os
import signal
import threading
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest

from registry_hooks import operations, storage
from registry_hooks.sync import sync_model
from registry_hooks.operations import gc
from registry_hooks.sync import Promoter, Refused
from rlops.layout import ModelNotFound, parse_s3_uri, routes_key, version_folder
from serving.routes import RoutesTable

from test_promotion_support import (  # noqa: F401 - fixtures
    assert_manifest_consistent,
    folder_objects,
    lora_template,
    register_version,
    write_adapter,
)


class SimulatedCrash(BaseException):
    """BaseException: nothing in the sync may catch it, like a process dying."""


@pytest.fixture
def promotion_in_flight(stack, test_config, mlflow_client, lora_template, tmp_path):
    """production: v1 published; then production -> v2 and staging -> v2 set in the registry but not synced.
    Returns (v1, v2, reset) where reset() restores exactly that state in S3."""
    model = test_config.registry.models[0]
    v1 = register_version(test_config, write_adapter(lora_template, tmp_path / "a1", test_config, seed=1), step=1)
    v2 = register_version(test_config, write_adapter(lora_template, tmp_path / "a2", test_config, seed=2,
                                                     padding_mb=4), step=2)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    sync_model(test_config, model, trigger="setup")
    location = parse_s3_uri(test_config.lora_path)
    s3 = stack.s3()
    published = s3.get_object(Bucket=location.bucket, Key=routes_key(location, model))["Body"].read()
    mlflow_client.set_registered_model_alias(model, "production", str(v2))
    mlflow_client.set_registered_model_alias(model, "staging", str(v2))

    def reset() -> None:
        s3.put_object(Bucket=location.bucket, Key=routes_key(location, model), Body=published)
        head = location.key(version_folder(model, v2)) + "/"
        for obj in s3.list_objects_v2(Bucket=location.bucket, Prefix=head).get("Contents", []):
            s3.delete_object(Bucket=location.bucket, Key=obj["Key"])

    return v1, v2, reset


def test_crash_after_every_s3_operation_never_breaks_the_manifest(stack, test_config, promotion_in_flight):
    model = test_config.registry.models[0]
    v1, v2, reset = promotion_in_flight
    crashed_at = []
    for k in range(1, 200):
        reset()
        promoter = Promoter(test_config)
        calls = {"n": 0}

        def crash_after_kth(**_):
            calls["n"] += 1
            if calls["n"] == k:
                raise SimulatedCrash(k)

        promoter.dest.meta.events.register("after-call.s3", crash_after_kth)
        try:
            promoter.sync(model, trigger="crashy")
        except SimulatedCrash:
            crashed_at.append(k)
            manifest = assert_manifest_consistent(stack, test_config)
            assert manifest.aliases["production"].version in (v1, v2)
            rerun = sync_model(test_config, model, trigger="rerun")
            assert rerun.served == {"production": v2, "staging": v2}, f"rerun after crash at op {k}"
            assert_manifest_consistent(stack, test_config)
            continue
        break  # k is past the last S3 operation: the sync completed untouched
    assert len(crashed_at) >= 10, crashed_at  # lists, config + header reads, copies, manifest reads and the PUT
    assert_manifest_consistent(stack, test_config).aliases["production"].version == v2


# Imports once, then forks one child per round (a fresh process per kill, without paying imports each time).
KILLABLE_SYNC = """
import os, sys
from rlops.config import load_config
from registry_hooks.sync import Promoter
config = load_config(sys.argv[1])
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        Promoter(config).sync(sys.argv[2], trigger="killed")
        os._exit(0)
    print(pid, flush=True)
    os.waitpid(pid, 0)
"""


def test_kill_9_mid_sync_then_rerun_completes(stack, test_config, promotion_in_flight, tmp_path):
    from conftest import write_config

    model = test_config.registry.models[0]
    v1, v2, reset = promotion_in_flight
    path = write_config(tmp_path / "mlflow.yaml", test_config.model_dump(exclude_none=True))
    helper = subprocess.Popen([sys.executable, "-c", KILLABLE_SYNC, str(path), model], env=stack.env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    outcomes = []
    try:
        for delay in (0.02, 0.1, 0.25, 0.5, 0.8):
            reset()
            helper.stdin.write("go\n")
            helper.stdin.flush()
            child = int(helper.stdout.readline())
            time.sleep(delay)
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it finished first: fine, the invariant must hold either way
            manifest = assert_manifest_consistent(stack, test_config)
            outcomes.append(manifest.aliases["production"].version)
            assert sync_model(test_config, model, trigger="rerun").served == {"production": v2, "staging": v2}
            assert_manifest_consistent(stack, test_config)
    finally:
        helper.kill()
        helper.wait(10)
    assert v1 in outcomes, outcomes  # at least one kill landed before the publish


def test_gc_keeps_referenced_recent_and_young_folders(stack, test_config, mlflow_client, lora_template, tmp_path,
                                                     monkeypatch):
    model = test_config.registry.models[0]
    versions = [register_version(test_config, write_adapter(lora_template, tmp_path / f"a{i}", test_config, seed=i),
                                 step=i) for i in (1, 2, 3, 4)]
    v1, v2, v3, v4 = versions
    for v in versions:  # each becomes production once: v1..v3 end up in history only
        mlflow_client.set_registered_model_alias(model, "production", str(v))
        sync_model(test_config, model, trigger="test")
    mlflow_client.set_registered_model_alias(model, "staging", str(v3))
    # An orphan folder nobody ever published, and a foreign folder gc must never touch.
    Promoter(test_config).prepare(model, v2)
    location = parse_s3_uri(test_config.lora_path)
    stack.s3().put_object(Bucket=location.bucket, Key=location.key("someone-else-v1", "adapter_config.json"), Body=b"{}")

    test_config.registry.gc_lease_s = 2
    now = datetime.now(timezone.utc)
    young = gc(test_config, now=now)
    assert young.deleted == [] and version_folder(model, v1) in young.kept

    # Past the grace period, history older than retention is collectable; v3 (staging) and v4 (production) stay.
    later = now + timedelta(seconds=test_config.registry.gc_grace_s + 1)
    test_config.registry.gc_retention_s = 0
    planned = gc(test_config, now=later, dry_run=True)
    assert planned.deleted == [version_folder(model, v1), version_folder(model, v2)]
    assert folder_objects(stack, test_config, version_folder(model, v1))  # dry run deleted nothing
    done = gc(test_config, now=later)
    assert done.deleted == planned.deleted
    assert set(done.kept) == {version_folder(model, v3), version_folder(model, v4)}
    assert folder_objects(stack, test_config, version_folder(model, v1)) == {}
    assert folder_objects(stack, test_config, "someone-else-v1")
    manifest = assert_manifest_consistent(stack, test_config)
    # @v<N> of a collected version is a clear 404, not an adapter that fails to load.
    table = RoutesTable("base", ("production", "staging"), "production", {model: manifest})
    with pytest.raises(ModelNotFound, match=f"version {v1} was garbage-collected"):
        table.resolve(f"base:{model}@v{v1}")
    assert table.resolve(f"base:{model}@v{v3}").version == v3

    # Within the lease a collected version is not copied into (gc may still be deleting); after it, an alias
    # pointing at it again brings the folder back.
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    held = sync_model(test_config, model, trigger="test")
    assert held.served["production"] == v4 and "being garbage-collected" in held.refused["production"]["reason"]
    time.sleep(test_config.registry.gc_lease_s)
    assert sync_model(test_config, model, trigger="test").served["production"] == v1
    assert v1 not in assert_manifest_consistent(stack, test_config).collected_versions()
    # A sync that read the manifest before that publish (the webhook's, beside a promote: the soak's finding,
    # issue 34) prepares v1 as collected too: it copies over the published folder, it never deletes it.
    deleted = []
    monkeypatch.setattr(storage, "delete_folder", lambda *args: deleted.append(args))
    Promoter(test_config).prepare(model, v1, collected=True)
    assert deleted == []
    assert_manifest_consistent(stack, test_config)


def test_gc_racing_promote_never_leaves_a_named_folder_missing(stack, test_config, mlflow_client, lora_template, tmp_path):
    """promote of a history version in one thread, gc in another, many times with shifted timing: the
    manifest only ever names complete, verified folders, whichever wins."""
    model = test_config.registry.models[0]
    test_config.registry.gc_grace_s = 0
    test_config.registry.gc_retention_s = 0
    test_config.registry.gc_lease_s = 1.0
    old, current = (register_version(test_config, write_adapter(lora_template, tmp_path / f"a{i}", test_config, seed=i),
                                     step=i) for i in (1, 2))
    outcomes = Counter()
    for trial in range(10):
        mlflow_client.set_registered_model_alias(model, "production", str(old))
        sync_model(test_config, model, trigger="setup")
        mlflow_client.set_registered_model_alias(model, "production", str(current))
        sync_model(test_config, model, trigger="setup")  # `old` is history only: collectable
        time.sleep(test_config.registry.gc_lease_s)  # earlier marks have expired
        start = threading.Barrier(2)
        result = {}

        def promote_old():
            start.wait()
            try:
                result["promote"] = operations.promote(test_config, model, to_alias="production", version=old).served
            except Refused as exc:
                result["promote"] = str(exc)

        def collect():
            start.wait()
            time.sleep(0.03 * (trial % 5))  # shift the interleaving from trial to trial
            result["gc"] = gc(test_config).deleted

        threads = [threading.Thread(target=promote_old), threading.Thread(target=collect)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        manifest = assert_manifest_consistent(stack, test_config)
        served = manifest.aliases["production"].version
        outcomes["promoted" if served == old else "collected first"] += 1
        assert (served == old) == (old not in manifest.collected_versions())
    assert sum(outcomes.values()) == 10, outcomes  # here: both orders occur (about 6 collected first, 4 promoted)
