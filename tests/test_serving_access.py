"""Scoped API keys and rate limits (serving.access), pure: the keys file, what a scope may call and list,
rotation and a broken file, and the per-key buckets. The real app's answers are in test_serving_app."""
from __future__ import annotations

import os
import time
import timeit

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rlops.layout import parse_model_name
from serving.access import (
    ENV_KEYS_SCOPE,
    AccessControl,
    AccessError,
    KeyScope,
    KeysFileError,
    RateLimiter,
    digest,
    env_scopes,
    parse_keys_file,
)
from serving.ingress import ClientError, charged_tokens, resolve
from serving.routes import RoutesTable

from test_serving_routes import BASE, manifest

TEAM_KEY, OTHER_KEY = "sk-team-" + "a" * 24, "sk-other-" + "b" * 24


def keys_yaml(*entries: str) -> str:
    return "keys:\n" + "".join(entries)


def entry(name: str, key: str, extra: str = "") -> str:
    return f"  - name: {name}\n    sha256: {digest(key)}\n    models: ['maze-*']\n{extra}"


def table() -> RoutesTable:
    return RoutesTable(BASE, ("production", "staging"), "production",
                       {"maze-grpo": manifest("maze-grpo", production=2, staging=3),
                        "shapes-grpo": manifest("shapes-grpo", production=1)})


def test_a_scope_calls_only_its_models_aliases_and_addressing():
    scope = KeyScope(name="team", sha256=digest(TEAM_KEY), models=["maze-*"], aliases=["production"])
    allowed = {name: scope.may_call(parse_model_name(name)) for name in (
        f"{BASE}:maze-grpo", f"{BASE}:maze-grpo@production", f"{BASE}:maze-grpo@staging", f"{BASE}:maze-grpo@v2",
        f"{BASE}:shapes-grpo", BASE)}
    assert allowed == {f"{BASE}:maze-grpo": True, f"{BASE}:maze-grpo@production": True,
                       f"{BASE}:maze-grpo@staging": False, f"{BASE}:maze-grpo@v2": False,
                       f"{BASE}:shapes-grpo": False, BASE: False}
    wide = scope.model_copy(update={"aliases": ["*"], "versions": True, "base": True})
    assert all(wide.may_call(parse_model_name(n)) for n in (f"{BASE}:maze-grpo@staging", f"{BASE}:maze-grpo@v2", BASE))


def test_out_of_scope_is_a_403_that_does_not_say_whether_the_model_exists():
    scope = KeyScope(name="team", sha256=digest(TEAM_KEY), models=["maze-*"])
    answers = {}
    for name in (f"{BASE}:shapes-grpo", f"{BASE}:no-such-model", f"{BASE}:maze-grpo@v2"):
        with pytest.raises(ClientError) as info:
            resolve(table(), name, scope=scope)
        answers[name] = (info.value.status, info.value.code, info.value.message.replace(name, "NAME"))
    assert len(set(answers.values())) == 1 and next(iter(answers.values()))[:2] == (403, "model_not_permitted")
    with pytest.raises(ClientError) as info:  # in scope but not there: the key may know that
        resolve(table(), f"{BASE}:maze-nothing", scope=scope)
    assert info.value.status == 404
    assert resolve(table(), f"{BASE}:maze-grpo@staging", scope=scope).version == 3


def test_a_key_outside_canary_cohorts_always_gets_the_alias_target():
    canary_manifest = manifest("maze-grpo", production=2).model_copy(update={"canaries": {
        "production": manifest("maze-grpo", production=5).aliases["production"].model_copy(update={"weight": 99.0})}})
    routes = RoutesTable(BASE, ("production",), "production", {"maze-grpo": canary_manifest})
    joins = KeyScope(name="a", sha256=digest(TEAM_KEY), models=["*"])
    stays = joins.model_copy(update={"canary": False})
    picked = {scope.name + str(scope.canary): {resolve(routes, f"{BASE}:maze-grpo", f"user:{i}", scope).version
                                               for i in range(50)} for scope in (joins, stays)}
    assert picked == {"aTrue": {2, 5}, "aFalse": {2}}


def test_models_list_only_what_the_scope_may_call():
    scope = KeyScope(name="team", sha256=digest(TEAM_KEY), models=["maze-*"], aliases=["production"])
    listed = [c["id"] for c in table().model_cards() if scope.lists(c, "production")]
    assert listed == [f"{BASE}:maze-grpo", f"{BASE}:maze-grpo@production"]


@pytest.mark.parametrize("text,expected", [
    ("keys: [", "not valid YAML"),
    ("keys:\n  - name: a\n    sha256: sk-plaintext\n    models: ['*']\n", "keys.0.sha256"),
    ("keys:\n  - name: a\n    sha256: " + "1" * 64 + "\n    models: ['*']\n", "quoted string"),
    ("keys:\n  - name: a\n    sha256: " + "a" * 64 + "\n", "keys.0.models"),
    ("keys:\n  - name: a\n    sha256: " + "a" * 64 + "\n    models: ['*']\n    admin: true\n", "keys.0.admin"),
    (keys_yaml(entry("a", TEAM_KEY), entry("a", OTHER_KEY)), "same name 'a'"),
    (keys_yaml(entry("a", TEAM_KEY), entry("b", TEAM_KEY)), "same sha256"),
    ("keys:\n  - name: a\n    sha256: " + "a" * 64 + "\n    models: ['*']\n    requests_per_minute: 0\n",
     "keys.0.requests_per_minute"),
])
def test_a_bad_keys_file_is_refused_naming_the_entry_and_field(text, expected):
    with pytest.raises(KeysFileError) as info:
        parse_keys_file(text, "keys.yaml")
    assert expected in str(info.value) and str(info.value).startswith("keys.yaml: ")
    assert TEAM_KEY not in str(info.value) and OTHER_KEY not in str(info.value)


def test_rotation_takes_effect_and_a_broken_file_keeps_the_last_good_one(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("team", TEAM_KEY)))
    access = AccessControl(str(path), env_scopes({"ALL": "sk-all"}, "ALL"), check_every_s=0.0)
    assert access.scope(f"Bearer {TEAM_KEY}").name == "team"
    assert access.scope("Bearer sk-all").name == ENV_KEYS_SCOPE  # the old variable: every model
    for header in (None, "Bearer", f"Basic {TEAM_KEY}", f"Bearer {OTHER_KEY}"):
        with pytest.raises(AccessError) as info:
            access.scope(header)
        assert info.value.status == 401 and TEAM_KEY not in info.value.message

    path.write_text(keys_yaml(entry("other", OTHER_KEY)))  # rotation: the team's key is revoked
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1))
    assert access.scope(f"Bearer {OTHER_KEY}").name == "other"
    with pytest.raises(AccessError):
        access.scope(f"Bearer {TEAM_KEY}")

    path.write_text("keys: [")  # broken: the last good file stays in use, the error is kept
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2))
    assert access.scope(f"Bearer {OTHER_KEY}").name == "other" and "not valid YAML" in access.error
    path.unlink()
    assert access.scope(f"Bearer {OTHER_KEY}").name == "other" and "cannot be read" in access.error
    path.write_text(keys_yaml(entry("team", TEAM_KEY)))
    assert access.scope(f"Bearer {TEAM_KEY}").name == "team" and access.error is None


def test_no_keys_configured_means_open_and_an_empty_env_variable_is_an_error():
    assert AccessControl(None, {}, 1.0).scope(None) is None
    with pytest.raises(ValueError, match="ALL"):
        env_scopes({}, "ALL")


def test_request_limit_answers_429_with_retry_after_and_refills():
    scope = KeyScope(name="team", sha256=digest(TEAM_KEY), models=["*"], requests_per_minute=6)
    limiter = RateLimiter()
    for _ in range(6):
        limiter.admit(scope, 0, now=100.0)
    with pytest.raises(AccessError) as info:
        limiter.admit(scope, 0, now=100.0)
    assert info.value.status == 429 and info.value.retry_after_s == 10 and "'team'" in info.value.message
    limiter.admit(scope, 0, now=110.0)  # one request per 10 s comes back


def test_token_limit_charges_the_cap_up_front_and_gives_back_what_was_not_used():
    scope = KeyScope(name="team", sha256=digest(TEAM_KEY), models=["*"], tokens_per_minute=1000)
    limiter = RateLimiter()
    limiter.admit(scope, 800, now=0.0)
    with pytest.raises(AccessError):
        limiter.admit(scope, 800, now=0.0)
    limiter.settle(scope, 800, 50)  # it used 50
    limiter.admit(scope, 800, now=0.0)
    with pytest.raises(AccessError) as info:  # never fits: said at once, not "retry in 60 s" forever
        limiter.admit(scope, 5000, now=0.0)
    assert "lower 'max_tokens'" in info.value.message


def test_each_of_r_replicas_enforces_its_share():
    scope = KeyScope(name="team", sha256=digest(TEAM_KEY), models=["*"], requests_per_minute=60)
    replicas = [RateLimiter(replicas=3) for _ in range(3)]
    admitted = 0
    for i in range(90):  # Serve spreads requests evenly: round robin here
        try:
            replicas[i % 3].admit(scope, 0, now=0.0)
            admitted += 1
        except AccessError:
            pass
    assert admitted == 60


def test_charged_tokens_is_sequences_times_the_cap():
    class Body:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    assert charged_tokens(Body(n=2, max_tokens=100), 16384) == 200
    assert charged_tokens(Body(n=None, max_completion_tokens=30, max_tokens=100), 16384) == 30
    assert charged_tokens(Body(), 16384) == 16384


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.text(max_size=300))
def test_any_keys_file_text_parses_or_is_refused_with_a_message(text):
    try:
        parse_keys_file(text, "keys.yaml")
    except KeysFileError as exc:
        assert str(exc).startswith("keys.yaml: ")


def test_a_wrong_key_costs_the_same_however_much_of_the_real_key_it_shares():
    """The check looks up sha256(key), never compares keys: a near miss (the real key but its last
    character) takes as long as a key sharing nothing, within noise."""
    real = "sk-" + "a" * 61
    control = AccessControl(None, env_scopes({"KEYS": real}, "KEYS"), 1.0)
    near, far = "Bearer " + real[:-1] + "b", "Bearer " + "z" * len(real)

    def attempt(header: str) -> None:
        try:
            control.scope(header)
        except AccessError:
            pass

    # Interleaved short rounds, best of each: a burst of other work on a shared 2-core machine then
    # slows rounds of both kinds instead of every round of whichever kind was being timed.
    rounds = [(timeit.timeit(lambda: attempt(near), number=300), timeit.timeit(lambda: attempt(far), number=300))
              for _ in range(40)]
    near_s, far_s = min(r[0] for r in rounds), min(r[1] for r in rounds)
    assert 0.7 < near_s / far_s < 1.4, (near_s, far_s)
