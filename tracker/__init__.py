"""tracker: GRPO run tracking into MLflow that never blocks training and never loses a point.

`RunSession` is the trainer-agnostic core; adapters: `tracker.hf.TrackerCallback` (transformers/TRL),
`tracker.skyrl` (SkyRL callback + experiment class, imported only when used)."""
from tracker.session import RunSession, RunTerminated

__all__ = ["RunSession", "RunTerminated"]
