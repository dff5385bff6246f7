"""Shadow routes without servers: the manifest field, planning from the registry's intent, compatibility."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from registry_hooks.plan import Intent, drift, effective_intent, next_manifest, served_targets, shadow_targets
from registry_hooks.registry import intent_of
from rlops.layout import AliasRoute, MoveNote, RoutesManifest, ShadowRoute, shadow_alias
from serving.routes import RoutesTable, hot_adapter_ids


def route(version: int) -> AliasRoute:
    return AliasRoute(version=version, folder=f"m-v{version}", files={"a.json": "0" * 64}, promoted_at="t0", trigger="x")


ROUTES = {v: route(v) for v in (1, 2, 3)}


def plan(old: RoutesManifest, intent: Intent, now: str, **kw) -> RoutesManifest:
    return next_manifest(old, intent, ROUTES, {}, trigger=kw.pop("trigger", "cli"), now=now, history_limit=50, **kw)


def test_a_shadow_is_published_beside_its_alias_reweighted_and_stopped_with_history():
    m = plan(RoutesManifest(model="m"), Intent({"production": 1}), "t1")
    ana = {"production-shadow": MoveNote(move_id="s1", version=2, trigger="cli", actor="ana", reason="try on live")}
    m = plan(m, Intent({"production": 1, "production-shadow": 2}, percents={"production": 20}, notes=ana), "t2")
    assert m.aliases["production"].version == 1
    assert (m.shadows["production"].version, m.shadows["production"].percent) == (2, 20)
    assert 2 in m.published_versions()  # its folder is referenced: nothing collects it while it is shadowed
    assert served_targets(m) == {"production": 1, "production-shadow": 2}
    assert plan(m, Intent({"production": 1, "production-shadow": 2}, percents={"production": 20}), "t3") is m
    m = plan(m, Intent({"production": 1, "production-shadow": 2}, percents={"production": 50}), "t3")
    assert m.shadows["production"].percent == 50 and m.shadows["production"].promoted_at == "t2"
    stopped = plan(m, Intent({"production": 1}), "t4", trigger="reconciler")
    assert stopped.shadows == {} and stopped.aliases["production"].version == 1
    events = [(h.event, h.version, h.from_version, h.weight, h.actor) for h in stopped.history]
    assert events == [("move", 1, None, None, "registry"), ("shadow", 2, 1, 20, "ana"),
                      ("shadow", 2, 1, 50, "registry"), ("shadow_stopped", 2, 2, 0, "registry")]


def test_a_shadow_nothing_can_compare_is_not_published():
    """No percent, no alias, or the alias's own version: nothing to publish, and not part of the intent."""
    for intent in (Intent({"production": 1, "production-shadow": 2}),
                   Intent({"production-shadow": 2}, percents={"production": 10}),
                   Intent({"production": 2, "production-shadow": 2}, percents={"production": 10})):
        assert shadow_targets(intent) == {}
        assert shadow_alias("production") not in effective_intent(intent)
        assert plan(RoutesManifest(model="m"), intent, "t1").shadows == {}


def test_a_shadow_route_is_held_to_the_folder_grammar_and_needs_another_baseline():
    base = {"model": "m", "aliases": {"production": route(1).model_dump() | {"folder": "m-v1"}}}
    ok = dict(base, shadows={"production": ShadowRoute(**route(2).model_dump(), percent=5).model_dump()})
    ok["aliases"]["production"]["folder"] = "m-v1"
    ok["shadows"]["production"]["folder"] = "m-v2"
    assert RoutesManifest.model_validate(ok).shadows["production"].percent == 5
    for bad, why in ((dict(folder="other-v2"), "folder"), (dict(version=1, folder="m-v1"), "another version"),
                     (dict(percent=0), "greater than 0"), (dict(percent=101), "less than or equal to 100")):
        data = json.loads(json.dumps(ok))
        data["shadows"]["production"].update(bad)
        with pytest.raises(ValidationError, match=why):
            RoutesManifest.model_validate(data)


def test_a_manifest_without_a_shadow_is_written_as_the_release_before_reads_it():
    m = plan(RoutesManifest(model="m"), Intent({"production": 1}), "t1")
    assert "shadows" not in json.loads(m.model_dump_json())
    with_shadow = plan(m, Intent({"production": 1, "production-shadow": 2}, percents={"production": 1}), "t2")
    written = json.loads(with_shadow.model_dump_json())
    assert written["shadows"]["production"]["percent"] == 1
    assert RoutesManifest.model_validate(written) == with_shadow


def test_intents_differ_by_shadow_percent():
    assert Intent({"p": 1}, percents={"p": 10}) != Intent({"p": 1}, percents={"p": 20})
    assert Intent({"p": 1}, percents={"p": 10}) == Intent({"p": 1}, percents={"p": 10})


def test_the_registry_intent_reads_a_shadow_alias_and_its_percent():
    registered = SimpleNamespace(aliases={"production": "1", "production-shadow": "2", "staging-shadow": "3"},
                                 tags={"rlops.shadow_percent.production": "20", "rlops.shadow_percent.staging": "0"},
                                 latest_versions=[])
    intent = intent_of(registered, ["production", "staging"])
    assert dict(intent) == {"production": 1, "production-shadow": 2, "staging-shadow": 3}
    assert intent.percents == {"production": 20.0}  # 0 is no share: not served
    assert shadow_targets(intent) == {"production": (2, 20.0)}


def test_a_shadow_the_registry_wants_but_serving_lacks_is_drift():
    m = plan(RoutesManifest(model="m"), Intent({"production": 1}), "t1")
    wanted = Intent({"production": 1, "production-shadow": 2}, percents={"production": 20})
    assert [d.describe() for d in drift(wanted, m)] == ["production-shadow: registry v2 at 20%, served nothing at 0%"]
    m = plan(m, wanted, "t2")
    assert drift(wanted, m) == []
    assert [d.describe() for d in drift(Intent({"production": 1}, percents={}), m)] == [
        "production-shadow: registry unset at 0%, served v2 at 20%"]


def test_a_request_answered_by_the_alias_target_is_the_one_copied_and_the_shadow_is_hot():
    m = plan(RoutesManifest(model="m"), Intent({"production": 1, "staging": 1, "production-canary": 3},
                                               {"production": 50}), "t1")
    m = plan(m, Intent({"production": 1, "staging": 1, "production-canary": 3, "production-shadow": 2},
                       {"production": 50}, percents={"production": 10}), "t2")
    table = RoutesTable("b", ("production", "staging"), "production", {"m": m})
    keys = [f"k{i}" for i in range(40)]
    answered = {key: table.resolve("b:m", key) for key in keys}
    assert {r.canary for r in answered.values()} == {True, False}  # both sides of the canary answered
    for resolution in answered.values():
        shadow = table.shadow(resolution)
        assert (shadow.version if shadow else None) == (None if resolution.canary else 2)
    assert table.shadow(table.resolve("b:m@staging")) is None  # staging has no shadow
    assert table.shadow(table.resolve("b:m@v1")) is None  # a pinned version is nobody's alias
    assert table.shadow(table.resolve("b")) is None
    assert "b:m-v2" in hot_adapter_ids(table, 8)  # the LLM replicas load the shadow before copies arrive
