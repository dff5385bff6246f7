"""Registration of one run's best checkpoint, never among a partial set.

`register_best` waits (up to `tracking.flush_timeout_s`) for every checkpoint and eval logged so far; if
they have not all landed, the registration becomes a job in the run dir (tag `rlops.registration=pending`)
that the uploader runs once they have, in this session or the next one on the run dir (or `rlops runs
flush`). With `tracking.register_on_eval`, each newly linked eval re-picks the best of its eval set.
Only a checkpoint that beats the base registers: the step-0 eval of the same eval set is the base's
score, and the two eval tables are compared by `tracker.baseline` (`tracking.beat_base_max_p`).
What to register and what to delete after is `tracker.registry`'s part. A queued registration carries the
rule of the run's own config (model, aliases, metric, beat-the-base bound, retention), so a run synced
from an offline machine registers as it would have online.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Mapping

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from rlops.config import Config
from rlops.layout import TAG_BASE_MODEL, TAG_BASE_MODEL_SHA256
from tracker import baseline, lineage, registry
from tracker.evals import eval_source
from tracker.inputs import EvalDatasets
from tracker.naming import eval_key
from tracker.rest import MlflowRest
from tracker.spool import Point

log = logging.getLogger(__name__)

TAG_REGISTRATION = "rlops.registration"
TAG_BEAT_BASE = "rlops.beat_base"  # on a registered version: the paired test it passed against the base
RULE_KEYS = ("registered_model", "register_aliases", "best_metric", "beat_base_max_p", "keep_best_checkpoints")


def rule_of(config: Config) -> dict:
    """The registration rule of a config, as a queued job keeps it."""
    return {key: getattr(config.tracking, key) for key in RULE_KEYS} | {"registered_model": config.registered_model}


def with_rule(config: Config, rule: Mapping | None) -> Config:
    return config.model_copy(update={"tracking": config.tracking.model_copy(update=dict(rule))}) if rule else config


class Registration:
    """`landed(timeout)`: everything logged so far has landed (checkpoints, tables, points);
    `points_landed(timeout)`: the points have; `queue(source, rule)`: a registration job behind the uploads."""

    def __init__(self, config: Config, client: MlflowClient, rest: MlflowRest, run_id: str, experiment_id: str,
                 state_path: Path, *, landed: Callable[[float], bool], points_landed: Callable[[float], bool],
                 queue: Callable[[str, dict], None], datasets: EvalDatasets, model_tags: Mapping[str, str]):
        self._config = config
        self._client = client
        self._rest = rest
        self._run_id = run_id
        self._experiment_id = experiment_id
        self._state = state_path
        self._landed = landed
        self._points_landed = points_landed
        self._queue = queue
        self._datasets = datasets
        self._model_tags = model_tags
        self.registered: ModelVersion | None = None
        self.refused: str | None = None  # why the last registration registered nothing, if it did not
        self.evidence: str | None = None  # how the registered checkpoint beat the base, when it was compared

    def register_best(self, source: str) -> ModelVersion | None:
        """Register now if everything landed in time, else queue it (returns None then, and when no
        checkpoint carries the metric)."""
        if self._landed(self._config.tracking.flush_timeout_s):
            return self.register(source)
        log.warning("register_best: checkpoints or evals are still pending; registration of %s waits for "
                    "them (pending in %s)", source, self._state)
        self._queue(source, rule_of(self._config))
        try:
            self._rest.set_tags(self._run_id, {TAG_REGISTRATION: "pending"})
        except Exception:  # noqa: BLE001 - the job in the run dir is the record; the tag is a courtesy
            pass
        return None

    def after_links(self, linked: list[Point]) -> None:
        """With `tracking.register_on_eval`, queue a re-pick of each eval set just linked."""
        if not self._config.tracking.register_on_eval:
            return
        suffix = "/" + self._config.tracking.best_metric
        for source in sorted({eval_source(p.key) for p in linked if p.key.endswith(suffix)} - {None}):
            self._queue(source, rule_of(self._config))

    def in_background(self, source: str, rule: Mapping | None = None) -> None:
        """Uploader thread: once the linked metrics have landed, register the current best by the job's rule."""
        if not self._points_landed(self._config.tracking.flush_timeout_s):
            raise TimeoutError("linked eval metrics not acknowledged yet")  # the uploader retries the job
        self.register(source, rule)

    def register(self, source: str, rule: Mapping | None = None) -> ModelVersion | None:
        """Register the best landed checkpoint of `source` into `config.registered_model`, set
        `tracking.register_aliases`, then apply `tracking.keep_best_checkpoints` (`rule`: a queued job's)."""
        config = with_rule(self._config, rule)
        key = eval_key(source, config.tracking.best_metric)
        models = registry.run_checkpoints(self._client, self._experiment_id, self._run_id)
        dataset = self._datasets.get(source)  # scores of other eval sets than the logged one never compare
        scored = registry.rank_checkpoints(models, key, dataset.digest if dataset else None)
        if not scored:
            log.warning("register_best: no checkpoint of run %s carries %s", self._run_id, key)
            return None
        comparison = self._base_comparison(source, scored[0].step, config.tracking.beat_base_max_p)
        if comparison is not None and not comparison.beats(config.tracking.beat_base_max_p):
            self.refused = comparison.refusal()
            log.warning("register_best: %s", self.refused)
            self._client.set_tag(self._run_id, TAG_REGISTRATION, self.refused)
            return None
        self.refused = None
        self.evidence = comparison.describe() if comparison is not None else None
        name = config.registered_model
        eval_sha256 = dataset.layout_sha256 if dataset else None
        description = lineage.version_description(
            metric_key=key, value=scored[0].value, step=scored[0].step, run_id=self._run_id,
            run_name=self._client.get_run(self._run_id).info.run_name,
            base_model=self._model_tags.get(TAG_BASE_MODEL),
            base_digest=self._model_tags.get(TAG_BASE_MODEL_SHA256), eval_set=source, eval_digest=eval_sha256,
            beat_base=self.evidence)
        version = registry.register_checkpoint(self._client, name, self._run_id, scored[0], key,
                                               config.tracking.register_aliases,
                                               eval_set_sha256=eval_sha256, description=description,
                                               tags={TAG_BEAT_BASE: self.evidence} if self.evidence else None)
        because = f"; {self.evidence}" if self.evidence else ""
        self._client.set_tag(self._run_id, TAG_REGISTRATION, f"{name} v{version.version} (step {scored[0].step}{because})")
        self.registered = version
        keep_best = config.tracking.keep_best_checkpoints
        if keep_best:
            protected = registry.registered_sources(self._client, name, self._run_id)
            for model_id in registry.retention_victims(models, scored, keep_best, protected):
                self._client.delete_logged_model(model_id)
        return version

    def _base_comparison(self, source: str, best_step: int, max_p: float | None) -> baseline.BaselineComparison | None:
        """The paired test of the checkpoint of `best_step` against the step-0 eval (the base), or None when
        the rule is off (`beat_base_max_p` null) or the run has no step-0 eval table of `source`."""
        if max_p is None:
            return None
        base = registry.eval_outcomes(self._client, self._run_id, source, 0)
        best = registry.eval_outcomes(self._client, self._run_id, source, best_step) if best_step else base
        if base is None or best is None:
            log.warning("register_best: run %s has no eval table of %s at step 0 and step %d: the best "
                        "checkpoint is not compared with the base", self._run_id, source, best_step)
            return None
        comparison = baseline.compare(base, best)
        log.info("register_best: %s on %s", comparison.describe(), source)
        return comparison
