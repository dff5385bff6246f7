"""tracker: GRPO run tracking into MLflow that never blocks training and never loses a point.

`RunSession` is the trainer-agnostic core; `sweep_stale_runs` settles runs whose process died silently;
`run_dir_status` and `flush_run_dir` inspect and drain what a stopped run left in its run dir; `sync_runs`
replays offline runs (run dirs or bundles, `export_run_dir`) into MLflow.
Adapters: `tracker.hf.TrackerCallback` (transformers/TRL) and `tracker.skyrl` (imported only when used)."""
from tracker.bundle import BundleError, export_run_dir
from tracker.drain import FlushReport, flush_run_dir, sync_runs
from tracker.lifecycle import RunTerminated
from tracker.session import RunSession
from tracker.state import run_dir_status
from tracker.sweep import sweep_stale_runs

__all__ = ["BundleError", "FlushReport", "RunSession", "RunTerminated", "export_run_dir", "flush_run_dir",
           "run_dir_status", "sweep_stale_runs", "sync_runs"]
