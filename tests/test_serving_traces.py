"""Served requests as traces: the pure payload (images by digest, content off, streams folded), the maze
read back from its picture, and the writer's bounds against a real MLflow that is down."""
from __future__ import annotations

import base64
import hashlib
import io
import json
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

from rlops.processes import free_port
from rlops.task import image_data_url, load_task
from serving.trace_writer import TraceWriter, TraceWriterSettings
from rlops.layout import TRACE_IMAGE_REF as IMAGE_REF_PREFIX
from serving.traces import (TAG_CLIENT, ServedRequest, answer_texts, client_hash, sampled,
                            split_images, stream_answer, trace_counts, trace_payload)
from tasks.maze.env import read_image

MAZE = load_task("tasks.maze:MazeTask")
ITEM = MAZE.eval_items(MAZE.eval_sets()[0])[0]
SECRET_KEY = "sk-live-do-not-log-me"


def served(request: dict, answer: bytes | list, *, stream: bool = False, status: int = 200) -> ServedRequest:
    return ServedRequest(endpoint="chat", model_name="base:maze@production", registered_model="maze",
                         alias="production", version=3, canary=False,
                         client="key:" + hashlib.sha256(SECRET_KEY.encode()).hexdigest(), started_ns=time.time_ns(),
                         latency_ms=42.0, ttft_ms=40.0, status=status, usage=(12, 4),
                         request=json.dumps(request).encode(), answer=answer, stream=stream)


def chat_answer(text: str) -> bytes:
    return json.dumps({"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                       "usage": {"prompt_tokens": 12, "completion_tokens": 4}}).encode()


def test_images_leave_the_messages_as_references_to_their_digest():
    messages = ITEM.messages() + [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, {"type": "text", "text": "and this"}]}]
    out, images, texts = split_images(messages)
    png = base64.b64decode(ITEM.messages()[0]["content"][0]["image_url"]["url"].split(",", 1)[1])
    digest = hashlib.sha256(png).hexdigest()
    assert images == {digest: ("image/png", png)}
    assert out[0]["content"][0]["image_url"]["url"] == IMAGE_REF_PREFIX + digest
    assert out[1]["content"][0]["image_url"]["url"] == "https://example.com/cat.png"  # not fetched, kept as sent
    assert texts == [ITEM.text, "and this"]
    assert "base64" not in json.dumps(out)


def test_the_same_image_twice_is_one_image():
    _, images, _ = split_images(ITEM.messages() + ITEM.messages())
    assert len(images) == 1


def test_a_trace_names_the_version_and_the_client_by_hash_never_the_key():
    payload = trace_payload(served({"model": "base:maze@production", "messages": ITEM.messages(), "max_tokens": 20},
                                   chat_answer("right stop")), content=True)
    tags = payload.tags
    assert (tags["rlops.registered_model"], tags["rlops.alias"], tags["rlops.version"]) == ("maze", "production", "3")
    assert (tags["rlops.prompt_tokens"], tags["rlops.completion_tokens"], tags["rlops.ttft_ms"]) == ("12", "4", "40.0")
    assert len(tags[TAG_CLIENT]) == 16
    everything = json.dumps([payload.inputs, payload.outputs, payload.tags, payload.request_preview])
    assert SECRET_KEY not in everything and hashlib.sha256(SECRET_KEY.encode()).hexdigest() not in everything
    assert payload.outputs["choices"] == ["right stop"] and payload.response_id == "chatcmpl-1"
    assert payload.answer_text == "right stop" and payload.texts == [ITEM.text] and payload.ok


def test_content_off_keeps_metadata_only():
    payload = trace_payload(served({"model": "m", "messages": ITEM.messages(), "temperature": 0},
                                   chat_answer("right stop")), content=False)
    assert "messages" not in payload.inputs and "choices" not in payload.outputs
    assert payload.inputs == {"model": "base:maze@production", "temperature": 0}
    assert payload.response_preview == "" and ITEM.text not in payload.request_preview
    assert payload.tags["rlops.content"] == "false"
    assert payload.answer_text == "right stop"  # still scored, never stored


def test_a_stream_is_folded_into_one_answer():
    chunks = [b'data: {"id":"c-9","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
              'data: {"id":"c-9","choices":[{"index":0,"delta":{"content":"right "}}]}\n\n',
              b'data: {"id":"c-9","choices":[{"index":0,"delta":{"content":"stop"},"finish_reason":"stop"}]}\n\n'
              b'data: {"id":"c-9","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\ndata: [DONE]\n\n']
    answer = stream_answer(chunks)
    assert answer["id"] == "c-9" and answer["usage"]["completion_tokens"] == 2
    assert answer_texts(answer) == ["right stop"] and answer["choices"][0]["finish_reason"] == "stop"
    payload = trace_payload(served({"model": "m", "messages": ITEM.messages(), "stream": True}, chunks, stream=True),
                            content=True)
    assert payload.answer_text == "right stop" and payload.response_id == "c-9"


def test_an_engine_error_is_an_error_trace():
    error = b'{"error": {"message": "The model failed to answer.", "type": "server_error"}}'
    payload = trace_payload(served({"model": "m", "prompt": "x"}, error, status=500), content=True)
    assert not payload.ok and payload.outputs["error"]["type"] == "server_error"


@given(st.binary(max_size=300), st.booleans())
@settings(max_examples=60, deadline=None)
def test_any_bytes_make_a_trace_or_an_empty_one_never_an_exception(raw, stream):
    payload = trace_payload(ServedRequest("chat", "m", None, None, None, False, None, 0, 1.0, None, 400, None, raw,
                                          [raw] if stream else raw, stream), content=True)
    assert payload.tags["rlops.status"] == "400" and not payload.ok


def test_sampling_and_client_hash():
    assert sampled(0.1, 0.05) and not sampled(0.1, 0.1) and not sampled(0.0, 0.0) and sampled(1.0, 0.999)
    assert client_hash(None) is None and client_hash("user:a") != client_hash("user:b")


def test_trace_counts_read_the_replicas_metric():
    text = ('# TYPE ray_rlops_serving_traces_total counter\n'
            'ray_rlops_serving_traces_total{outcome="recorded",replica="a"} 5.0\n'
            'ray_rlops_serving_traces_total{outcome="recorded",replica="b"} 2.0\n'
            'ray_rlops_serving_traces_total{outcome="dropped",replica="a"} 3.0\n')
    assert trace_counts(text) == {"recorded": 7, "scored": 0, "dropped": 3, "failed": 0}


# ------------------------------------------------------------------------------ the maze from its picture


def test_every_eval_maze_is_read_back_from_its_picture_and_scored_the_same():
    for data_source in MAZE.eval_sets():
        for item in MAZE.eval_items(data_source)[:16]:
            png = base64.b64decode(image_data_url(item.image()).split(",", 1)[1])
            served_item = MAZE.request_item(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), item.text)
            assert served_item is not None, (data_source, item.id)
            for answer in ("right right down down stop", "down stop", "stop", "left up"):
                expected, got = MAZE.score(item, answer), MAZE.score(served_item, answer)
                assert (got.passed, got.score, got.extras) == (expected.passed, expected.score, expected.extras)


def test_a_picture_that_is_not_a_rendered_maze_is_not_scored():
    image = ITEM.image()
    lossy = io.BytesIO()
    Image.fromarray(image).save(lossy, format="JPEG", quality=70)
    assert read_image(np.asarray(Image.open(lossy).convert("RGB"))) is None
    assert read_image(image[:-1]) is None and read_image(np.zeros_like(image)) is None
    assert read_image(np.asarray(Image.fromarray(image).resize((image.shape[0] * 2,) * 2))) is None


# ------------------------------------------------------------------------------ the writer's bounds


def test_a_dead_mlflow_never_blocks_the_offer_and_what_does_not_fit_is_counted():
    """Nothing listens on the port: the one trace being retried holds the thread, the queue fills, the rest
    is dropped and counted; offering stays a few microseconds."""
    counts: dict[str, int] = {}
    settings_ = TraceWriterSettings(sample_rate=1.0, content=True, queue_size=8, queue_mib=64, experiment="never",
                                    tracking_uri=f"http://127.0.0.1:{free_port()}")
    writer = TraceWriter(settings_, lambda outcome, n: counts.__setitem__(outcome, counts.get(outcome, 0) + n)).start()
    try:
        request = served({"model": "m", "messages": ITEM.messages()}, chat_answer("stop"))
        writer.offer(request)
        time.sleep(0.5)  # the thread has taken the first one and is retrying it
        started = time.perf_counter()
        for _ in range(100):
            writer.offer(request)
        per_offer_ms = (time.perf_counter() - started) * 1000 / 100
        assert counts.get("dropped") == 100 - 8 and "recorded" not in counts
        assert per_offer_ms < 1.0, per_offer_ms
    finally:
        writer.stop()


def test_a_recorder_that_dies_is_started_again_and_what_it_held_counts_as_failed():
    """The MLflow work runs in a child process of the writer: killed, the request it held is counted as
    failed and the next request gets a new recorder; stopping the writer ends its recorder."""
    import psutil

    counts: dict[str, int] = {}
    settings_ = TraceWriterSettings(sample_rate=1.0, content=True, queue_size=8, queue_mib=64, experiment="never",
                                    tracking_uri=f"http://127.0.0.1:{free_port()}")  # retried: the recorder holds it
    writer = TraceWriter(settings_, lambda outcome, n: counts.__setitem__(outcome, counts.get(outcome, 0) + n)).start()
    request = served({"model": "m", "messages": ITEM.messages()}, chat_answer("stop"))

    def recorders() -> list[psutil.Process]:  # the session's stack servers are children of this process too
        found = []
        for child in psutil.Process().children():
            try:
                if "serving.trace_recorder" in child.cmdline():
                    found.append(child)
            except psutil.Error:  # gone, or a zombie not yet reaped
                pass
        return found

    def recorder() -> psutil.Process:
        deadline = time.monotonic() + 30
        while not (children := recorders()) and time.monotonic() < deadline:
            time.sleep(0.1)
        [child] = children
        return child

    try:
        writer.offer(request)
        first = recorder()
        first.kill()
        deadline = time.monotonic() + 10
        while counts.get("failed") != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert counts == {"failed": 1}
        writer.offer(request)
        second = recorder()
        assert second.pid != first.pid and second.is_running()
    finally:
        writer.stop()
    deadline = time.monotonic() + 10
    while recorders() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert recorders() == []


def test_the_queue_is_bounded_in_bytes_too():
    """Images make requests large: a queue of few entries may still not hold them all."""
    counts: dict[str, int] = {}
    request = served({"model": "m", "messages": ITEM.messages()}, chat_answer("stop"))
    settings_ = TraceWriterSettings(sample_rate=1.0, content=True, queue_size=100,
                                    queue_mib=2.5 * request.size / 2**20, experiment="never",
                                    tracking_uri=f"http://127.0.0.1:{free_port()}")
    writer = TraceWriter(settings_, lambda outcome, n: counts.__setitem__(outcome, counts.get(outcome, 0) + n))
    for _ in range(5):  # not started: nothing leaves the queue
        writer.offer(request)
    assert counts == {"dropped": 3}  # two fit in 2.5 requests' bytes
