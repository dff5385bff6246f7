"""The MLflow webhooks on alias events: register ours, find those whose URL does not answer, remove them.

MLflow delivers every alias event to every webhook on it from one pool of worker threads, and retries a
delivery that cannot connect with a backoff (seconds per dead URL), so stale webhooks delay the live ones
(bench/README.md, "Webhook deliveries"). Nothing here deletes a webhook unless asked.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from mlflow.exceptions import MlflowException

from registry_hooks import registry
from registry_hooks.webhook import ALIAS_EVENTS
from rlops.config import Config

WEBHOOK_PATH = "/webhook"
PROBE_TIMEOUT_S = 2.0
PRUNE_HINT = "remove them with `rlops hooks prune` (or in the MLflow UI: Settings > Webhooks)"


class HooksError(RuntimeError):
    """The hooks service cannot start or register as configured (message says which key)."""


@dataclass(frozen=True)
class WebhookCheck:
    """One webhook on an alias event and whether its URL answered (any HTTP status counts as an answer)."""

    webhook_id: str
    name: str
    url: str
    answers: bool
    detail: str


def webhook_url(config: Config) -> str:
    return config.hooks.public_url or local_webhook_url(config)


def local_webhook_url(config: Config) -> str:
    """Where `rlops hooks serve` of this config listens."""
    return f"http://{config.hooks.host}:{config.hooks.port}{WEBHOOK_PATH}"


def webhook_name(config: Config) -> str:
    """One webhook per deployment (its adapter path), so re-registering updates it instead of adding one."""
    return "rlops-promotion-" + hashlib.sha256(config.lora_path.encode()).hexdigest()[:10]


def _all_webhooks(client) -> list:
    hooks, token = [], None
    while True:
        page = client.list_webhooks(max_results=100, page_token=token)
        hooks.extend(page)
        token = page.token
        if not token:
            return hooks


def _on_alias_events(hook) -> bool:
    return any(str(event) in ALIAS_EVENTS for event in hook.events)


def register_webhook(config: Config) -> str:
    """Create (or update) the MLflow webhook that posts alias events to the receiver; returns its id."""
    if not config.hooks.secret:
        raise HooksError("hooks.secret is not set: export RLOPS_HOOKS__SECRET before `rlops hooks register`")
    client = registry.mlflow_client(config)
    url = webhook_url(config)
    name = webhook_name(config)
    try:
        existing = [w for w in _all_webhooks(client) if w.name == name]
        if existing:
            hook = client.update_webhook(existing[0].webhook_id, url=url, events=list(ALIAS_EVENTS),
                                         secret=config.hooks.secret, status="ACTIVE")
        else:
            hook = client.create_webhook(name, url, list(ALIAS_EVENTS), secret=config.hooks.secret,
                                         description="rlops: alias moved -> reconcile served adapters")
    except MlflowException as exc:
        raise HooksError(f"MLflow at {config.tracking_uri} refused the webhook: {exc.message}") from None
    return hook.webhook_id


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Does anything answer HTTP at `url`? A GET: our receiver answers 405, others whatever they answer."""
    if urlsplit(url).scheme not in ("http", "https"):
        return False, "not an http(s) URL"
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return True, f"HTTP {response.status_code}"


def check_webhooks(config: Config) -> list[WebhookCheck]:
    """Every active webhook on alias events, each URL probed (in parallel: a dead one takes the timeout)."""
    try:
        hooks = [h for h in _all_webhooks(registry.mlflow_client(config))
                 if _on_alias_events(h) and h.status.is_active()]
    except MlflowException as exc:
        raise HooksError(f"MLflow at {config.tracking_uri} refused to list webhooks: {exc.message}") from None
    if not hooks:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(hooks))) as pool:
        answers = list(pool.map(lambda h: probe(h.url), hooks))
    return [WebhookCheck(h.webhook_id, h.name, h.url, ok, detail) for h, (ok, detail) in zip(hooks, answers)]


def prune_webhooks(config: Config) -> list[WebhookCheck]:
    """Delete the webhooks on alias events whose URL does not answer; returns what was deleted."""
    client = registry.mlflow_client(config)
    dead = [check for check in check_webhooks(config) if not check.answers]
    for check in dead:
        client.delete_webhook(check.webhook_id)
    return dead


def forget_local_webhook(config: Config) -> str | None:
    """Delete this deployment's webhook when it points at this config's local receiver (which `rlops down`
    is stopping); a webhook registered for a public URL is another receiver's and stays. Returns its id."""
    client = registry.mlflow_client(config)
    for hook in _all_webhooks(client):
        if hook.name == webhook_name(config) and hook.url == local_webhook_url(config):
            client.delete_webhook(hook.webhook_id)
            return hook.webhook_id
    return None
