"""The eval table: the tracker -> promotion contract for one eval of one step, whatever the task.

One row per eval item: `id` (the item's stable id within its eval set, a string), `passed` (the task's
verdict), `score` (its score, 0..1 for a pass/fail task) and `extras` (task-specific values, JSON-safe), plus
the `step` the tracker adds. Registration's paired test and `promote verify` compare evals by `id` and
`passed` only. Tables logged before this contract (the maze's `seed, solved, steps, final_distance`) read as
the same rows: id = seed, passed = score = solved, the rest as extras.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

EVAL_ROW_KEYS = ("id", "passed", "score", "extras")
LEGACY_ID, LEGACY_PASSED = "seed", "solved"  # the maze-only table's columns (written up to issue 29)


def table_rows(rows: Any, step: int) -> list[dict[str, Any]]:
    """An eval's rows as table rows (plain Python values, the step added); raises naming the first
    malformed row, before anything is logged."""
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
        raise TypeError(f"eval rows must be a list of dicts with {', '.join(EVAL_ROW_KEYS)}")
    table = []
    for i, row in enumerate(rows):
        missing = [k for k in EVAL_ROW_KEYS[:3] if k not in row]
        if missing:
            raise ValueError(f"eval row {i} lacks {', '.join(missing)} (need id, passed, score; extras optional)")
        extras = row.get("extras") or {}
        if not isinstance(extras, Mapping):
            raise TypeError(f"eval row {i}: extras must be a dict, got {type(extras).__name__}")
        table.append({"id": str(_plain(row["id"])), "passed": bool(_plain(row["passed"])),
                      "score": float(_plain(row["score"])), "extras": {str(k): _plain(v) for k, v in extras.items()},
                      "step": step})
    return table


def outcomes(rows: Iterable[Mapping]) -> dict[str, bool]:
    """id -> passed of an eval's rows (this contract's, or a legacy maze table's)."""
    result = {}
    for row in rows:
        if "id" in row:
            result[str(row["id"])] = bool(row["passed"])
        else:
            result[str(row[LEGACY_ID])] = bool(row[LEGACY_PASSED])
    return result


def table_outcomes(table: Mapping) -> dict[str, bool]:
    """id -> passed of a logged table (MLflow's `{"columns": [...], "data": [[...], ...]}`)."""
    columns = list(table["columns"])
    return outcomes(dict(zip(columns, values)) for values in table["data"])


def _plain(value: Any) -> Any:
    """numpy/torch scalars -> Python scalars, so a table row serializes to JSON."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 else value
