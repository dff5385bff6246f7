"""Alias set -> routes manifest published, for a 175 MB LoRA adapter (Qwen3-VL-8B, rank 32, all-linear, bf16).

Ours: `sync_model` (what the webhook / reconciler / promote CLI run): server-side CopyObject into the
immutable folder while the source's bytes are hashed and checked against the tracker's sha256 (copy and
read both conditional on the source's ETag; the copy's ETag must equal it), conditional manifest PUT.
Baseline (headline), measured in the same run on the same stack: the fair script a user would write, the
alias set plus a boto3 streaming S3 -> S3 copy of the version's artifacts and a manifest PUT (no
verification). Second line: download through the MLflow artifact proxy and re-upload. Every side is timed
as one whole call with its clients built inside the timer. Each run starts from an absent folder and
manifest; one warm-up run of each is not counted. Goal: >= 3x faster than the script and < 3 s.
The trigger's own latency (webhook delivery, ~0.6 s in tests/test_promotion_hooks.py) is not included.

Usage: python bench/promotion.py [--runs 5] [--warmup 1] [--size-mb 175]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import boto3
import mlflow
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import record  # noqa: E402
from _scratch import scratch_stack  # noqa: E402

from registry_hooks.sync import sync_model  # noqa: E402
from registry_hooks.registry import artifact_s3_location  # noqa: E402
from rlops import stack  # noqa: E402
from rlops.config import s3_client_kwargs  # noqa: E402
from rlops.layout import TAG_SHA256, RoutesManifest, AliasRoute, parse_s3_uri, routes_key, utc_now, version_folder  # noqa: E402

MODEL = "bench-promotion"
RANK = 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(out: Path, size_mb: int, base: str) -> None:
    """A real-format LoRA: lora_A/lora_B bf16-sized tensors (stored as fp16) adding up to `size_mb`."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    hidden, tensors, total, layer = 4096, {}, 0, 0
    while total < size_mb * 1024 * 1024:
        for module in TARGETS:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((RANK, hidden), dtype=np.float32).astype(np.float16)
            tensors[f"{prefix}.lora_B.weight"] = np.zeros((hidden, RANK), dtype=np.float16)
            total += 2 * RANK * hidden * 2
        layer += 1
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 64, "base_model_name_or_path": base,
        "target_modules": TARGETS, "task_type": "CAUSAL_LM"}))


def register(config, adapter: Path) -> int:
    mlflow.set_tracking_uri(config.tracking_uri)
    mlflow.set_registry_uri(config.tracking_uri)
    client = mlflow.MlflowClient()
    experiment_id = client.create_experiment("bench-promotion")
    tags = {f"{TAG_SHA256}{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in adapter.iterdir()}
    logged = client.create_logged_model(experiment_id, name="lora-bench", tags=tags, model_type="lora-adapter")
    client.log_model_artifacts(logged.model_id, str(adapter))
    client.finalize_logged_model(logged.model_id, "READY")
    return int(mlflow.register_model(f"models:/{logged.model_id}", MODEL).version)


def reset(config, s3, client) -> None:
    """No folder, no manifest, no alias: every run copies everything."""
    location = parse_s3_uri(config.lora_path)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=location.key("") + "/"):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=location.bucket, Key=obj["Key"])
    try:
        client.delete_registered_model_alias(MODEL, "production")
    except mlflow.exceptions.MlflowException:
        pass


def time_ours(config, version: int) -> float:
    """The whole call: MLflow client built, alias set, `sync_model` returned (its own clients, verification,
    publish and audit tags all inside)."""
    start = time.perf_counter()
    client = mlflow.MlflowClient(tracking_uri=config.tracking_uri)
    client.set_registered_model_alias(MODEL, "production", str(version))
    report = sync_model(config, MODEL, trigger="bench")
    seconds = time.perf_counter() - start
    assert report.served == {"production": version} and report.copy_mode == "server_side", report
    return seconds


def publish_manifest(s3, location, folder: str, files: dict[str, str], version: int, trigger: str) -> None:
    manifest = RoutesManifest(model=MODEL, generation=1, aliases={"production": AliasRoute(
        version=version, folder=folder, files=files, promoted_at=utc_now(), trigger=trigger)})
    s3.put_object(Bucket=location.bucket, Key=routes_key(location, MODEL), Body=manifest.model_dump_json().encode())


def time_boto3_script(config, version: int) -> float:
    """The fair alternative a user would script: clients built, alias set, the version's artifacts streamed
    S3 -> S3 with boto3 (get_object body into upload_fileobj, config last), manifest PUT; no verification."""
    location = parse_s3_uri(config.lora_path)
    folder = version_folder(MODEL, version)
    start = time.perf_counter()
    client = mlflow.MlflowClient(tracking_uri=config.tracking_uri)
    s3 = boto3.client("s3", **s3_client_kwargs(config))
    client.set_registered_model_alias(MODEL, "production", str(version))
    model_version = client.get_model_version(MODEL, str(version))
    model_id = model_version.model_id or model_version.source.removeprefix("models:/")
    source = artifact_s3_location(config, client.get_logged_model(model_id).artifact_location)
    objects = s3.list_objects_v2(Bucket=source.bucket, Prefix=source.prefix + "/")["Contents"]
    files = {}
    for obj in sorted(objects, key=lambda o: o["Key"].endswith("adapter_config.json")):
        name = obj["Key"].rsplit("/", 1)[1]
        body = s3.get_object(Bucket=source.bucket, Key=obj["Key"])["Body"]
        s3.upload_fileobj(body, location.bucket, location.key(folder, name))
        files[name] = "0" * 64  # the script records nothing it checked
    publish_manifest(s3, location, folder, files, version, "boto3-script")
    return time.perf_counter() - start


def time_proxy(config, version: int) -> float:
    """Download through MLflow's artifact proxy, re-upload, publish (clients built inside the timer too)."""
    location = parse_s3_uri(config.lora_path)
    folder = version_folder(MODEL, version)
    start = time.perf_counter()
    client = mlflow.MlflowClient(tracking_uri=config.tracking_uri)
    s3 = boto3.client("s3", **s3_client_kwargs(config))
    client.set_registered_model_alias(MODEL, "production", str(version))
    source = client.get_model_version_by_alias(MODEL, "production").source
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=tmp))
        files = {}
        for path in sorted(local.iterdir(), key=lambda p: p.name == "adapter_config.json"):
            s3.upload_file(str(path), location.bucket, location.key(folder, path.name))
            files[path.name] = "0" * 64
    publish_manifest(s3, location, folder, files, version, "naive")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size-mb", type=int, default=175)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    with scratch_stack(registry={"models": [MODEL]}) as (config, root):
        adapter = root / "adapter"
        write_adapter(adapter, args.size_mb, config.base_model_source)
        size = sum(p.stat().st_size for p in adapter.iterdir()) / 1e6
        client = mlflow.MlflowClient(tracking_uri=config.tracking_uri)
        version = register(config, adapter)
        s3 = stack.s3_client(config, timeout_s=120)
        times: dict[str, list[float]] = {"ours": [], "script": [], "proxy": []}
        for i in range(args.warmup + args.runs):  # warm-up runs (fresh server caches) are not counted
            for side, timed in (("ours", time_ours), ("script", time_boto3_script), ("proxy", time_proxy)):
                reset(config, s3, client)
                times[side].append(timed(config, version))
            label = "warm-up" if i < args.warmup else f"run {i + 1 - args.warmup}"
            print(f"{label}: sync_model {times['ours'][-1]:.2f} s | boto3 streaming S3->S3 script "
                  f"{times['script'][-1]:.2f} s | download+reupload via MLflow proxy {times['proxy'][-1]:.2f} s")
    ours, script, proxy = (statistics.median(times[side][args.warmup:]) for side in ("ours", "script", "proxy"))
    ratio, proxy_ratio = script / ours, proxy / ours
    met = ratio >= 3 and ours < 3
    print(f"alias set -> manifest published, {size:.0f} MB adapter, whole call with clients built inside the timer "
          f"(median of {args.runs}): sync_model {ours:.2f} s vs boto3 streaming S3->S3 copy + alias set {script:.2f} s: "
          f"ratio {ratio:.2f}x; goal >= 3x and < 3 s: {'met' if met else 'MISSED'}")
    print(f"second figure: download+reupload through the MLflow artifact proxy {proxy:.2f} s: ratio {proxy_ratio:.2f}x")
    record("promotion.py", ours, "s", script, ratio,
           ">= 3x faster than a boto3 streaming S3->S3 copy + alias set, < 3 s (both whole calls, clients inside)")
    record("promotion.py:proxy", ours, "s", proxy, proxy_ratio,
           "reported: vs download+reupload through the MLflow artifact proxy (whole calls, clients inside)")


if __name__ == "__main__":
    main()
