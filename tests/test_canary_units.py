"""Canary logic without servers: manifest schema 2 (and reading 1), planning, drift, the sticky pick."""
from __future__ import annotations

import functools
import json

import pytest

from registry_hooks.operations import endpoint_serves
from registry_hooks.plan import Intent, drift, needs_sync, next_manifest, rollback_target
from rlops.layout import AliasRoute, MoveNote, RoutesManifest, canary_bucket, parse_model_name, resolve_model_name
from serving.ingress import client_key


def route(version: int) -> AliasRoute:
    return AliasRoute(version=version, folder=f"m-v{version}", files={"a.json": "0" * 64}, promoted_at="t0", trigger="x")


ROUTES = {v: route(v) for v in (1, 2, 3)}


def plan(old: RoutesManifest, intent: Intent, now: str, **kw) -> RoutesManifest:
    return next_manifest(old, intent, ROUTES, {}, trigger=kw.pop("trigger", "cli"), now=now, history_limit=50, **kw)


def test_a_version_1_manifest_is_still_read_and_written_back_as_2():
    v1 = {"schema_version": 1, "model": "m", "generation": 3, "updated_at": "t",
          "aliases": {"production": route(1).model_dump()},
          "history": [{"alias": "production", "version": 1, "at": "t", "trigger": "cli"}], "refused": {}}
    old = RoutesManifest.model_validate_json(json.dumps(v1))
    assert old.schema_version == 1 and old.canaries == {} and old.history[0].event == "move"
    assert plan(old, Intent({"production": 1}), "t1") is old  # nothing to change: not rewritten
    new = plan(old, Intent({"production": 1, "production-canary": 2}, {"production": 10}), "t1")
    assert new.schema_version == 2 and new.canaries["production"].weight == 10
    with pytest.raises(ValueError, match="schema_version"):
        RoutesManifest.model_validate({**v1, "schema_version": 3})


def test_canary_start_reweight_promote_abort_and_history():
    m = plan(RoutesManifest(model="m"), Intent({"production": 1}), "t1")
    ana = {"production-canary": MoveNote(move_id="m2", version=2, trigger="cli", actor="ana", reason="try")}
    m = plan(m, Intent({"production": 1, "production-canary": 2}, {"production": 10}, ana), "t2")
    assert m.aliases["production"].version == 1 and (m.canaries["production"].version, m.canaries["production"].weight) == (2, 10)
    assert 2 in m.published_versions()  # @v2 addresses the canary alone
    assert plan(m, Intent({"production": 1, "production-canary": 2}, {"production": 10}), "t3") is m
    m = plan(m, Intent({"production": 1, "production-canary": 2}, {"production": 25}), "t3")
    assert m.canaries["production"].weight == 25 and m.canaries["production"].promoted_at == "t2"
    # --promote: the alias moves to the canary while the canary alias still names it (not yet cleared)
    promoted = plan(m, Intent({"production": 2, "production-canary": 2}, {"production": 25}), "t4")
    assert promoted.aliases["production"].version == 2 and promoted.canaries == {}
    assert rollback_target(promoted, "production") == 1  # canary entries are not targets to roll back to
    watcher = {"production-canary": MoveNote(move_id="m4", version=None, trigger="watcher", actor="w", reason="error rate")}
    aborted = plan(m, Intent({"production": 1}, notes=watcher), "t4", trigger="reconciler")
    assert aborted.canaries == {} and aborted.aliases["production"].version == 1
    events = [(h.event, h.version, h.from_version, h.weight, h.trigger, h.actor, h.reason) for h in aborted.history]
    assert events == [("move", 1, None, None, "cli", "registry", None), ("canary", 2, 1, 10, "cli", "ana", "try"),
                      ("canary", 2, 1, 25, "cli", "registry", None),
                      ("canary_aborted", 2, 2, 0, "watcher", "w", "error rate")]
    assert [h.event for h in promoted.history][-1] == "canary_promoted"


def test_a_move_is_credited_to_its_note_only_when_the_note_names_that_change():
    """Issue 40: the author comes from the registry's move note, whoever publishes; a note about another
    version (a later move by hand, a stale note) credits the registry, never the note's author."""
    cli = {"production": MoveNote(move_id="a", version=2, trigger="cli", actor="os:eve", reason="better")}
    old = plan(RoutesManifest(model="m"), Intent({"production": 1}), "t1")
    for publisher in ("cli", "webhook", "reconciler"):
        new = plan(old, Intent({"production": 2}, notes=cli), "t2", trigger=publisher)
        assert [(h.trigger, h.actor, h.reason) for h in new.history[1:]] == [("cli", "os:eve", "better")]
    by_hand = plan(old, Intent({"production": 3}, notes=cli), "t2", trigger="webhook").history[-1]
    assert (by_hand.version, by_hand.trigger, by_hand.actor, by_hand.reason) == (3, "webhook", "registry", None)
    assert Intent({"production": 2}, notes=cli) == Intent({"production": 2})  # notes are not the intent


def test_a_canary_nothing_can_serve_is_not_published_and_is_not_drift():
    m = plan(RoutesManifest(model="m"), Intent({"production": 1}), "t1")
    for intent in (Intent({"production": 1, "production-canary": 2}),  # no weight tag
                   Intent({"production": 1, "production-canary": 1}, {"production": 10}),  # same version
                   Intent({"production": 1, "staging-canary": 2}, {"staging": 10})):  # alias not set
        assert plan(m, intent, "t2") is m and drift(intent, m) == [] and not needs_sync(intent, m)


def test_needs_sync_and_drift_see_canary_moves_and_weights():
    m = plan(RoutesManifest(model="m"), Intent({"production": 1, "production-canary": 2}, {"production": 10}), "t1")
    same = Intent({"production": 1, "production-canary": 2}, {"production": 10})
    assert not needs_sync(same, m) and plan(m, same, "t2") is m
    reweighted = Intent({"production": 1, "production-canary": 2}, {"production": 30})
    assert needs_sync(reweighted, m)
    assert [d.describe() for d in drift(reweighted, m)] == ["production-canary: registry v2 at 30%, served v2 at 10%"]
    assert needs_sync(Intent({"production": 1, "production-canary": 3}, {"production": 10}), m)
    assert needs_sync(Intent({"production": 1}), m)  # aborted in the registry
    refused = next_manifest(m, Intent({"production": 1, "production-canary": 3}, {"production": 10}), {},
                            {3: "bad rank"}, trigger="x", now="t3", history_limit=10)
    assert refused.canaries["production"].version == 2 and refused.refused["production-canary"].version == 3


@functools.lru_cache(maxsize=None)
def manifests(weight: float) -> dict[str, RoutesManifest]:
    return {"m": plan(RoutesManifest(model="m"), Intent({"production": 1, "production-canary": 2},
                                                        {"production": weight}), "t1")}


def pick(selector: str, key: str | None, weight: float = 10):
    return resolve_model_name(parse_model_name(f"base:m{selector}"), "base", manifests(weight), ["production"], key)


def test_the_pick_is_sticky_per_client_and_splits_by_weight():
    keys = [f"user:{i}" for i in range(20_000)]
    picks = {key: pick("", key) for key in keys}
    share = sum(r.version == 2 for r in picks.values()) / len(keys) * 100
    assert abs(share - 10) < 1, share
    assert all(r.canary == (r.version == 2) and r.alias == "production" for r in picks.values())
    assert all(pick("", key).version == picks[key].version for key in keys[:500])  # same client, same version
    grown = [key for key in keys if pick("", key, weight=30).version == 2]
    assert {k for k in keys if picks[k].version == 2} <= set(grown)  # raising the weight only adds clients
    assert {pick("@v1", key).version for key in keys[:200]} == {1} and {pick("@v2", key).version for key in keys[:200]} == {2}
    assert not pick("@v2", "x").canary
    per_request = sum(pick("", None).version == 2 for _ in range(4000)) / 40
    assert abs(per_request - 10) < 2.5  # no identity: picked per request, still by weight
    assert 0 <= canary_bucket("m", "production", 2, "k") < 100


def test_client_key_prefers_user_then_session_then_api_key():
    assert client_key("alice", "s1", "Bearer sk-1") == "user:alice"
    assert client_key(None, "s1", "Bearer sk-1") == "session:s1"
    keyed = client_key(None, None, "Bearer sk-1")
    assert keyed.startswith("key:") and "sk-1" not in keyed
    assert client_key("", None, None) is None and client_key(123, None, "Basic x") is None


def test_endpoint_serves_reads_models_metadata():
    body = {"data": [{"id": "b:m@production", "metadata": {"version": 1, "canary": {"version": 2, "weight": 10}}},
                     {"id": "b:m@staging", "metadata": {"version": 3}}]}
    assert endpoint_serves(body, "b:m@production", 1, canary=False)
    assert endpoint_serves(body, "b:m@production", 2, canary=True)
    assert not endpoint_serves(body, "b:m@staging", 2, canary=False)
    assert not endpoint_serves(body, "b:m@staging", 3, canary=True)
    assert not endpoint_serves(body, "b:m@other", 3, canary=False)


def test_usage_and_mid_stream_errors_are_read_from_answers():
    from serving.ingress import is_error_event, usage_in

    body = b'{"id":"x","choices":[{"text":"say \\"usage\\": 1"}],"usage":{"prompt_tokens":7,"completion_tokens":2}}'
    assert usage_in(body) == (7, 2)
    assert usage_in('data: {"choices":[],"usage":null}\n\n') is None
    assert usage_in('data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n') == (3, 1)
    assert usage_in(b'{"choices":[]}') is None and usage_in(b'"usage": {broken') is None
    assert is_error_event('data: {"error":{"message":"engine died","code":500}}\n\n')
    assert is_error_event(b'data: {"choices":[]}\n\ndata: {"error":{"message":"x"}}\n\n')
    assert not is_error_event('data: {"choices":[{"delta":{"content":"data: {\\"error\\""}}]}\n\n')


def stream_status(chunks: list[str], read: int) -> int:
    """The status the ingress records for a stream whose client reads `read` chunks, then closes it."""
    import asyncio
    from types import SimpleNamespace

    from serving.ingress import AliasIngress

    statuses = []
    ingress = SimpleNamespace(_settle=lambda charge, usage: None,
                              _finish=lambda resolution, endpoint, status, *a, **kw: statuses.append(status))

    async def engine():
        for chunk in chunks:
            yield chunk

    async def client():
        stream = AliasIngress._finish_after(ingress, engine(), None, "chat", 0.0)
        for _ in range(read):
            await stream.__anext__()
        await stream.aclose()

    asyncio.run(client())
    return statuses[0]


def test_a_client_closing_right_after_done_got_a_whole_answer_and_one_leaving_earlier_is_a_499():
    answer = ['data: {"choices":[{"delta":{"content":" up"}}]}\n\n', "data: [DONE]\n\n"]
    assert stream_status(answer, read=2) == 200  # closed at once after [DONE]: its trace is scored
    assert stream_status(answer, read=1) == 499
    broken = ['data: {"error":{"message":"engine died","code":500}}\n\n', "data: [DONE]\n\n"]
    assert stream_status(broken, read=2) == 500


def test_the_grafana_dashboard_queries_only_series_the_ingress_exports():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    dashboard = json.loads((root / "docker" / "grafana" / "rlops-canary.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket)$", "", m) for e in exprs for m in re.findall(r"ray_(rlops_serving_\w+)", e)}
    source = (root / "serving" / "ingress.py").read_text()
    exported = set(re.findall(r'metrics\.(?:Counter|Histogram)\("(rlops_serving_\w+)"', source))
    assert used and used <= exported, used - exported
    assert {"rlops_serving_ttft_ms", "rlops_serving_tokens"} <= used
    labels = {label for e in exprs for label in re.findall(r"by \(([^)]*)\)", e)}
    assert all("version" in group and "canary" in group for group in labels)


def prometheus_text(rows: dict[tuple[int, bool], tuple[int, int, list[int]]]) -> str:
    """Ray-exported text for (version, canary) -> (requests, errors, latency bucket counts at 10/100/+Inf ms)."""
    lines = ["# TYPE ray_rlops_serving_requests counter", "# TYPE ray_rlops_serving_errors counter",
             "# TYPE ray_rlops_serving_latency_ms histogram"]
    for (version, canary), (requests, errors, buckets) in rows.items():
        tags = f'registered_model="m",alias="production",version="{version}",canary="{str(canary).lower()}",endpoint="chat"'
        lines.append(f"ray_rlops_serving_requests_total{{{tags}}} {requests}")
        lines.append(f'ray_rlops_serving_errors_total{{{tags},status="500"}} {errors}')
        lines.append(f'ray_rlops_serving_errors_total{{{tags},status="499"}} 7')  # clients gone: not counted
        for le, n in zip(("10.0", "100.0", "+Inf"), buckets):
            lines.append(f'ray_rlops_serving_latency_ms_bucket{{{tags},le="{le}"}} {n}')
    lines.append('ray_rlops_serving_requests_total{registered_model="(base)",alias="",version="",canary="false",endpoint="chat"} 5')
    return "\n".join(lines) + "\n"


def test_watcher_windows_and_breaches():
    from rlops.config import CanarySLO
    from registry_hooks.watcher import breach, canaries_in, parse_metrics, window

    slo = CanarySLO(window_s=30, min_requests=10, max_error_rate_increase=0.05, max_p95_ratio=2, min_p95_ms=50)
    then = parse_metrics(prometheus_text({(1, False): (100, 1, [90, 100, 100]), (2, True): (5, 0, [5, 5, 5])}))
    now = parse_metrics(prometheus_text({(1, False): (300, 3, [280, 300, 300]), (2, True): (25, 6, [5, 25, 25])}))
    assert canaries_in(now) == {("m", "production", 2)} and len(now) == 2  # the base model's series is not a version
    stats = window(now, then)
    canary, baseline = stats[("m", "production", 2, True)], stats[("m", "production", 1, False)]
    assert (canary.requests, canary.errors, baseline.requests, baseline.errors) == (20, 6, 200, 2)
    assert canary.p95_ms() == 100 and baseline.p95_ms() == 10
    reason = breach(canary, baseline, slo)
    assert reason.startswith("error rate 30.0% over 20 requests vs the baseline's 1.0% over 200")
    assert breach(canary, baseline, slo.model_copy(update={"min_requests": 21})) is None  # too few yet
    slow = parse_metrics(prometheus_text({(2, True): (40, 0, [0, 30, 40])}))[("m", "production", 2, True)]
    assert breach(slow, baseline, slo.model_copy(update={"min_p95_ms": 50})).startswith("p95 latency <= 100 ms")
    assert breach(slow, baseline, slo.model_copy(update={"min_p95_ms": 200})) is None
    restarted = window(then, now)[("m", "production", 1, False)]  # counters went down: the exporter restarted
    assert restarted.requests == 100


def test_a_preview_publishes_at_v_n_alone_and_every_later_plan_keeps_it():
    """`promote --verify` publishes the candidate as `@v<N>` (a `preview` entry): resolvable by its own name,
    no alias moves, the reconciler's next plans keep it, gc keeps its folder, rollback ignores it."""
    from datetime import datetime, timedelta, timezone

    from registry_hooks.plan import referenced_folders, with_preview

    t1, t2 = "2026-12-01T00:00:00.000Z", "2026-12-01T00:01:00.000Z"
    m = plan(RoutesManifest(model="m"), Intent({"production": 1}), t1)
    preview = with_preview(m, 3, alias="production", trigger="cli", now=t2, history_limit=50,
                           actor="ana", reason="check v3")
    assert preview.generation == m.generation + 1 and preview.aliases == m.aliases
    entry = preview.history[-1]
    assert (entry.event, entry.version, entry.from_version, entry.actor, entry.reason) == ("preview", 3, 1, "ana", "check v3")
    assert with_preview(preview, 3, alias="production", trigger="cli", now="t3", history_limit=50) is preview
    assert with_preview(m, 1, alias="production", trigger="cli", now="t3", history_limit=50) is m  # served already
    ref = parse_model_name("base:m@v3")
    assert resolve_model_name(ref, "base", {"m": preview}, ["production"]).folder == "m-v3"
    with pytest.raises(Exception, match="never promoted"):
        resolve_model_name(ref, "base", {"m": m}, ["production"])
    assert plan(preview, Intent({"production": 1}), t2) is preview  # the reconciler has nothing to undo
    moved = plan(preview, Intent({"production": 2}), t2)
    assert 3 in moved.published_versions() and rollback_target(moved, "production") == 1
    now = datetime(2026, 12, 1, 1, tzinfo=timezone.utc)
    assert "m-v3" in referenced_folders([moved], {}, now, timedelta(days=1))


def test_the_live_gate_refuses_below_tracked_or_current_by_more_than_the_margin():
    from registry_hooks.plan import served_gate_refusal

    def gate(served, tracked, current=None, margin=0.02):
        return served_gate_refusal(3, served, tracked, current_version=1, current_served=current, margin=margin,
                                   data_source="maze_2d/local7")

    assert gate(0.50, 0.51) is None and gate(0.50, 0.50, current=0.52) is None
    below_tracked = gate(0.40, 0.50)
    assert "0.4000" in below_tracked and "tracked 0.5000" in below_tracked and "margin 0.02" in below_tracked
    below_current = gate(0.50, 0.45, current=0.60)
    assert "current v1's served 0.6000" in below_current and "tracked" not in below_current
    assert "and" in gate(0.30, 0.50, current=0.60)
    assert gate(0.30, 0.50, margin=0.25) is None


def test_the_cli_actor_is_the_authenticated_mlflow_user_only_with_tracking_auth():
    import getpass

    from registry_hooks.cli import actor
    from rlops.config import Config

    with_auth = Config.model_validate({"server": {"auth": True}})
    assert actor(with_auth, {"MLFLOW_TRACKING_USERNAME": "alice"}) == "alice"
    # Without auth the name in the environment is free text: the OS user, marked as such.
    assert actor(Config(), {"MLFLOW_TRACKING_USERNAME": "alice"}) == f"os:{getpass.getuser()}"
    assert actor(with_auth, {}) == f"os:{getpass.getuser()}"
