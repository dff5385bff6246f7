"""What the ingress checks in a request body before the engine sees it (pure: no I/O, no Ray, no vLLM).

vLLM's request models accept an empty `messages` list, any role, audio/file parts and `max_tokens: 0`, and
then fail inside the engine (a 500); they also fetch image URLs and decode any image whole, and take any `n`.
These checks run on the parsed JSON, before the request model, and raise `RequestError` (the ingress
answers a 400).
"""
from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass
from typing import Any

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART, IMAGE_PART = "text", "image_url"
TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")
FAN_OUT_FIELDS = ("n", "best_of")  # sequences generated per request (`best_of`: completions only)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SOI = b"\xff\xd8"
# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic): they carry the frame's size.
JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


class RequestError(ValueError):
    """A client mistake in the body: a client-safe message, the OpenAI `param` it concerns and a `code`."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the engine: image size, choices (`n`, `best_of`) and the token budget
    (choices x `max_tokens`), so that one call cannot hold the engine for long."""

    max_image_pixels: int
    max_n: int
    max_request_tokens: int


def check_body(data: dict[str, Any], *, chat: bool, limits: RequestLimits) -> None:
    """Raise RequestError for the first mistake vLLM would not answer with a 4xx itself, or a request above
    the limits."""
    for name in TOKEN_LIMIT_FIELDS:
        value = data.get(name)
        if _is_int(value) and value < 1:
            raise RequestError(f"'{name}' must be at least 1, got {value}.", param=name, code="invalid_value")
    check_fan_out(data, limits)
    if chat:
        check_messages(data.get("messages"), limits.max_image_pixels)


def check_fan_out(data: dict[str, Any], limits: RequestLimits) -> None:
    """`n` and `best_of` at most `max_n`; choices x the requested token cap at most `max_request_tokens`. A
    request without a token cap is bounded by the engine's context length (and by `max_n`)."""
    choices = 1
    for name in FAN_OUT_FIELDS:
        value = data.get(name)
        if not _is_int(value):
            continue  # absent, or a wrong type vLLM's request model names itself
        if value > limits.max_n:
            raise RequestError(f"'{name}' is {value}; this endpoint generates at most {limits.max_n} sequences "
                               f"per request.", param=name, code="invalid_value")
        choices = max(choices, value)
    for name in TOKEN_LIMIT_FIELDS:
        tokens = data.get(name)
        if _is_int(tokens) and choices * tokens > limits.max_request_tokens:
            raise RequestError(f"{choices} sequence(s) x '{name}' {tokens} = {choices * tokens} tokens; this "
                               f"endpoint allows at most {limits.max_request_tokens} generated tokens per request "
                               f"(lower '{name}' or 'n').", param=name, code="token_budget_exceeded")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_messages(messages: Any, max_image_pixels: int) -> None:
    if not isinstance(messages, list):
        raise RequestError("'messages' is required and must be a list of messages.", param="messages",
                           code="invalid_type")
    if not messages:
        raise RequestError("'messages' is empty: send at least one message.", param="messages", code="empty_array")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"'{where}' must be an object with 'role' and 'content'.", param=where,
                               code="invalid_type")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"'{where}.role' is {_shown(role)}; supported roles are "
                               f"{', '.join(repr(r) for r in CHAT_ROLES)}.", param=f"{where}.role", code="invalid_value")
        content = message.get("content")
        if content is None and role == "assistant":  # an assistant turn may carry only tool calls
            continue
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(f"'{where}.content' must be a string or a list of content parts.",
                               param=f"{where}.content", code="invalid_type")
        for part_index, part in enumerate(content):
            check_part(part, f"{where}.content[{part_index}]", role, max_image_pixels)


def check_part(part: Any, where: str, role: str, max_image_pixels: int) -> None:
    if not isinstance(part, dict):
        raise RequestError(f"'{where}' must be a content part object with a 'type'.", param=where, code="invalid_type")
    kind = part.get("type")
    if kind == TEXT_PART:
        if not isinstance(part.get("text"), str):
            raise RequestError(f"'{where}.text' must be a string.", param=f"{where}.text", code="invalid_type")
        return
    if kind != IMAGE_PART:
        raise RequestError(f"'{where}' is a {_shown(kind)} part; this endpoint takes 'text' parts and, in user "
                           f"messages, 'image_url' parts.", param=where, code="unsupported_content")
    if role != "user":
        raise RequestError(f"'{where}': only user messages may carry images.", param=where,
                           code="unsupported_content")
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    check_image_url(url, f"{where}.image_url", max_image_pixels)


def check_image_url(url: Any, where: str, max_image_pixels: int) -> None:
    """Images travel inline as data URLs: the endpoint never fetches a URL a client names (an SSRF path
    into the cluster) nor reads a server file (`file://`); vLLM would do both by default. The pixel count
    comes from the PNG/JPEG header, so an oversized image is refused before anything decodes it."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise RequestError("Images must be sent inline as data URLs (data:image/png;base64,...); this endpoint "
                           "does not fetch remote URLs.", param=where, code="invalid_image_url")
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise RequestError(f"'{where}' must be a base64 data URL (data:image/png;base64,...).", param=where,
                           code="invalid_image_url")
    size = image_size(Base64Bytes(payload))
    if size is None:
        raise RequestError(f"'{where}' is not a PNG or JPEG image.", param=where, code="invalid_image")
    width, height = size
    if width * height > max_image_pixels:
        raise RequestError(f"'{where}' is {width}x{height} = {width * height} pixels; this endpoint takes at most "
                           f"{max_image_pixels}.", param=where, code="image_too_large")


class Base64Bytes:
    """The decoded bytes of a base64 string, decoded only as far as they are read (a header needs a few)."""

    def __init__(self, text: str):
        self.text = text

    def read(self, start: int, length: int) -> bytes:
        """Bytes [start, start + length), shorter at the end of the data; RequestError if not base64."""
        first = start // 3
        chunk = self.text[first * 4: (start + length + 2) // 3 * 4]
        chunk += "=" * (-len(chunk) % 4)  # only the data's last slice can be short (unpadded base64)
        try:
            data = base64.b64decode(chunk, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("An image data URL is not valid base64.", param="messages",
                               code="invalid_image") from None
        return data[start - first * 3: start - first * 3 + length]


def image_size(data: Base64Bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG IHDR or a JPEG start-of-frame segment; None when neither is found."""
    head = data.read(0, 24)
    if head.startswith(PNG_SIGNATURE) and head[12:16] == b"IHDR" and len(head) == 24:
        return struct.unpack(">II", head[16:24])
    if not head.startswith(JPEG_SOI):
        return None
    offset = 2
    while True:  # walk the segments (marker, 2-byte length) up to the first frame header
        marker = data.read(offset, 4)
        if len(marker) < 4 or marker[0] != 0xFF:
            return None
        if marker[1] == 0xFF:  # fill byte
            offset += 1
            continue
        if 0xD0 <= marker[1] <= 0xD7 or marker[1] == 0x01:  # standalone markers carry no length
            offset += 2
            continue
        if marker[1] in JPEG_SOF:
            frame = data.read(offset + 5, 4)
            if len(frame) < 4:
                return None
            height, width = struct.unpack(">HH", frame)
            return width, height
        if marker[1] in (0xD9, 0xDA):  # end of image or scan data before any frame header
            return None
        offset += 2 + struct.unpack(">H", marker[2:4])[0]


def _shown(value: Any) -> str:
    return repr(value)[:40] if isinstance(value, str) else ("missing" if value is None else type(value).__name__)
