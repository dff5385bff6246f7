"""`promote verify`: does the endpoint serve what the tracker measured? The version's eval set (the data
source of its registration metric) goes through the running endpoint under its alias name, greedy, and
each item's served outcome, scored by the task the run trained on (its `rlops.task` tag, else
`task.path`), is compared with the eval table the tracker logged for that checkpoint. The served figure
is logged to the version's LoggedModel (`served/<data_source>/avg_score`) and the differing items are reported.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from registry_hooks import registry
from registry_hooks.sync import NotFound, PromotionError
from rlops.chat_client import ChatClient, ChatError
from rlops.config import Config
from rlops.layout import TAG_METRIC_KEY, TAG_STEP, version_model_id
from rlops.task import TAG_TASK, TASK_PARAM_PREFIX, Task, TaskError, load_task
from tracker.evals import eval_source, table_artifact
from tracker.registry import eval_outcomes

SERVED_METRIC = "served/{data_source}/avg_score"


@dataclass
class ParityReport:
    model: str
    version: int
    served_name: str
    data_source: str
    task: str
    tracked: float
    served: float
    items: int
    differing: list[str] = field(default_factory=list)  # ids of the items whose pass/fail outcome differs

    @property
    def matching(self) -> int:
        return self.items - len(self.differing)

    def to_dict(self) -> dict:
        return {"model": self.model, "version": self.version, "served_name": self.served_name,
                "data_source": self.data_source, "task": self.task, "tracked_pass_rate": self.tracked,
                "served_pass_rate": self.served, "items": self.items, "matching": self.matching,
                "differing_ids": self.differing}


def compare(tracked: dict[str, bool], served: dict[str, bool]) -> list[str]:
    """Item ids whose outcome differs (an id missing on either side counts as differing)."""
    return sorted(i for i in tracked.keys() | served.keys() if tracked.get(i) != served.get(i))


def tracked_rows(client, run_id: str, data_source: str, step: int) -> dict[str, bool]:
    """id -> passed, from the tracker's eval table of `data_source` at `step`."""
    rows = eval_outcomes(client, run_id, data_source, step)
    if rows is None:
        raise NotFound(f"the run {run_id} has no eval table {table_artifact(data_source, step)}: the checkpoint "
                       f"was not evaluated on {data_source}")
    return rows


def version_task(config: Config, run) -> tuple[str, Task]:
    """(path, task) the version's run trained on: its `rlops.task` tag and `task.*` params when the tag
    names a task class (runs before tasks were pluggable tagged a description), else the configured one."""
    path = run.data.tags.get(TAG_TASK, "")
    if ":" in path:
        options = {k.removeprefix(TASK_PARAM_PREFIX): yaml.safe_load(v) for k, v in run.data.params.items()
                   if k.startswith(TASK_PARAM_PREFIX)}
    else:
        path, options = config.task.path, config.task.options
    try:
        return path, load_task(path, options)
    except TaskError as exc:
        raise PromotionError(f"cannot score the served answers: {exc}") from None


def verify_served(config: Config, model: str, *, alias: str | None, version: int | None, endpoint: str,
                  api_key: str | None) -> ParityReport:
    """Run the eval set of `model`'s version (at `alias`, or `version` pinned as `@v<N>`) through
    `endpoint` and compare with the tracked table; log the served figure on the LoggedModel."""
    client = registry.mlflow_client(config)
    if (alias is None) == (version is None):
        raise PromotionError("give exactly one of alias or version")
    if alias is not None:
        try:
            version = int(client.get_model_version_by_alias(model, alias).version)
        except Exception:  # noqa: BLE001
            raise NotFound(f"{model} has no alias {alias!r}") from None
        served_name = f"{config.serving.base_model_id}:{model}@{alias}"
    else:
        served_name = f"{config.serving.base_model_id}:{model}@v{version}"
    try:
        registered = client.get_model_version(model, str(version))
    except Exception:  # noqa: BLE001
        raise NotFound(f"version {version} of registered model {model!r} does not exist") from None
    model_id = version_model_id(registered.model_id, registered.source)
    if model_id is None:
        raise NotFound(f"version {version} was not registered from a LoggedModel (source {registered.source!r})")
    logged = client.get_logged_model(model_id)
    if TAG_STEP not in logged.tags:
        raise NotFound(f"version {version} was not logged by the tracker (its LoggedModel has no {TAG_STEP} tag)")
    step = int(logged.tags[TAG_STEP])
    task_path, task = version_task(config, client.get_run(logged.source_run_id))
    # the eval set its registration ranked on; a version registered by hand is checked on the task's fixed set
    data_source = eval_source(registered.tags.get(TAG_METRIC_KEY, "")) or task.eval_sets()[0]
    tracked = tracked_rows(client, logged.source_run_id, data_source, step)
    try:
        items = [it for it in task.eval_items(data_source) if it.id in tracked]
    except TaskError as exc:
        raise NotFound(f"version {version}: {exc}") from None
    try:
        answers = ChatClient(endpoint, api_key).answers(served_name, items, task.answer_length)
    except ChatError as exc:
        raise PromotionError(str(exc)) from None
    served = {it.id: task.score(it, a).passed for it, a in zip(items, answers)}
    report = ParityReport(model, version, served_name, data_source, task_path,
                          tracked=sum(tracked.values()) / len(tracked), served=sum(served.values()) / max(1, len(served)),
                          items=len(tracked), differing=compare(tracked, served))
    client.log_metric(logged.source_run_id, SERVED_METRIC.format(data_source=data_source), report.served,
                      step=step, model_id=model_id)
    client.set_model_version_tag(model, str(version), "rlops.served_parity", f"{report.matching}/{report.items}")
    return report
