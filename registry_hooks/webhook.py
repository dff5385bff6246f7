"""MLflow webhook deliveries, as pure checks: HMAC signature, timestamp window, de-duplication, payload."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

DELIVERY_ID_HEADER = "x-mlflow-delivery-id"
TIMESTAMP_HEADER = "x-mlflow-timestamp"
SIGNATURE_HEADER = "x-mlflow-signature"
SIGNATURE_VERSION = "v1"
ALIAS_EVENTS = ("model_version_alias.created", "model_version_alias.deleted")
MAX_BODY_BYTES = 64 * 1024


class Rejected(ValueError):
    """A delivery we must not act on; `status` is the HTTP answer (401 for anything unauthenticated)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """MLflow's scheme: `v1,` + base64 HMAC-SHA256 of `{delivery_id}.{timestamp}.{body}`."""
    content = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), content, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


@dataclass(frozen=True)
class Delivery:
    delivery_id: str
    event: str
    model: str | None


def authenticate(headers: Mapping[str, str], body: bytes, secret: str, now: float, tolerance_s: float) -> str:
    """Return the delivery id of an authentic, fresh delivery; raise Rejected(401) otherwise."""
    delivery_id = headers.get(DELIVERY_ID_HEADER, "")
    timestamp = headers.get(TIMESTAMP_HEADER, "")
    signature = headers.get(SIGNATURE_HEADER, "")
    if not (delivery_id and timestamp and signature):
        raise Rejected(401, "missing signature headers")
    # Bytes on both sides: compare_digest raises TypeError on a str with non-ASCII characters.
    if not hmac.compare_digest(sign(secret, delivery_id, timestamp, body).encode(), signature.encode("utf-8", "replace")):
        raise Rejected(401, "bad signature")
    try:
        sent = int(timestamp)
    except ValueError:
        raise Rejected(401, "bad timestamp") from None
    if abs(now - sent) > tolerance_s:
        raise Rejected(401, "timestamp outside the accepted window")
    return delivery_id


def parse_delivery(delivery_id: str, body: bytes) -> Delivery:
    """Only the event and the model name are used: the version in the payload is never trusted."""
    try:
        payload = json.loads(body)
        event = f"{payload['entity']}.{payload['action']}"
        data = payload.get("data") or {}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise Rejected(400, "not an MLflow webhook payload") from None
    name = data.get("name") if isinstance(data, dict) else None
    return Delivery(delivery_id, event, name if isinstance(name, str) else None)


class SeenDeliveries:
    """Delivery ids seen within the timestamp window (older ones are rejected as stale anyway)."""

    def __init__(self, window_s: float, limit: int = 100_000):
        self.window_s, self.limit = window_s, limit
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def first_time(self, delivery_id: str, now: float) -> bool:
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - 2 * self.window_s or len(self._seen) > self.limit):
                self._seen.popitem(last=False)
            if delivery_id in self._seen:
                return False
            self._seen[delivery_id] = now
            return True
