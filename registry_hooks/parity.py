"""`promote verify`: does the endpoint serve what the tracker measured? The version's fixed eval set goes
through the running endpoint under its alias name, greedy, and the served solve rate is compared maze by
maze with the per-maze table the tracker logged for that checkpoint. The served figure is logged to the
version's LoggedModel (`served/<data_source>/avg_score`) and the differing mazes are reported.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from registry_hooks import registry
from registry_hooks.sync import NotFound, PromotionError
from rlops.config import Config
from rlops.layout import TAG_STEP
from tracker.evals import table_artifact
from tracker.registry import eval_outcomes

SERVED_METRIC = "served/{data_source}/avg_score"
REQUEST_WORKERS = 4


@dataclass
class ParityReport:
    model: str
    version: int
    served_name: str
    data_source: str
    tracked: float
    served: float
    mazes: int
    differing: list[str] = field(default_factory=list)  # ids (maze seeds) whose pass/fail outcome differs

    @property
    def matching(self) -> int:
        return self.mazes - len(self.differing)

    def to_dict(self) -> dict:
        return {"model": self.model, "version": self.version, "served_name": self.served_name,
                "data_source": self.data_source, "tracked_solve_rate": self.tracked, "served_solve_rate": self.served,
                "mazes": self.mazes, "matching": self.matching, "differing_seeds": self.differing}


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


def verify_served(config: Config, model: str, *, alias: str | None, version: int | None, endpoint: str,
                  api_key: str | None) -> ParityReport:
    """Run the fixed eval set of `model`'s version (at `alias`, or `version` pinned as `@v<N>`) through
    `endpoint` and compare with the tracked table; log the served figure on the LoggedModel."""
    from training import datasets as ds
    from training.maze import render, walk_answer
    from training.skyrl_env import image_data_url

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
    model_id = registered.model_id or registered.source.removeprefix("models:/")
    logged = client.get_logged_model(model_id)
    if TAG_STEP not in logged.tags:
        raise NotFound(f"version {version} was not logged by the tracker (its LoggedModel has no {TAG_STEP} tag)")
    step = int(logged.tags[TAG_STEP])
    maze_set = ds.local_eval_set(config.training.local.eval_size)
    tracked = tracked_rows(client, logged.source_run_id, maze_set.data_source, step)
    mazes = [m for m in maze_set.mazes() if str(m.seed) in tracked]
    ask = _chat(endpoint, api_key)
    max_tokens = config.training.local.max_completion_tokens

    def answer(maze) -> str:
        return ask(served_name, image_data_url(render(maze)), max_tokens)

    # The first maze alone: Ray's LLMServer loads an adapter racily, and a second concurrent first use of
    # one adapter fails ("already loaded", a 500), which is not the version's fault.
    with ThreadPoolExecutor(REQUEST_WORKERS) as pool:
        answers = [answer(m) for m in mazes[:1]] + list(pool.map(answer, mazes[1:]))
    served = {str(m.seed): walk_answer(m, a).solved for m, a in zip(mazes, answers)}
    report = ParityReport(model, version, served_name, maze_set.data_source,
                          tracked=sum(tracked.values()) / len(tracked), served=sum(served.values()) / len(served),
                          mazes=len(tracked), differing=compare(tracked, served))
    client.log_metric(logged.source_run_id, SERVED_METRIC.format(data_source=maze_set.data_source), report.served,
                      step=step, model_id=model_id)
    client.set_model_version_tag(model, str(version), "rlops.served_parity", f"{report.matching}/{report.mazes}")
    return report


def _chat(endpoint: str, api_key: str | None) -> Callable[[str, str, int], str]:
    import httpx

    from training import datasets as ds

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def ask(model: str, image_url: str, max_tokens: int) -> str:
        body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": ds.LOCAL_PROMPT}]}]}
        response = httpx.post(f"{endpoint.rstrip('/')}/v1/chat/completions", json=body, headers=headers, timeout=120)
        if response.status_code != 200:
            raise PromotionError(f"the endpoint answered {response.status_code} for {model}: "
                                 f"{response.json().get('error', {}).get('message', response.text[:200])}")
        return response.json()["choices"][0]["message"]["content"] or ""

    return ask
