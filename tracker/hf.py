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
Throughput and wall time per phase (`perf/*`): `step_s` (generation + optimisation, mean per step since
the last log), `tokens_per_s` (TRL's `num_tokens`, prompt and completion tokens seen, per second of wall
time since the last log), `checkpoint_s` (end of the step to the checkpoint hook: logging and saving) and
`wall_s` (since training began).
The callback never ends the run: whoever started the session owns its end.
"""
from __future__ import annotations

import numbers
import time
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
# The Trainer's last log (train_runtime, train_loss, ...) comes at the step its last step's log already
# covered, with that step's epoch again; logging its epoch or a perf/* interval would give a key two points.
TRAIN_SUMMARY_KEY = "train_runtime"


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
        self._clock = PhaseClock()

    def on_train_begin(self, args, state, control, **kwargs):
        self._clock.begin()

    def on_step_begin(self, args, state, control, **kwargs):
        self._clock.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self._clock.step_end()
        if state.is_world_process_zero and control.should_save:
            self.session.barrier()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            metrics = train_metrics(logs)
            if TRAIN_SUMMARY_KEY in logs:  # the end-of-training summary: its own keys only (see TRAIN_SUMMARY_KEY)
                metrics.pop(TRL_TO_SKYRL["epoch"], None)
            elif metrics:
                metrics.update(self._clock.interval(logs.get("num_tokens")))
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
            self.session.log_metrics(self._clock.since_step_end("perf/checkpoint_s"), step=state.global_step)


class PhaseClock:
    """Wall time per phase of a training loop, read on the training thread (a few clock reads per step)."""

    def __init__(self):
        self.started = self._last_log = self._step_begin = self._step_end = time.monotonic()
        self._step_s: list[float] = []
        self._tokens: float | None = None

    def begin(self) -> None:
        self.started = self._last_log = self._step_end = time.monotonic()

    def step_begin(self) -> None:
        self._step_begin = time.monotonic()

    def step_end(self) -> None:
        self._step_end = time.monotonic()
        self._step_s.append(self._step_end - self._step_begin)

    def interval(self, tokens_seen: Any) -> dict[str, float]:
        """perf/* since the last call: mean step time, tokens per second (from a cumulative count), wall."""
        now = time.monotonic()
        out = {"perf/wall_s": now - self.started}
        if self._step_s:
            out["perf/step_s"] = sum(self._step_s) / len(self._step_s)
        if isinstance(tokens_seen, numbers.Real) and self._tokens is not None and now > self._last_log:
            out["perf/tokens_per_s"] = (float(tokens_seen) - self._tokens) / (now - self._last_log)
        if isinstance(tokens_seen, numbers.Real):
            self._tokens = float(tokens_seen)
        self._step_s, self._last_log = [], now
        return out

    def since_step_end(self, key: str) -> dict[str, float]:
        return {key: time.monotonic() - self._step_end}
