"""The ingress's body checks (serving/validation.py), pure: what vLLM would take and then fail on with a 500."""
from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import pytest

from serving.ingress import ClientError, parse_request
from serving.validation import Base64Bytes, RequestError, RequestLimits, check_body, image_size

PIXELS = 64 * 64
LIMITS = RequestLimits(max_image_pixels=PIXELS, max_n=4, max_request_tokens=64)


def png(width: int, height: int) -> bytes:
    """A PNG header claiming width x height, with a tiny (wrong) IDAT: only the header may be read."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def jpeg(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "red").save(buffer, format="JPEG", exif=b"Exif\0\0" + b"\0" * 3000)
    return buffer.getvalue()


def data_url(image: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(image).decode()


def chat(*messages, **extra) -> dict:
    return {"model": "m", "messages": list(messages), **extra}


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def refusal(data: dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_body(data, chat=True, limits=LIMITS)
    return info.value


def test_sizes_come_from_png_and_jpeg_headers():
    assert image_size(Base64Bytes(base64.b64encode(png(640, 480)).decode())) == (640, 480)
    assert image_size(Base64Bytes(base64.b64encode(jpeg(33, 17)).decode())) == (33, 17)  # past a 3 kB EXIF segment
    unpadded = base64.b64encode(png(7, 9)).decode().rstrip("=")
    assert image_size(Base64Bytes(unpadded)) == (7, 9)
    for junk in (b"GIF89a" + b"\0" * 20, b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xe0\x00\x10JFIF", b""):
        assert image_size(Base64Bytes(base64.b64encode(junk).decode())) is None


def test_oversized_image_is_refused_from_its_header_alone():
    huge = base64.b64encode(png(100_000, 100_000)).decode()
    # Only the first bytes are base64: the rest would fail to decode if it were read.
    error = refusal(chat(user(image("data:image/png;base64," + huge[:32] + "!!!!" * 1000))))
    assert error.code == "image_too_large" and "100000x100000" in error.message
    assert error.param == "messages[0].content[0].image_url"
    check_body(chat(user(image(data_url(png(64, 64))), {"type": "text", "text": "x"})), chat=True,
               limits=LIMITS)
    assert refusal(chat(user(image(data_url(jpeg(65, 64), "image/jpeg"))))).code == "image_too_large"


@pytest.mark.parametrize("data, code, needle", [
    (chat(), "empty_array", "'messages' is empty"),
    ({"model": "m"}, "invalid_type", "'messages' is required"),
    (chat("hi"), "invalid_type", "'messages[0]' must be an object"),
    (chat({"role": "wizard", "content": "x"}), "invalid_value", "supported roles"),
    (chat({"content": "x"}), "invalid_value", "'messages[0].role' is missing"),
    (chat({"role": "user", "content": 5}), "invalid_type", "string or a list"),
    (chat({"role": "user"}), "invalid_type", "string or a list"),
    (chat(user({"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}})), "unsupported_content", "'input_audio'"),
    (chat(user({"type": "file", "file": {}})), "unsupported_content", "'file'"),
    (chat(user("just a string part")), "invalid_type", "must be a content part object"),
    (chat(user({"text": "x"})), "unsupported_content", "'text' parts"),
    (chat(user({"type": "text", "text": 3})), "invalid_type", ".text' must be a string"),
    (chat({"role": "system", "content": [image(data_url(png(4, 4)))]}), "unsupported_content", "only user messages"),
    (chat(user(image("http://169.254.169.254/latest/meta-data"))), "invalid_image_url", "data URLs"),
    (chat(user(image("file:///etc/passwd"))), "invalid_image_url", "data URLs"),
    (chat(user(image("data:image/png,rawbytes"))), "invalid_image_url", "base64 data URL"),
    (chat(user(image("data:image/png;base64,%%%%"))), "invalid_image", "not valid base64"),
    (chat(user(image(data_url(b"GIF89a" + b"\0" * 20)))), "invalid_image", "not a PNG or JPEG"),
    (chat(user({"type": "text", "text": "x"}), max_tokens=0), "invalid_value", "'max_tokens' must be at least 1"),
    (chat(user({"type": "text", "text": "x"}), max_completion_tokens=-3), "invalid_value", "at least 1"),
])
def test_bad_chat_bodies_are_refused_with_a_specific_message(data, code, needle):
    error = refusal(data)
    assert error.code == code and needle in error.message, error.message
    assert "169.254" not in error.message and "/etc/passwd" not in error.message


def test_good_bodies_pass():
    check_body(chat({"role": "system", "content": "be brief"}, user({"type": "text", "text": "x"}),
                    {"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool", "content": "ok"},
                    max_tokens=1), chat=True, limits=LIMITS)
    check_body({"model": "m", "prompt": "x", "max_tokens": 4}, chat=False, limits=LIMITS)
    with pytest.raises(RequestError):
        check_body({"model": "m", "prompt": "x", "max_tokens": 0}, chat=False, limits=LIMITS)


@pytest.mark.parametrize("extra, param, code", [
    ({"n": 5}, "n", "invalid_value"),
    ({"best_of": 5, "max_tokens": 1}, "best_of", "invalid_value"),
    ({"n": 4, "max_tokens": 17}, "max_tokens", "token_budget_exceeded"),
    ({"n": 2, "max_completion_tokens": 33}, "max_completion_tokens", "token_budget_exceeded"),
    ({"max_tokens": 65}, "max_tokens", "token_budget_exceeded"),
])
def test_fan_out_and_token_budget_above_the_limits_name_the_parameter(extra, param, code):
    for data in (chat(user({"type": "text", "text": "x"}), **extra), {"model": "m", "prompt": "x", **extra}):
        with pytest.raises(RequestError) as info:
            check_body(data, chat="messages" in data, limits=LIMITS)
        assert (info.value.param, info.value.code) == (param, code) and str(LIMITS.max_n if param in ("n", "best_of")
                                                                            else LIMITS.max_request_tokens) in info.value.message


def test_requests_at_the_limits_pass():
    for extra in ({"n": 4, "max_tokens": 16}, {"n": 4}, {"best_of": 2, "n": 2, "max_tokens": 32}, {"max_tokens": 64},
                  {"n": "x"}):  # a wrong type is vLLM's to name
        check_body({"model": "m", "prompt": "x", **extra}, chat=False, limits=LIMITS)


def test_parse_request_answers_refusals_as_openai_400s():
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest

    with pytest.raises(ClientError) as info:
        parse_request(json.dumps(chat()).encode(), ChatCompletionRequest, LIMITS)
    assert (info.value.status, info.value.param, info.value.code) == (400, "messages", "empty_array")
    body = parse_request(json.dumps(chat(user(image(data_url(png(8, 8)))))).encode(), ChatCompletionRequest, LIMITS)
    assert body.model == "m"
    # A completions body has no messages: only its token limit is checked.
    assert parse_request(b'{"model": "m", "prompt": "x", "max_tokens": 2}', CompletionRequest, LIMITS).max_tokens == 2
