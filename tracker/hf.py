"""transformers/TRL adapter: a `TrainerCallback` that feeds TRL's GRPOTrainer events into a RunSession.

Metric names: where TRL's meaning matches SkyRL's, the SkyRL name is used so runs of both trainers chart
together; every other key keeps TRL's name (MLflow-illegal characters mapped as in `tracker.naming`).

| TRL (`on_log`)            | logged as                    |
|---------------------------|------------------------------|
| `loss`                    | `policy/final_loss`          |
| `policy_loss`             | `policy/policy_loss`         |
| `learning_rate`           | `policy/policy_lr`           |
| `grad_norm`               | `policy/grad_norm`           |
| `kl`                      | `policy/policy_kl`           |
| `entropy`                 | `policy/policy_entropy`      |
| `completions/mean_length` | `policy/response_length`     |
| `reward`                  | `reward/avg_raw_reward`      |
| `epoch`                   | `trainer/epoch`              |
| anything else             | its own name                 |

`on_evaluate`: `eval_<name>` -> `eval/<data_source>/<name>`, and `eval_<score_metric>` (default
`eval_reward`) -> `eval/<data_source>/avg_score`, linked to the checkpoint of the same step.
`on_save`: the PEFT adapter in `<output_dir>/checkpoint-<step>/` is logged as a LoggedModel. Before the
Trainer writes a checkpoint (`control.should_save` at `on_step_end`/`on_log`), the session's queued
points are written to its spool, so resuming from that checkpoint after a kill -9 replays every lost step.
The callback never ends the run: whoever started the session owns its end.
"""
from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any, Mapping

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tracker.session import RunSession

TRL_TO_SKYRL = {
    "loss": "policy/final_loss",
    "policy_loss": "policy/policy_loss",
    "learning_rate": "policy/policy_lr",
    "grad_norm": "policy/grad_norm",
    "kl": "policy/policy_kl",
    "entropy": "policy/policy_entropy",
    "completions/mean_length": "policy/response_length",
    "reward": "reward/avg_raw_reward",
    "epoch": "trainer/epoch",
}
EVAL_PREFIX = "eval_"


def numeric(logs: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a log dict (TRL also logs strings and summaries such as `train_runtime`)."""
    return {k: float(v) for k, v in logs.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}


def train_metrics(logs: Mapping[str, Any]) -> dict[str, float]:
    return {TRL_TO_SKYRL.get(k, k): v for k, v in numeric(logs).items() if not k.startswith(EVAL_PREFIX)}


def eval_metrics(metrics: Mapping[str, Any], data_source: str, score_metric: str) -> dict[str, float]:
    out = {}
    for key, value in numeric(metrics).items():
        if not key.startswith(EVAL_PREFIX):
            continue
        name = key[len(EVAL_PREFIX):]
        out[f"eval/{data_source}/{'avg_score' if name == score_metric else name}"] = value
    return out


class TrackerCallback(TrainerCallback):
    def __init__(self, session: RunSession, *, eval_data_source: str | None = None, score_metric: str = "reward"):
        if not isinstance(session, RunSession):
            raise TypeError(f"TrackerCallback needs a tracker.RunSession, got {type(session).__name__}")
        self.session = session
        self.eval_data_source = eval_data_source or session.config.training.eval_data_source
        self.score_metric = score_metric

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and control.should_save:
            self.session.barrier()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            metrics = train_metrics(logs)
            if metrics:
                self.session.log_metrics(metrics, step=state.global_step)
            if control.should_save:
                self.session.barrier()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero and metrics:
            linked = eval_metrics(metrics, self.eval_data_source, self.score_metric)
            if linked:
                self.session.log_eval_metrics(linked, step=state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            self.session.log_checkpoint(folder, step=state.global_step)
