"""Screenshots of the MLflow UI for the README, taken by headless Chromium (Debian's `chromium`) driven by
Playwright (`pip install 'rlops[docs]'`; Playwright's own browser download is not used).

Shows the latest runs of the configured experiment side by side (compare view), their solve-rate curves
(chart view filtered to `eval/.../avg_score`), the latest run's rollout table with maze images
(`eval/samples/step_N.json`), the runs filtered by their eval set (MLflow's dataset filter), and the page
of the latest served version with its promotion tags, and the traces of the requests it served (its
LoggedModel's Traces tab: task scores and client feedback). Usage: python scripts/screenshots.py [--runs 3]
"""
from __future__ import annotations

import argparse
import base64
import json
import shutil
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

from mlflow import MlflowClient

from rlops.config import load_config

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SAMPLES_DIR = "eval/samples"  # tracker.samples.EVAL_SAMPLES_DIR (this script imports no tracker code)
SERVED_AS_TAG = "serving.aliases"  # registry_hooks.registry.SERVED_AS_TAG
HISTORY_TAG = "serving.history"  # registry_hooks.registry.HISTORY_TAG
CONTEXT_TAG = "mlflow.data.context"


class Shot(NamedTuple):
    file: str
    url: str
    chart_search: str | None = None  # typed into the chart view's metric search
    scroll_to: str | None = None  # text scrolled into view (a version's tag table scrolls on its own)


def ui_param(value) -> str:
    """A list-valued runs-page URL parameter as MLflow's UI writes it: base64 of the JSON, URL-quoted."""
    return quote(base64.b64encode(json.dumps(value).encode()).decode())


def latest_samples(client: MlflowClient, runs) -> tuple[str, str] | None:
    """(run id, artifact path) of the newest run's last eval sample table."""
    for run in runs:
        tables = [f.path for f in client.list_artifacts(run.info.run_id, SAMPLES_DIR) if f.path.endswith(".json")]
        if tables:
            return run.info.run_id, max(tables, key=lambda p: int(p.rsplit("_", 1)[1].removesuffix(".json")))
    return None


def eval_dataset_filter(runs) -> list[dict] | None:
    """The newest run's eval set as the runs page's dataset filter (name, digest, context)."""
    for run in runs:
        for item in run.inputs.dataset_inputs if run.inputs else []:
            tags = {t.key: t.value for t in item.tags}
            if tags.get(CONTEXT_TAG) == "eval":
                return [{"name": item.dataset.name, "digest": item.dataset.digest, "context": "eval"}]
    return None


def served_version(client: MlflowClient, name: str):
    """The newest version of `name` that promotion tagged as served."""
    versions = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get(SERVED_AS_TAG)]
    return max(versions, key=lambda v: int(v.version)) if versions else None


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser_path:
        raise SystemExit("chromium not found: apt-get install chromium")
    config = load_config()
    client = MlflowClient(config.tracking_uri, registry_uri=config.tracking_uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    if experiment is None:
        raise SystemExit(f"no experiment {config.tracking.experiment!r} at {config.tracking_uri}: "
                         "run `rlops demo` first")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"],
                              max_results=args.runs)
    if not any(k.endswith("/avg_score") for r in runs for k in r.data.metrics):
        raise SystemExit("the runs have no eval/<data_source>/avg_score metric yet")
    base = config.tracking_uri.rstrip("/")
    exp = experiment.experiment_id
    shots = [  # in the order the README shows them
        Shot("mlflow-compare-runs.png", f"{base}/#/compare-runs?runs={quote(json.dumps([r.info.run_id for r in runs]))}"
                                        f"&experiments={quote(json.dumps([exp]))}"),
        Shot("mlflow-solve-rate.png", f"{base}/#/experiments/{exp}/runs?compareRunsMode=CHART", "avg_score")]
    samples = latest_samples(client, runs)
    if samples:
        run_id, table = samples
        shots.append(Shot("mlflow-rollouts.png", f"{base}/#/experiments/{exp}/runs/{run_id}/artifacts/{table}"))
    datasets = eval_dataset_filter(runs)
    if datasets:
        shots.append(Shot("mlflow-dataset-filter.png", f"{base}/#/experiments/{exp}/runs?datasetsFilter="
                                                       f"{ui_param(datasets)}"))
    version = served_version(client, config.registered_model)
    traced = None
    if version:
        shots.append(Shot("mlflow-version-promotion.png",
                          f"{base}/#/models/{quote(config.registered_model)}/versions/{version.version}",
                          scroll_to=HISTORY_TAG))
        model_id = version.model_id or version.source.removeprefix("models:/")  # registered from a LoggedModel
        traced = client.search_traces(locations=[exp], model_id=model_id, max_results=1, include_spans=False)
    if traced:
        shots.append(Shot("mlflow-traces.png", f"{base}/#/experiments/{exp}/models/{model_id}/traces"))
    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        for shot in shots:
            page.goto(shot.url)
            page.wait_for_timeout(3000)
            close_assistant = page.locator('button[aria-label="Close"]')
            if close_assistant.count():
                close_assistant.first.click()
                page.wait_for_timeout(500)
            got_it = page.get_by_role("button", name="Got it")  # a feature tour's popover (the traces tab)
            if got_it.count():
                got_it.first.click()
                page.wait_for_timeout(500)
            if shot.chart_search:
                page.get_by_placeholder("Search metric charts").fill(shot.chart_search)
                page.wait_for_timeout(5000)
            if shot.scroll_to:
                page.get_by_text(shot.scroll_to, exact=True).scroll_into_view_if_needed()
                page.wait_for_timeout(1000)
            page.screenshot(path=str(args.out / shot.file))
        browser.close()
    missing = {"mlflow-rollouts.png": samples, "mlflow-dataset-filter.png": datasets,
               "mlflow-version-promotion.png": version, "mlflow-traces.png": traced}
    print(f"wrote {', '.join(str(args.out / shot.file) for shot in shots)}")
    for name, found in missing.items():
        if not found:
            print(f"not taken: {name} (no sample table / eval dataset input / served version / traced request yet)")


if __name__ == "__main__":
    main()
