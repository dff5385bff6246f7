"""Who may call what: API keys scoped to registered models and addressing, with per-key rate limits.

The keys file (`serving.keys_file`, YAML) holds sha256 digests of keys, never keys, each with its scope:

    keys:
      - name: maze-team                 # shown in logs and errors of its own requests, never the key
        sha256: 5e884898da28047151d0e56f8dc62927...
        models: ["maze-*"]              # registered models it may call (fnmatch patterns; "*": all)
        aliases: ["production"]         # served aliases it may name ("*": all; the bare name is the default alias)
        versions: false                 # may pin `@v<N>`
        base: false                     # may call the bare base model
        canary: true                    # joins canary cohorts (false: always the alias's own target)
        requests_per_minute: 600        # optional, across the endpoint
        tokens_per_minute: 200000       # optional: prompt + completion tokens across the endpoint

A replica re-reads the file when it changes (checked at most every routes staleness), so a rotation or a
revocation takes effect without a restart; a file that does not parse keeps the last good one, and the error
is kept for the log and `rlops status`. Keys of the old `serving.api_keys_env` variable may call everything.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlops.layout import ModelRef

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
ENV_KEYS_SCOPE = "serving.api_keys_env"


class AccessError(Exception):
    """An answer the endpoint gives instead of serving: 401, 403 or 429, with a client-safe message."""

    def __init__(self, status: int, message: str, code: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after_s = status, message, code, retry_after_s


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and what is wrong."""


class KeyScope(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    sha256: str
    models: list[str] = Field(min_length=1)
    aliases: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    versions: bool = False
    base: bool = False
    canary: bool = True
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)

    @field_validator("sha256", mode="before")
    @classmethod
    def _digest(cls, value: Any) -> str:
        if not isinstance(value, str):  # YAML reads an all-digit digest as a number
            raise ValueError("must be a quoted string of the 64 hex digits of sha256(key)")
        if not DIGEST_RE.match(value):
            raise ValueError("must be the 64 lowercase hex digits of sha256(key), not the key itself")
        return value

    def may_call(self, ref: ModelRef) -> bool:
        if ref.model is None:
            return self.base
        if not any(fnmatchcase(ref.model, pattern) for pattern in self.models):
            return False
        if ref.version is not None:
            return self.versions
        return "*" in self.aliases or ref.alias in self.aliases

    def lists(self, card: Mapping[str, Any], default_alias: str) -> bool:
        """A `/v1/models` entry this key may call (entries name the base or `<model>@<alias>`)."""
        meta = card.get("metadata", {})
        if meta.get("kind") == "base":
            return self.base
        return self.may_call(ModelRef(raw=card["id"], base="", model=meta.get("registered_model"),
                                      alias=meta.get("alias", default_alias)))


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyScope] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> "KeysFile":
        for attribute in ("name", "sha256"):
            seen: set[str] = set()
            for scope in self.keys:
                value = getattr(scope, attribute)
                if value in seen:
                    shown = value if attribute == "name" else value[:12] + "..."
                    raise ValueError(f"two keys have the same {attribute} {shown!r}")
                seen.add(value)
        return self


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys_file(text: str, source: str) -> dict[str, KeyScope]:
    """digest -> scope; KeysFileError naming `source`, the entry and the field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KeysFileError(f"{source}: not valid YAML: {exc}") from None
    try:
        parsed = KeysFile.model_validate(data if data is not None else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise KeysFileError(f"{source}: {where}: {first['msg']}") from None
    return {scope.sha256: scope for scope in parsed.keys}


def env_scopes(environ: Mapping[str, str], env_name: str | None) -> dict[str, KeyScope]:
    """The comma-separated keys of `serving.api_keys_env`: each may call every model, alias and version."""
    if env_name is None:
        return {}
    keys = [k.strip() for k in environ.get(env_name, "").split(",") if k.strip()]
    if not keys:
        raise ValueError(f"serving.api_keys_env names {env_name}, but that environment variable holds no keys")
    return {digest(k): KeyScope(name=ENV_KEYS_SCOPE, sha256=digest(k), models=["*"], versions=True, base=True)
            for k in keys}


def bearer_token(authorization: str | None) -> str:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AccessError(401, "Missing API key: send 'Authorization: Bearer <key>'.", "invalid_api_key")
    return token.strip()


@dataclass
class TokenBucket:
    """`per_minute` units a minute, refilled continuously; `capacity` is what may be spent at once."""
    per_minute: float
    capacity: float
    level: float = -1.0
    at: float = 0.0

    def _refill(self, now: float) -> None:
        if self.level < 0:
            self.level, self.at = self.capacity, now
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_minute / 60)
        self.at = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` may be spent (0: now)."""
        self._refill(now)
        return 0.0 if self.level >= amount else (amount - self.level) * 60 / self.per_minute

    def spend(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def refund(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass
class RateLimiter:
    """Per-key request and token buckets of one ingress replica. With R replicas each enforces 1/R of a
    key's limits: Serve spreads requests evenly over the replicas, so the endpoint as a whole admits about
    the configured rate without the replicas talking to each other."""
    replicas: int = 1
    buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)

    def _bucket(self, scope: KeyScope, kind: str, per_minute: int) -> TokenBucket:
        bucket = self.buckets.get((scope.sha256, kind))
        share = per_minute / self.replicas
        if bucket is None or bucket.per_minute != share:
            bucket = self.buckets[(scope.sha256, kind)] = TokenBucket(share, max(1.0, share))
        return bucket

    def admit(self, scope: KeyScope, tokens: int, now: float | None = None) -> None:
        """Spend one request and `tokens` (the most the request may use), or raise a 429 with Retry-After."""
        now = time.monotonic() if now is None else now
        wanted = []
        if scope.requests_per_minute is not None:
            wanted.append((self._bucket(scope, "requests", scope.requests_per_minute), 1, "requests"))
        if scope.tokens_per_minute is not None:
            bucket = self._bucket(scope, "tokens", scope.tokens_per_minute)
            if tokens > bucket.capacity:
                raise AccessError(429, f"This request may use up to {tokens} tokens; key {scope.name!r} may use "
                                  f"{bucket.capacity:.0f} tokens at once here: lower 'max_tokens' or 'n'.",
                                  "rate_limit_exceeded", retry_after_s=60)
            wanted.append((bucket, tokens, "tokens"))
        for bucket, amount, kind in wanted:
            wait = bucket.wait_s(amount, now)
            if wait > 0:
                raise AccessError(429, f"Rate limit of key {scope.name!r} reached ({kind} per minute); retry in "
                                  f"{math.ceil(wait)} s.", "rate_limit_exceeded", retry_after_s=math.ceil(wait))
        for bucket, amount, _ in wanted:
            bucket.spend(amount, now)

    def settle(self, scope: KeyScope, charged: int, used: int) -> None:
        """Give back what a request was charged beyond what it used."""
        if scope.tokens_per_minute is not None and charged > used:
            self._bucket(scope, "tokens", scope.tokens_per_minute).refund(charged - used)


class AccessControl:
    """The keys a replica accepts: the keys file (re-read when it changes) and the env keys."""

    def __init__(self, keys_file: str | None, env_keys: dict[str, KeyScope], check_every_s: float,
                 on_reload: Callable[[str | None], None] = lambda error: None):
        """`on_reload` hears each reload: None once a changed file is in use, else why it is not (once per
        different error)."""
        self.path = Path(keys_file) if keys_file else None
        self.env_keys, self.check_every_s, self.on_reload = env_keys, check_every_s, on_reload
        self.file_keys: dict[str, KeyScope] = {}
        self.error: str | None = None
        self._fingerprint: tuple[int, int] | None = None
        self._checked = -math.inf
        if self.path is not None:
            self.file_keys = parse_keys_file(self._read(), str(self.path))  # a bad file at start is fatal
            self._fingerprint = self._stat()
            self._checked = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.path is not None or bool(self.env_keys)

    def scope(self, authorization: str | None) -> KeyScope | None:
        """The caller's scope; None when no keys are configured (everything is open); 401 otherwise."""
        if not self.enabled:
            return None
        self.reload_if_changed()
        # Looking up the digest, not the key, keeps the check's timing independent of the keys' contents.
        key_digest = digest(bearer_token(authorization))
        found = self.file_keys.get(key_digest) or self.env_keys.get(key_digest)
        if found is None:
            raise AccessError(401, "Invalid API key.", "invalid_api_key")
        return found

    def reload_if_changed(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self.path is None or now - self._checked < self.check_every_s:
            return False
        self._checked = now
        try:
            fingerprint = self._stat()
            if fingerprint == self._fingerprint:
                return False
            keys = parse_keys_file(self._read(), str(self.path))
        except OSError as exc:
            return self._failed(f"{self.path}: cannot be read: {exc.strerror}")
        except KeysFileError as exc:
            return self._failed(str(exc))
        self.file_keys, self._fingerprint, self.error = keys, fingerprint, None
        self.on_reload(None)
        return True

    def _failed(self, error: str) -> bool:
        if error != self.error:
            self.error = error
            self.on_reload(error)
        return False

    def _stat(self) -> tuple[int, int]:
        stat = os.stat(self.path)
        return stat.st_mtime_ns, stat.st_size

    def _read(self) -> str:
        try:
            return self.path.read_text()
        except OSError as exc:
            raise KeysFileError(f"{self.path}: cannot be read: {exc.strerror}") from None
