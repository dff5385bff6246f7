"""Screenshots of the MLflow UI for the README, taken by headless Chromium (Debian's `chromium`) driven by
Playwright (`pip install 'rlops[docs]'`; Playwright's own browser download is not used).

Shows the latest runs of the configured experiment side by side (compare view) and their solve-rate
curves (chart view filtered to `eval/.../avg_score`). Usage: python scripts/screenshots.py [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from urllib.parse import quote

from mlflow import MlflowClient

from rlops.config import load_config

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


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
    client = MlflowClient(config.tracking_uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    if experiment is None:
        raise SystemExit(f"no experiment {config.tracking.experiment!r} at {config.tracking_uri}: run `rlops demo` first")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=args.runs)
    if not any(k.endswith("/avg_score") for r in runs for k in r.data.metrics):
        raise SystemExit("the runs have no eval/<data_source>/avg_score metric yet")
    base = config.tracking_uri.rstrip("/")
    exp = experiment.experiment_id
    compare_url = (f"{base}/#/compare-runs?runs={quote(json.dumps([r.info.run_id for r in runs]))}"
                   f"&experiments={quote(json.dumps([exp]))}")
    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(compare_url)
        page.wait_for_timeout(3000)
        close_assistant = page.locator('button[aria-label="Close"]')
        if close_assistant.count():
            close_assistant.first.click()
            page.wait_for_timeout(500)
        page.screenshot(path=str(args.out / "mlflow-compare-runs.png"))
        page.goto(f"{base}/#/experiments/{exp}/runs?compareRunsMode=CHART")
        page.wait_for_timeout(3000)
        page.get_by_placeholder("Search metric charts").fill("avg_score")
        page.wait_for_timeout(2000)
        page.wait_for_timeout(3000)
        page.screenshot(path=str(args.out / "mlflow-solve-rate.png"))
        browser.close()
    print(f"wrote {args.out}/mlflow-compare-runs.png and {args.out}/mlflow-solve-rate.png")


if __name__ == "__main__":
    main()
