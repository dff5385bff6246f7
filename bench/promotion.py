"""Alias set -> routes manifest published, for a 175 MB LoRA adapter (Qwen3-VL-8B, rank 32, all-linear, bf16).

Ours: `sync_model` (what the webhook / reconciler / promote CLI run): server-side CopyObject into the
immutable folder while the source's bytes are hashed and checked against the tracker's sha256 (copy and
read both conditional on the source's ETag; the copy's ETag must equal it), conditional manifest PUT.
Baseline, measured in the same run on the same stack: the naive path, download the artifacts through the
MLflow artifact proxy and re-upload them to the serving prefix, then PUT the manifest (no verification).
Each run starts from an absent folder and manifest; one warm-up run of each is not counted. Goal: >= 3x faster than the baseline and < 3 s.
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

import mlflow
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import record  # noqa: E402
from _scratch import scratch_stack  # noqa: E402

from registry_hooks import sync_model  # noqa: E402
from rlops import stack  # noqa: E402
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


def time_ours(config, client, version: int) -> float:
    start = time.perf_counter()
    client.set_registered_model_alias(MODEL, "production", str(version))
    alias_set = time.perf_counter() - start
    report = sync_model(config, MODEL, trigger="bench")
    assert report.served == {"production": version} and report.copy_mode == "server_side", report
    return alias_set + report.seconds_to_publish  # the audit tags written after the publish are not waited for


def time_naive(config, client, s3, version: int) -> float:
    """Download through MLflow's artifact proxy, re-upload, publish: what a script without promotion would do."""
    location = parse_s3_uri(config.lora_path)
    folder = version_folder(MODEL, version)
    start = time.perf_counter()
    client.set_registered_model_alias(MODEL, "production", str(version))
    source = client.get_model_version_by_alias(MODEL, "production").source
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=tmp))
        files = {}
        for path in sorted(local.iterdir(), key=lambda p: p.name == "adapter_config.json"):
            s3.upload_file(str(path), location.bucket, location.key(folder, path.name))
            files[path.name] = "0" * 64  # the naive path records nothing it checked
    manifest = RoutesManifest(model=MODEL, generation=1, aliases={"production": AliasRoute(
        version=version, folder=folder, files=files, promoted_at=utc_now(), trigger="naive")})
    s3.put_object(Bucket=location.bucket, Key=routes_key(location, MODEL), Body=manifest.model_dump_json().encode())
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
        ours, naive = [], []
        for i in range(args.warmup + args.runs):  # warm-up runs (fresh server caches) are not counted
            reset(config, s3, client)
            ours.append(time_ours(config, client, version))
            reset(config, s3, client)
            naive.append(time_naive(config, client, s3, version))
            label = "warm-up" if i < args.warmup else f"run {i + 1 - args.warmup}"
            print(f"{label}: sync (server-side copy + sha256 check) {ours[-1]:.2f} s | "
                  f"naive download+reupload via MLflow proxy {naive[-1]:.2f} s")
        ours, naive = ours[args.warmup:], naive[args.warmup:]
    figure, baseline = statistics.median(ours), statistics.median(naive)
    ratio = baseline / figure
    met = ratio >= 3 and figure < 3
    print(f"alias set -> manifest published, {size:.0f} MB adapter: {figure:.2f} s (median of {args.runs}); "
          f"naive baseline {baseline:.2f} s; ratio (baseline / ours) {ratio:.2f}x; goal >= 3x and < 3 s: "
          f"{'met' if met else 'MISSED'}")
    record("promotion.py", figure, "s", baseline, ratio, ">= 3x faster than download+reupload via the MLflow proxy, < 3 s")


if __name__ == "__main__":
    main()
