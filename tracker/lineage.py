"""Names and lineage that read well on another machine: run names, the base model's portable identity,
LoggedModel params from the adapter itself, and the registered version's description (pure, except
`content_digest`, which reads the base's files)."""
from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping

from rlops.layout import TAG_BASE_MODEL, TAG_BASE_MODEL_SHA256, TAG_TRAINER

# What describes a base's identity: its config and weights (tokenizer files do not change what it computes).
BASE_FILES = ("config.json", "*.safetensors")
_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


def run_name(base_id: str, rank: int, now: datetime | None = None) -> str:
    """`grpo-<base>-r<rank>-<UTC date-time>`: what a run is, readable in the runs table."""
    now = now or datetime.now(timezone.utc)
    base = _SLUG.sub("-", base_id.rsplit("/", 1)[-1]).strip("-") or "base"
    return f"grpo-{base}-r{rank}-{now:%Y%m%d-%H%M%S}"


def portable_base_id(source: str | Path, served: Mapping[str, str]) -> str:
    """The base as another machine names it: the served id when `source` is a served base's weights
    (`served`: weights source -> served id), an HF id as it is, else the folder's name."""
    text = str(source)
    for weights, served_id in served.items():
        if Path(text).expanduser().resolve() == Path(weights).expanduser().resolve():
            return served_id
    return Path(text).name if Path(text).is_dir() else text


def base_files(folder: Path) -> list[Path]:
    """The files that make a base's identity (BASE_FILES), sorted."""
    return sorted({p for pattern in BASE_FILES for p in folder.glob(pattern) if p.is_file()})


def content_digest(folder: str | Path) -> str | None:
    """sha256 over the names and sha256 of the base's config and weight files; None when `source` is not
    a local folder (an HF id is resolved by the hub, which pins its own revision)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    files = base_files(folder)
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        inner = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                inner.update(chunk)
        digest.update(f"{path.name}\0{inner.hexdigest()}\n".encode())
    return digest.hexdigest()


def checkpoint_params(adapter_config: Path, model_tags: Mapping[str, str]) -> dict[str, str]:
    """LoggedModel params: what the adapter itself says (rank, alpha, target modules) and the run's base
    (portable id) and trainer, so checkpoints of different runs compare in the Models table."""
    try:
        config = json.loads(Path(adapter_config).read_text())
    except (OSError, ValueError):
        config = {}
    targets = config.get("target_modules")
    params = {
        "lora_rank": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "target_modules": ",".join(sorted(targets)) if isinstance(targets, list) else targets,
        "base_model": model_tags.get(TAG_BASE_MODEL),
        "base_model_sha256": model_tags.get(TAG_BASE_MODEL_SHA256),
        "trainer": model_tags.get(TAG_TRAINER),
    }
    return {k: str(v) for k, v in params.items() if v is not None}


def version_description(*, metric_key: str, value: float, step: int, run_name: str | None, run_id: str,
                        base_model: str | None, base_digest: str | None, eval_set: str | None,
                        eval_digest: str | None, beat_base: str | None = None) -> str:
    """The registered version's description: which score, where it came from, on which eval set, and how
    it beat the base (`beat_base`, the paired test's summary) when it was compared."""
    lines = [f"**{metric_key} = {value:.4g}** at step {step}",
             f"- run: {run_name or run_id} (`{run_id}`)",
             f"- base: {base_model or 'unknown'}" + (f", content sha256 `{base_digest}`" if base_digest else "")]
    if eval_set:
        lines.append(f"- eval set: {eval_set}, layout sha256 `{eval_digest or 'unknown'}`")
    if beat_base:
        lines.append(f"- beat the base (paired sign test): {beat_base}")
    return "\n".join(lines)
