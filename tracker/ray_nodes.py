"""System metrics of every node of a Ray job, one MLflow run: each node's samples carry its own node id as
MLflow's `node_id` (`system/<node>/cpu_utilization_percentage`, ...), and a run tag per node says which
machine a prefix is (`rlops.ray_node.<node>` = "<ip> <hostname> <full node id>").

The session's own monitor runs where the session runs (the driver task's node, labelled with that node);
on every other alive node a zero-CPU actor pinned there runs one more monitor into the same run. Nodes that
join later are not monitored. Importing this module imports Ray; only `tracker.skyrl` uses it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tracker import system

log = logging.getLogger(__name__)

TAG_NODE_PREFIX = "rlops.ray_node."
LABEL_CHARS = 8  # of Ray's 56-hex-digit node id: short enough for a metric prefix, unique in a cluster
STOP_BOUND_S = 2 * system.STOP_BOUND_S


@dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    hostname: str

    @property
    def label(self) -> str:
        return self.node_id[:LABEL_CHARS]


def cluster() -> tuple[list[RayNode], str | None]:
    """The alive nodes and the label of this process's node; ([], None) outside a Ray job."""
    if not ray.is_initialized():
        return [], None
    nodes = [RayNode(n["NodeID"], n.get("NodeManagerAddress", ""), n.get("NodeManagerHostname", ""))
             for n in ray.nodes() if n.get("Alive")]
    return nodes, ray.get_runtime_context().get_node_id()[:LABEL_CHARS]


def node_tags(nodes: list[RayNode]) -> dict[str, str]:
    return {f"{TAG_NODE_PREFIX}{n.label}": f"{n.ip} {n.hostname} {n.node_id}" for n in nodes}


class NodeMonitor:
    """Body of the per-node actor: MLflow's monitor with the node's label (it needs no trainer state)."""

    def __init__(self, run_id: str, tracking_uri: str, interval_s: float, resume: bool, label: str):
        self._metrics = system.start(run_id, tracking_uri, interval_s, enabled=True, resume=resume, node_id=label)

    def running(self) -> bool:
        return self._metrics is not None

    def stop(self) -> bool:
        return self._metrics.stop() if self._metrics is not None else True


class NodeMonitors:
    """The actors of one run; `stop()` flushes their last samples (bounded) and ends them."""

    def __init__(self, actors: list):
        self.actors = actors

    @classmethod
    def start(cls, nodes: list[RayNode], run_id: str, tracking_uri: str, interval_s: float, *,
              resume: bool) -> "NodeMonitors":
        remote = ray.remote(num_cpus=0, max_restarts=0)(NodeMonitor)
        actors = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                  .remote(run_id, tracking_uri, interval_s, resume, n.label) for n in nodes]
        return cls(actors)

    def stop(self, timeout_s: float = STOP_BOUND_S) -> None:
        if not self.actors:
            return
        try:
            ray.wait([a.stop.remote() for a in self.actors], num_returns=len(self.actors), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a node that died took its monitor with it
            log.warning("system metrics of some Ray nodes did not flush: %s", exc)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
