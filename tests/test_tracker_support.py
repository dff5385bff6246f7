"""Helpers shared by the tracker tests (no tests here): a real PEFT LoRA adapter and MLflow read-backs."""
from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient


def make_peft_adapter(out_dir: Path, seed: int = 0, rank: int = 4) -> Path:
    """Save a real PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) of a tiny Llama."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(out_dir)
    return Path(out_dir)


def metric_history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every point of `key`, sorted; duplicates would show up twice."""
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def logged_table(client: MlflowClient, run_id: str, artifact_file: str, dst: Path) -> list[dict]:
    """The rows of a table logged with `log_table` (JSON, orient=split), read with the plain client."""
    import json

    with open(client.download_artifacts(run_id, artifact_file, str(dst))) as fh:
        table = json.load(fh)
    return [dict(zip(table["columns"], row)) for row in table["data"]]
