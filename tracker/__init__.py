"""tracker: GRPO run tracking into MLflow that never blocks training and never loses a point.

`RunSession` is the trainer-agnostic core; `sweep_stale_runs` settles runs whose process died silently;
`run_dir_status` and `flush_run_dir` inspect and drain what a stopped run left in its run dir.
Adapters: `tracker.hf.TrackerCallback` (transformers/TRL) and `tracker.skyrl` (imported only when used)."""
from tracker.drain import FlushReport, flush_run_dir
from tracker.lifecycle import RunTerminated
from tracker.session import RunSession
from tracker.state import run_dir_status
from tracker.sweep import sweep_stale_runs

__all__ = ["FlushReport", "RunSession", "RunTerminated", "flush_run_dir", "run_dir_status", "sweep_stale_runs"]
