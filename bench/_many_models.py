"""Many registered models, made fast over MLflow's REST API (the reconciler scale bench and its test).

Every generated version is registered from one real LoggedModel (`models:/<id>`, with the tracker's
sha256 tags), so each is a servable adapter whose sync copies and verifies a real folder.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import httpx


class RegistryWriter:
    """Thin REST writes, one keep-alive connection per thread."""

    def __init__(self, tracking_uri: str):
        self.api = tracking_uri.rstrip("/") + "/api/2.0/mlflow"
        self._local = threading.local()

    def _post(self, path: str, body: dict) -> dict:
        client = getattr(self._local, "client", None) or httpx.Client(timeout=60)
        self._local.client = client
        response = client.post(f"{self.api}/{path}", json=body)
        response.raise_for_status()
        return response.json()

    def add_version(self, name: str, model_id: str) -> int:
        body = {"name": name, "source": f"models:/{model_id}", "model_id": model_id}
        return int(self._post("model-versions/create", body)["model_version"]["version"])

    def set_alias(self, name: str, alias: str, version: int) -> None:
        self._post("registered-models/alias", {"name": name, "alias": alias, "version": str(version)})

    def create_served(self, name: str, model_id: str, alias: str) -> None:
        """A registered model whose version 1 is `model_id`, with `alias` on it."""
        self._post("registered-models/create", {"name": name})
        self.set_alias(name, alias, self.add_version(name, model_id))


def register_models(tracking_uri: str, names: Iterable[str], model_id: str, *, alias: str = "production",
                    threads: int = 8) -> None:
    writer = RegistryWriter(tracking_uri)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda name: writer.create_served(name, model_id, alias), names))


def move_aliases(tracking_uri: str, names: Iterable[str], model_id: str, *, alias: str = "production",
                 threads: int = 8) -> dict[str, int]:
    """Register a new version of each model and move `alias` to it; return the new versions."""
    writer = RegistryWriter(tracking_uri)

    def move(name: str) -> tuple[str, int]:
        version = writer.add_version(name, model_id)
        writer.set_alias(name, alias, version)
        return name, version

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(pool.map(move, names))
