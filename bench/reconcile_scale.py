"""Reconciler pass time at N registered models, each with a `production` alias listed in registry.models.

Ours: `registry_hooks.reconcile.run_pass` (what `rlops hooks serve` runs each interval): paged
`search_registered_models` over `name IN (...)` chunks, one `_routes/` listing with ETags (manifests
fetched only when their ETag changed), syncs only for models whose manifest differs from their intent,
`hooks.reconcile_concurrency` at a time. Figures: a no-op pass with a warm manifest cache (median of
--runs), and a pass right after 1% of the aliases moved to a new version (those syncs copy real folders).
Baseline, measured in the same run on the same stack: the per-model path the reconciler ran before
(`sync_model` for every model, one after another, as its single worker did), timed over a sample of at
most --baseline-sample models and scaled to N (it is linear: each model costs the same requests).
Setup, not timed: models are registered over MLflow's REST API (each version is one real LoggedModel with
the tracker's sha256 tags) and their v1 folder + manifest are seeded as a sync leaves them.
Goals (issue 20, 2 cores): no-op pass < 5 s at 1000 models and < 30 s at 10k.

Usage: python bench/reconcile_scale.py [--models 1000[,10000]] [--runs 3] [--baseline-sample 1000]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _many_models import move_aliases, register_models  # noqa: E402
from _results import record  # noqa: E402
from _scratch import scratch_stack  # noqa: E402
from promotion import MODEL, register, write_adapter  # noqa: E402

from registry_hooks import registry, storage  # noqa: E402
from registry_hooks.sync import sync_model  # noqa: E402
from registry_hooks.reconcile import ManifestCache, run_pass  # noqa: E402
from registry_hooks.sync import Promoter  # noqa: E402
from rlops.layout import AliasRoute, HistoryEntry, RoutesManifest, utc_now, version_folder  # noqa: E402

GOALS = {1000: 5.0, 10000: 30.0}


def seed_published(promoter: Promoter, names: list[str], model_id: str, threads: int = 16) -> None:
    """What a first sync leaves: v1's files copied into `<name>-v1/` (config last) and a manifest naming it."""
    source = registry.version_source(promoter.mlflow, MODEL, 1)
    location = registry.artifact_s3_location(promoter.config, source.artifact_uri)
    files = storage.list_folder(promoter.dest, location.bucket, location.prefix)
    checksums = {name: source.checksums[name] for name in files}

    def publish(name: str) -> None:
        folder = version_folder(name, 1)
        for file in sorted(files, key=lambda f: f == "adapter_config.json"):
            storage.server_side_copy(promoter.dest, storage.ObjectRef(location.bucket, location.key(file)),
                                     storage.ObjectRef(promoter.location.bucket, promoter.location.key(folder, file)),
                                     files[file].size)
        now = utc_now()
        route = AliasRoute(version=1, folder=folder, files=checksums, promoted_at=now, trigger="bench-seed")
        manifest = RoutesManifest(model=name, generation=1, updated_at=now, aliases={"production": route},
                                  history=[HistoryEntry(alias="production", version=1, at=now, trigger="bench-seed")])
        storage.write_manifest(promoter.dest, promoter.location, manifest, None)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(publish, names))


def sync_each(config, models: list[str]) -> float:
    started = time.perf_counter()
    for model in models:
        sync_model(config, model, trigger="reconciler")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="1000", help="comma-separated model counts, e.g. 1000,10000")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline-sample", type=int, default=1000)
    parser.add_argument("--moved-pct", type=float, default=1.0)
    args = parser.parse_args()
    sizes = sorted(int(n) for n in args.models.split(","))
    names = [f"scale-{i:05d}" for i in range(sizes[-1])]
    with scratch_stack(registry={"models": [MODEL]}) as (config, root):
        adapter = root / "adapter"
        write_adapter(adapter, 1, config.base_model_source)
        register(config, adapter)
        model_id = mlflow.MlflowClient(config.tracking_uri).get_model_version(MODEL, "1").source[len("models:/"):]
        started = time.perf_counter()
        register_models(config.tracking_uri, names, model_id)
        seed_published(Promoter(config), names, model_id)
        print(f"setup: {len(names)} registered models with a published v1 in {time.perf_counter() - started:.0f} s")
        rng = random.Random(0)
        for n in sizes:
            cfg = config.model_copy(deep=True)
            cfg.registry.models = names[:n]
            promoter, cache = Promoter(cfg), ManifestCache()

            def sync(model: str) -> bool:
                sync_model(cfg, model, trigger="reconciler")  # raises on failure: the bench stops
                return True

            def one_pass():
                return run_pass(promoter, cache, sync, cfg.hooks.reconcile_concurrency)

            cold = one_pass()  # after a restart: every manifest is fetched once
            assert cold.models_synced == 0 and cold.manifests_fetched == n, cold
            warm = [one_pass() for _ in range(args.runs)]
            assert all(p.models_synced == 0 and p.manifests_fetched == 0 for p in warm), warm
            noop = statistics.median(p.seconds for p in warm)

            sample = names[:min(n, args.baseline_sample)]
            baseline = sync_each(cfg, sample) * n / len(sample)

            moved = rng.sample(names[:n], max(1, round(n * args.moved_pct / 100)))
            move_aliases(cfg.tracking_uri, moved, model_id)
            after_move = one_pass()
            assert after_move.models_synced == len(moved) and after_move.sync_failures == 0, after_move
            one_pass()  # fetch the republished manifests before the next size

            goal = GOALS.get(n)
            verdict = "" if goal is None else f" (goal < {goal:g} s: {'met' if noop < goal else 'MISSED'})"
            print(f"{n} models: no-op pass {noop:.2f} s{verdict}, cold (all manifests fetched) {cold.seconds:.2f} s; "
                  f"per-model path {baseline:.1f} s (over {len(sample)} models, scaled); ratio {baseline / noop:.1f}x")
            print(f"{n} models, {len(moved)} aliases moved: pass {after_move.seconds:.2f} s "
                  f"({len(moved)} syncs at concurrency {cfg.hooks.reconcile_concurrency}); ratio {baseline / after_move.seconds:.1f}x")
            record(f"reconcile_scale.py:noop_{n}", noop, "s", baseline, baseline / noop,
                   f"no-op pass < {goal:g} s on 2 cores" if goal else "no-op pass")
            record(f"reconcile_scale.py:moved_{n}", after_move.seconds, "s", baseline, baseline / after_move.seconds,
                   f"pass with {args.moved_pct:g}% of aliases moved, vs the per-model no-op pass")


if __name__ == "__main__":
    main()
