"""What a promotable adapter is: pure checks on its file list, adapter_config.json and safetensors header.

Every check raises InvalidAdapter with a reason that is safe to show (it becomes the manifest refusal and
a version tag): no bucket names, no credentials.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from rlops.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_allowed_adapter_file

SHA256_HEX_LENGTH = 64
SAFETENSORS_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own cap on the JSON header
SERVED_DTYPES = frozenset({"F32", "F16", "BF16"})  # what vLLM casts to the base's dtype when it loads a LoRA
# Qwen3-VL's vision tower and connector (vLLM's `get_mm_mapping`): LoRA there is applied only with
# `enable_tower_connector_lora`; without it vLLM loads the adapter and silently serves it without them.
TOWER_PREFIX = "visual"


class InvalidAdapter(ValueError):
    """The version's files are not an adapter serving may load; permanent for that version."""


@dataclass(frozen=True)
class AdapterPolicy:
    max_rank: int
    base_models: frozenset[str]  # names of the served base: its weights source, its served id, accepted others
    target_modules: frozenset[str]
    tower_connector_lora: bool = False
    base_sha256: str | None = None  # the served base's content digest, where it is a local folder


def copy_order(names: Iterable[str]) -> list[str]:
    """Weights and other files first, adapter_config.json last: its presence is what marks a complete folder."""
    return sorted(n for n in names if n != ADAPTER_CONFIG) + [ADAPTER_CONFIG]


def check_files(sizes: Mapping[str, int], checksums: Mapping[str, str]) -> None:
    """The file set: both required files, only .safetensors/.json, a recorded sha256 for each."""
    bad = sorted(n for n in sizes if not is_allowed_adapter_file(n))
    if bad:
        raise InvalidAdapter(f"files other than .safetensors/.json are not served: {', '.join(bad)}")
    missing = [n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if n not in sizes]
    if missing:
        raise InvalidAdapter(f"missing adapter files: {', '.join(missing)}")
    unrecorded = sorted(n for n in sizes if not _is_sha256(checksums.get(n, "")))
    if unrecorded:
        raise InvalidAdapter(f"no recorded sha256 checksum for: {', '.join(unrecorded)}")


def parse_adapter_config(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise InvalidAdapter("adapter_config.json is not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidAdapter("adapter_config.json is not a JSON object")
    return data


def check_adapter_config(data: Mapping[str, Any], policy: AdapterPolicy, base_model_tag: str | None = None,
                         base_sha256: str | None = None) -> int:
    """LoRA only, rank within the served max, base and target modules the served base has. Returns the rank.
    The adapter's own base name decides, unless it is an absolute path that is not the served base's: a run
    trained on another machine records that machine's path, so the tracker's portable base tag decides then;
    where both the run and the served base have a content digest, they must be the same weights."""
    if data.get("peft_type") != "LORA":
        raise InvalidAdapter(f"not a LoRA adapter (peft_type {data.get('peft_type')!r})")
    ranks = [data.get("r"), *dict(data.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks):
        raise InvalidAdapter("adapter_config.json has no valid LoRA rank 'r'")
    rank = max(ranks)
    if rank > policy.max_rank:
        raise InvalidAdapter(f"LoRA rank {rank} is above the served max_lora_rank {policy.max_rank}")
    recorded = data.get("base_model_name_or_path")
    machine_path = isinstance(recorded, str) and recorded.startswith("/")
    base = recorded if recorded and (recorded in policy.base_models or not machine_path) else base_model_tag or recorded
    if not base:
        raise InvalidAdapter("the adapter names no base model")
    if base not in policy.base_models:
        raise InvalidAdapter(f"base model {base!r} is not the served base")
    if base_sha256 and policy.base_sha256 and base_sha256 != policy.base_sha256:
        raise InvalidAdapter(f"trained on other base weights than the served ones (content sha256 "
                             f"{base_sha256[:12]}... vs {policy.base_sha256[:12]}...)")
    targets = data.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise InvalidAdapter("target_modules must be an explicit list (a regex cannot be checked against the base)")
    leaves = {str(t).rsplit(".", 1)[-1] for t in targets}
    unknown = sorted(leaves - policy.target_modules)
    if unknown:
        raise InvalidAdapter(f"target modules not in the served base: {', '.join(unknown)}")
    if data.get("modules_to_save"):
        raise InvalidAdapter("modules_to_save (full module copies) cannot be served as a LoRA")
    return rank


def safetensors_header_length(prefix: bytes) -> int:
    if len(prefix) < 8:
        raise InvalidAdapter(f"{ADAPTER_WEIGHTS} is truncated")
    (length,) = struct.unpack("<Q", prefix[:8])
    if not 2 <= length <= SAFETENSORS_HEADER_LIMIT:
        raise InvalidAdapter(f"{ADAPTER_WEIGHTS} is not a safetensors file")
    return length


def check_safetensors_header(header: bytes, rank: int, policy: AdapterPolicy) -> None:
    """LoRA tensors only (lora_A/lora_B) in a dtype the engine loads, none wider than the declared rank, and
    none on the vision tower/connector unless the engine is configured to apply them."""
    try:
        tensors = json.loads(header)
    except (UnicodeDecodeError, ValueError):
        raise InvalidAdapter(f"{ADAPTER_WEIGHTS} has an unreadable header") from None
    tensors = {k: v for k, v in tensors.items() if k != "__metadata__"} if isinstance(tensors, dict) else {}
    if not tensors:
        raise InvalidAdapter(f"{ADAPTER_WEIGHTS} holds no tensors")
    tower_modules: set[str] = set()
    for name, info in tensors.items():
        parts = name.split(".")
        shape = info.get("shape") if isinstance(info, dict) else None
        if "lora_A" in parts:
            inner = shape[0] if shape else None
        elif "lora_B" in parts:
            inner = shape[-1] if shape else None
        else:
            raise InvalidAdapter(f"{ADAPTER_WEIGHTS} holds a non-LoRA tensor {name!r}")
        if not isinstance(inner, int) or inner > rank:
            raise InvalidAdapter(f"tensor {name!r} has rank {inner}, above the declared rank {rank}")
        dtype = info.get("dtype")
        if dtype not in SERVED_DTYPES:
            raise InvalidAdapter(f"tensor {name!r} is {dtype}; the engine loads LoRA weights in "
                                 f"{', '.join(sorted(SERVED_DTYPES))}")
        if TOWER_PREFIX in parts:
            tower_modules.add(_module_pattern(parts))
    if tower_modules and not policy.tower_connector_lora:
        raise InvalidAdapter(f"LoRA weights on the vision tower/connector ({', '.join(sorted(tower_modules))}) are "
                             "applied by vLLM only with serving.enable_tower_connector_lora: true; without it they "
                             "would be silently dropped")


def _module_pattern(parts: list[str]) -> str:
    """`...model.visual.blocks.3.attn.qkv.lora_A.weight` -> `visual.blocks.*.attn.qkv` (one name per module kind)."""
    module = parts[parts.index(TOWER_PREFIX):next(i for i, p in enumerate(parts) if p in ("lora_A", "lora_B"))]
    return ".".join("*" if p.isdigit() else p for p in module)


def _is_sha256(value: str) -> bool:
    return len(value) == SHA256_HEX_LENGTH and all(c in "0123456789abcdef" for c in value)
