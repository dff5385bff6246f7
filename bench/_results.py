"""Merge one benchmark's entry into bench/results.json (several scripts share the file)."""
from __future__ import annotations

import datetime
import fcntl
import json
from pathlib import Path

RESULTS = Path(__file__).with_name("results.json")


def record(script: str, figure: float, unit: str, baseline: float | None, ratio: float | None, goal: str) -> dict:
    entry = {
        "figure": round(figure, 4), "unit": unit,
        "baseline": None if baseline is None else round(baseline, 4),
        "ratio": None if ratio is None else round(ratio, 4),
        "goal": goal, "measured_at": datetime.date.today().isoformat(),
    }
    with open(RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(RESULTS.read_text()) if RESULTS.exists() and RESULTS.read_text().strip() else {}
        data[script] = entry
        RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return entry
