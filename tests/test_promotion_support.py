"""Shared fixtures for the promotion tests: registered versions made the way the tracker makes them
(a real PEFT LoRA on a tiny random Qwen3, logged as a LoggedModel with the agreed tags, registered from
`models:/<model_id>`), and helpers that read what promotion published. No tests live here."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlflow
import pytest

from conftest import sha256_file
from rlops.config import Config
from rlops.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, RoutesManifest, parse_s3_uri, routes_key

RANK = 8


@pytest.fixture(scope="session")
def lora_template(tmp_path_factory) -> tuple[dict, dict]:
    """(adapter_config dict, tensors) of a real PEFT LoRA on a tiny random-init Qwen3ForCausalLM."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    peft_model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=16, target_modules="all-linear",
                                                 init_lora_weights=False))
    out = tmp_path_factory.mktemp("lora-template")
    peft_model.save_pretrained(out)
    return json.loads((out / ADAPTER_CONFIG).read_text()), load_file(str(out / ADAPTER_WEIGHTS))


def write_adapter(lora_template, out: Path, config: Config, *, seed: int = 1, padding_mb: int = 0,
                  config_overrides: dict | None = None, extra_files: dict[str, bytes] | None = None,
                  extra_tensors: dict | None = None) -> Path:
    """An adapter folder distinct per seed; `padding_mb` adds a LoRA tensor to reach a size."""
    import torch
    from safetensors.torch import save_file

    adapter_config, tensors = lora_template
    tensors = {k: v * seed for k, v in tensors.items()}
    if padding_mb:
        cols = padding_mb * 1024 * 1024 // (4 * RANK)
        tensors["base_model.model.padding.lora_A.weight"] = torch.full((RANK, cols), float(seed))
    tensors.update(extra_tensors or {})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    data = {**adapter_config, "base_model_name_or_path": config.base_model_source, **(config_overrides or {})}
    (out / ADAPTER_CONFIG).write_text(json.dumps(data, indent=2))
    for name, body in (extra_files or {}).items():
        (out / name).write_bytes(body)
    return out


def register_version(config: Config, adapter_dir: Path, *, step: int = 1, metric: float = 0.5,
                     checksums: dict[str, str] | None = None, metric_key: str = "eval/maze_2d/local7/avg_score") -> int:
    """Log `adapter_dir` as a LoggedModel with the tracker's tags and register it into config's model."""
    mlflow.set_tracking_uri(config.tracking_uri)
    mlflow.set_registry_uri(config.tracking_uri)
    client = mlflow.MlflowClient()
    model = config.registry.models[0]
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(config.tracking.experiment)
    run = client.create_run(experiment_id)
    files = sorted(p for p in adapter_dir.iterdir() if p.is_file())
    recorded = checksums or {p.name: sha256_file(p) for p in files}
    tags = {"rlops.step": str(step), "rlops.base_model": config.base_model_source, "rlops.lora_rank": str(RANK),
            **{f"rlops.sha256.{name}": digest for name, digest in recorded.items()}}
    logged = client.create_logged_model(experiment_id, name=f"lora-step-{step}", source_run_id=run.info.run_id,
                                        tags=tags, model_type="lora-adapter")
    client.log_model_artifacts(logged.model_id, str(adapter_dir))
    client.finalize_logged_model(logged.model_id, "READY")
    client.set_terminated(run.info.run_id)
    version = mlflow.register_model(f"models:/{logged.model_id}", model, tags={
        "rlops.run_id": run.info.run_id, "rlops.step": str(step), "rlops.metric_key": metric_key,
        "rlops.metric_value": repr(float(metric)),
    })
    return int(version.version)


def read_manifest(stack, config: Config, model: str | None = None) -> RoutesManifest | None:
    location = parse_s3_uri(config.lora_path)
    try:
        body = stack.s3().get_object(Bucket=location.bucket, Key=routes_key(location, model or config.registry.models[0]))
    except stack.s3().exceptions.NoSuchKey:
        return None
    return RoutesManifest.model_validate_json(body["Body"].read())


def folder_objects(stack, config: Config, folder: str) -> dict[str, bytes]:
    location = parse_s3_uri(config.lora_path)
    s3 = stack.s3()
    head = location.key(folder) + "/"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=location.bucket, Prefix=head).get("Contents", [])]
    return {k[len(head):]: s3.get_object(Bucket=location.bucket, Key=k)["Body"].read() for k in keys}


def assert_manifest_consistent(stack, config: Config, model: str | None = None) -> RoutesManifest | None:
    """The crash-safety invariant: every folder the manifest names is complete and matches its sha256s."""
    manifest = read_manifest(stack, config, model)
    if manifest is None:
        return None
    for alias, route in manifest.aliases.items():
        objects = folder_objects(stack, config, route.folder)
        assert set(objects) == set(route.files), f"{alias}: folder {route.folder} has {sorted(objects)}"
        for name, digest in route.files.items():
            assert hashlib.sha256(objects[name]).hexdigest() == digest, f"{alias}: {name} differs"
    return manifest
