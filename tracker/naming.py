"""Pure naming rules: metric keys, eval keys, flattened and redacted params (no I/O)."""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Mapping

from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, _validate_metric_name

from rlops.config import MASK, mask_value

EVAL_PREFIX = "eval"
MAX_PARAM_VALUE = 6000  # MLflow truncates longer param values; we cut first so a resume compares equal
TAG_PARAM_CHANGED = "rlops.param_changed."  # + key: a param whose value changed on a resume
_ILLEGAL_KEY_CHARS = re.compile(r"[^\w./\- :]")


@lru_cache(maxsize=65536)
def metric_key(name: str) -> str:
    """The MLflow key of a trainer metric: the trainer's name with MLflow-illegal characters mapped
    (`@` -> `_at_` exactly as SkyRL's own MLflow backend does, anything else illegal -> `_`)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"metric name must be a non-empty string, got {name!r}")
    key = _ILLEGAL_KEY_CHARS.sub("_", name.replace("@", "_at_"))
    # Checked here, on the first use of a name (cached), so the server never has to reject the point.
    if len(key) > MAX_ENTITY_KEY_LENGTH:
        raise ValueError(f"metric {key[:60]!r}... is {len(key)} characters long; MLflow accepts keys of at "
                         f"most {MAX_ENTITY_KEY_LENGTH}")
    try:
        _validate_metric_name(key)
    except MlflowException as exc:
        raise ValueError(f"metric {name!r} (key {key!r}) is not a valid MLflow key: {exc.message}") from None
    return key


def eval_key(data_source: str, metric: str = "avg_score") -> str:
    """`eval/<data_source>/<metric>`: SkyRL's key for the per-eval-set score (contracts note)."""
    if not isinstance(data_source, str) or not data_source.strip("/"):
        raise ValueError(f"data_source must be a non-empty name such as 'maze_2d/easy', got {data_source!r}")
    return metric_key(f"{EVAL_PREFIX}/{data_source.strip('/')}/{metric}")


def as_float(name: str, value: Any) -> float:
    """A metric value as float; bools and numeric scalars (incl. 0-d tensors) are accepted."""
    if type(value) is float:  # the common case first: this runs for every point on the training thread
        return value
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"metric {name!r}: value must be a number, got {type(value).__name__}")


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


def check_metrics(metrics: Any) -> Mapping:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of name -> number, got {type(metrics).__name__}")
    return metrics


def flatten(data: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested mappings -> one level with dotted keys; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name, sep))
        else:
            flat[name] = value
    return flat


def redacted_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Flatten a training config into MLflow params; secret-looking keys and credential-looking values
    (tokens, keys, URI passwords) become `****` so they never reach the tracking server."""
    out: dict[str, str] = {}
    for key, value in flatten(params).items():
        masked = mask_value(key, value)
        if isinstance(masked, list) and MASK in masked:
            masked = MASK
        text = "None" if masked is None else str(masked)
        out[key] = text[:MAX_PARAM_VALUE]
    return out


def param_change_tags(changed: Mapping[str, str]) -> dict[str, str]:
    """A param changed since the run first logged it, as the tag that records the new value."""
    return {TAG_PARAM_CHANGED + key: value for key, value in changed.items()}


def split_param_changes(existing: Mapping[str, str], new: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(params to log, params whose value changed since the run first logged them).

    MLflow forbids changing a logged param, so on resume a changed value is recorded as a tag instead."""
    to_log = {k: v for k, v in new.items() if k not in existing}
    changed = {k: v for k, v in new.items() if k in existing and existing[k] != v}
    return to_log, changed
