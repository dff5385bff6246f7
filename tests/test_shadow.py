"""Shadow intent on the real stack (MLflow registry + S3): start, reshare, stop, with the manifest, the registry
and the history agreeing at each step."""
from __future__ import annotations

import json
import time

import pytest

from registry_hooks import operations
from registry_hooks.operations import NotFound, UsageProblem
from test_promotion_support import (  # noqa: F401 - fixtures
    assert_manifest_consistent,
    lora_template,
    register_version,
    write_adapter,
)


def test_a_shadow_is_copied_published_reshared_and_stopped(stack, test_config, mlflow_client, lora_template, tmp_path):
    model = test_config.registry.models[0]
    v1, v2 = (register_version(test_config, write_adapter(lora_template, tmp_path / f"a{seed}", test_config, seed=seed),
                               step=seed, metric=metric) for seed, metric in ((1, 0.6), (2, 0.2)))
    operations.promote(test_config, model, to_alias="production", version=v1, actor="ana")

    # a worse version may be shadowed: it answers no client, so the eval guardrail does not stop it
    report = operations.shadow(test_config, model, version=v2, percent=20, actor="ana", reason="try on live")
    assert report.shadows == {"production": {"version": v2, "percent": 20}} and report.served == {"production": v1}
    manifest = assert_manifest_consistent(stack, test_config)  # v2's folder is complete and verified
    assert manifest.shadows["production"].version == v2 and manifest.aliases["production"].version == v1
    assert mlflow_client.get_model_version_by_alias(model, "production-shadow").version == str(v2)
    assert mlflow_client.get_registered_model(model).tags["rlops.shadow_percent.production"] == "20"

    assert operations.shadow(test_config, model, version=v2, percent=100).shadows["production"]["percent"] == 100
    for kwargs, error, message in [
        (dict(version=v2, percent=0), UsageProblem, "above 0 and at most 100"),
        (dict(version=v1, percent=10), UsageProblem, f"already serves v{v1}"),
        (dict(version=v2), UsageProblem, "above 0"),
        (dict(version=v2, percent=10, stop=True), UsageProblem, "exactly one of"),
        (dict(version=v2, percent=10, alias="staging"), NotFound, "is not set"),
    ]:
        with pytest.raises(error, match=message):
            operations.shadow(test_config, model, **kwargs)

    report = operations.shadow(test_config, model, stop=True, actor="bo", reason="enough pairs")
    assert report.shadows == {} and report.served == {"production": v1}
    assert "production-shadow" not in mlflow_client.get_registered_model(model).aliases
    assert "rlops.shadow_percent.production" not in mlflow_client.get_registered_model(model).tags
    with pytest.raises(NotFound, match="has no shadow to stop"):
        operations.shadow(test_config, model, stop=True)
    events = [(e.event, e.version, e.from_version, e.weight, e.actor, e.reason)
              for e in assert_manifest_consistent(stack, test_config).history]
    assert events == [("move", v1, None, None, "ana", None), ("shadow", v2, v1, 20, "ana", "try on live"),
                      ("shadow", v2, v1, 100, None, None),
                      ("shadow_stopped", v2, v2, 0, "bo", "enough pairs")]


def write_pairs(config, model: str, primary: int, shadow: int, pairs: list[tuple[str, str, int, float]],
                scored: bool = False) -> None:
    """Each (primary answer, shadow answer, shadow status, shadow latency) as the ingress writes a pair:
    two traces sharing the pair's id, through the real TraceWriter into the stack's MLflow. `scored`: the
    request is a maze with its picture, scored by the maze task in the recorder, where `up` stands for the
    maze's solution and anything else for an answer that does not solve it."""
    import uuid

    from rlops.layout import TRACE_TAG_SHADOW_PAIR, TRACE_TAG_SHADOW_ROLE
    from serving.trace_writer import TraceWriter, TraceWriterSettings
    from serving.traces import ServedRequest
    from tasks.maze.env import answer_text, solve
    from tasks.maze.task import item_maze

    counts: dict[str, int] = {}
    task = {"task_path": config.task.path, "task_options": dict(config.task.options)} if scored else {}
    writer = TraceWriter(TraceWriterSettings(sample_rate=0, content=True, queue_size=1000, queue_mib=8,
                                             experiment=f"shadow-{uuid.uuid4().hex[:6]}",
                                             tracking_uri=config.tracking_uri, **task),
                         lambda outcome, n: counts.update({outcome: counts.get(outcome, 0) + n})).start()
    messages, solution = [{"role": "user", "content": "go"}], None
    if scored:
        maze = config.load_task()
        item = maze.eval_items(maze.eval_sets()[0])[0]
        messages, solution = item.messages(), answer_text(solve(item_maze(item)))

    def answer(text: str) -> bytes:
        text = solution if solution and text == "up" else text
        return json.dumps({"id": uuid.uuid4().hex, "choices": [{"index": 0, "message": {"content": text}}]}).encode()

    request = json.dumps({"messages": messages}).encode()
    for primary_text, shadow_text, shadow_status, shadow_ms in pairs:
        pair = uuid.uuid4().hex
        common = dict(endpoint="chat", registered_model=model, canary=False, client=None, started_ns=time.time_ns(),
                      ttft_ms=None, usage=None, request=request)
        writer.offer(ServedRequest(model_name=f"b:{model}", alias="production", version=primary, latency_ms=4.0,
                                   status=200, answer=answer(primary_text),
                                   tags={TRACE_TAG_SHADOW_PAIR: pair, TRACE_TAG_SHADOW_ROLE: "primary"}, **common))
        writer.offer(ServedRequest(model_name=f"b:{model}@v{shadow}", alias=None, version=shadow,
                                   latency_ms=shadow_ms, status=shadow_status,
                                   answer=answer(shadow_text) if shadow_status == 200 else b"{}",
                                   tags={TRACE_TAG_SHADOW_PAIR: pair, TRACE_TAG_SHADOW_ROLE: "shadow"}, **common))
    deadline = time.monotonic() + 120
    while counts.get("recorded", 0) < 2 * len(pairs) and time.monotonic() < deadline:
        time.sleep(0.5)
    writer.stop()
    assert counts.get("recorded") == 2 * len(pairs), counts


def two_versions(test_config, lora_template, tmp_path) -> tuple[int, int]:
    return tuple(register_version(test_config, write_adapter(lora_template, tmp_path / f"a{seed}", test_config,
                                                             seed=seed), step=seed) for seed in (1, 2))


def test_shadow_status_joins_the_pairs_traced_since_the_shadow_started(stack, test_config, lora_template, tmp_path):
    """The pairs as the ingress writes them (TraceWriter, real MLflow): joined by pair id across the two
    versions' traces, unscored answers compared for agreement, the shadow's errors and latency counted."""
    model = test_config.registry.models[0]
    v1, v2 = two_versions(test_config, lora_template, tmp_path)
    operations.promote(test_config, model, to_alias="production", version=v1)
    with pytest.raises(NotFound, match="has no shadow"):
        operations.shadow_status(test_config, model)
    operations.shadow(test_config, model, version=v2, percent=50)
    write_pairs(test_config, model, v1, v2, [("up", "up", 200, 5.0)] * 3 + [("up", "left", 200, 7.0)] * 2
                + [("up", "", 500, 1.0)])

    status = operations.shadow_status(test_config, model)
    assert (status["primary_version"], status["shadow_version"], status["percent"]) == (v1, v2, 50)
    assert (status["pairs"], status["ties"], status["unscored_differ"]) == (6, 3, 3)
    assert status["wins"] == status["losses"] == 0  # nothing scored them
    assert status["shadow_error_rate"] == pytest.approx(1 / 6) and status["primary_error_rate"] == 0
    assert (status["primary_p50_ms"], status["shadow_p50_ms"]) == (4.0, 5.0)
    assert "6 pairs" in status["summary"]


def test_the_shadow_gate_refuses_a_worse_shadow_with_its_figures_and_passes_a_better_one(
        stack, test_config, mlflow_client, lora_template, tmp_path):
    from registry_hooks.operations import Refused, ShadowGate

    model = test_config.registry.models[0]
    v1, v2 = two_versions(test_config, lora_template, tmp_path)
    operations.promote(test_config, model, to_alias="production", version=v1)
    gate = ShadowGate(min_pairs=10, max_p=0.05)
    with pytest.raises(NotFound, match="has no shadow"):
        operations.promote(test_config, model, to_alias="production", version=v2, shadow_gate=gate)
    operations.shadow(test_config, model, version=v2, percent=100)
    write_pairs(test_config, model, v1, v2, [("up", "left", 200, 5.0)] * 9 + [("left", "up", 200, 5.0)], scored=True)
    with pytest.raises(Refused, match=r"worse on live traffic: 10 pairs: shadow 1 wins, 9 losses, 0 ties"):
        operations.promote(test_config, model, to_alias="production", version=v2, shadow_gate=gate)
    assert mlflow_client.get_model_version_by_alias(model, "production").version == str(v1)  # nothing moved
    assert "shadow gate refused" in mlflow_client.get_model_version(model, str(v2)).tags["rlops.shadow_gate"]
    with pytest.raises(Refused, match="is not the shadow"):
        operations.promote(test_config, model, to_alias="production", version=v1, shadow_gate=gate)

    operations.shadow(test_config, model, stop=True)  # started again: the evidence counts from then on
    operations.shadow(test_config, model, version=v2, percent=100)
    write_pairs(test_config, model, v1, v2, [("left", "up", 200, 5.0)] * 8 + [("up", "up", 200, 5.0)] * 4,
                scored=True)
    report = operations.promote(test_config, model, to_alias="production", version=v2, shadow_gate=gate,
                                reason="live pairs")
    assert report.served["production"] == v2 and report.shadows == {}  # the shadow ended with the move
    entry = assert_manifest_consistent(stack, test_config).history[-2]
    assert (entry.event, entry.version) == ("move", v2)
    assert entry.reason.startswith("live pairs; shadow gate passed: 12 pairs: shadow 8 wins, 0 losses, 4 ties")
    assert "production-shadow" not in mlflow_client.get_registered_model(model).aliases


def test_a_canary_start_passes_the_shadow_gate_its_alias_requires_and_its_promotion_is_not_asked_again(
        stack, test_config, mlflow_client, lora_template, tmp_path):
    from registry_hooks.operations import Refused, ShadowGate
    from rlops.config import ShadowGateConfig

    model = test_config.registry.models[0]
    v1, v2 = two_versions(test_config, lora_template, tmp_path)
    operations.promote(test_config, model, to_alias="production", version=v1)
    required = ShadowGateConfig(required_aliases=["production"], min_pairs=5)
    config = test_config.model_copy(update={"registry": test_config.registry.model_copy(update={"shadow": required})})
    with pytest.raises(NotFound, match="has no shadow"):
        operations.canary(config, model, version=v2, weight=10)
    with pytest.raises(UsageProblem, match="gates the start of a canary"):
        operations.canary(config, model, abort=True, shadow_gate=ShadowGate(5, 0.05))
    operations.shadow(config, model, version=v2, percent=50)
    write_pairs(config, model, v1, v2, [("left", "up", 200, 5.0)] * 2, scored=True)
    with pytest.raises(Refused, match=r"only 2 scored shadow pairs, 5 required"):
        operations.canary(config, model, version=v2, weight=10)
    assert "production-canary" not in mlflow_client.get_registered_model(model).aliases  # nothing moved
    write_pairs(config, model, v1, v2, [("left", "up", 200, 5.0)] * 3, scored=True)

    report = operations.canary(config, model, version=v2, weight=10, reason="pairs won")
    assert report.canaries == {"production": {"version": v2, "weight": 10}} and report.shadows == {}
    started = next(e for e in reversed(assert_manifest_consistent(stack, test_config).history) if e.event == "canary")
    assert started.reason.startswith("pairs won; shadow gate passed: 5 pairs: shadow 5 wins, 0 losses"), started
    assert "shadow gate passed" in mlflow_client.get_model_version(model, str(v2)).tags["rlops.shadow_gate"]
    report = operations.canary(config, model, promote_it=True)  # the canary's own start was the gate
    assert report.served["production"] == v2 and report.canaries == {}


def test_a_shadow_that_has_won_becomes_a_canary_by_itself_once_and_one_that_has_not_stays(
        stack, test_config, mlflow_client, lora_template, tmp_path):
    from registry_hooks.auto_canary import AUTO_CANARY_ACTOR, AutoCanary
    from rlops.config import AutoCanaryConfig, ShadowGateConfig

    model = test_config.registry.models[0]
    v1, v2 = two_versions(test_config, lora_template, tmp_path)
    operations.promote(test_config, model, to_alias="production", version=v1)
    policy = ShadowGateConfig(min_pairs=5, auto_canary=AutoCanaryConfig(weight=15, min_pairs=8, max_p=0.05))
    config = test_config.model_copy(update={"registry": test_config.registry.model_copy(update={"shadow": policy})})
    auto = AutoCanary(config)
    assert auto.tick() == []  # no shadow
    operations.shadow(config, model, version=v2, percent=50)
    write_pairs(config, model, v1, v2, [("left", "up", 200, 5.0)] * 5 + [("up", "up", 200, 5.0)] * 2, scored=True)
    assert auto.tick() == []  # 5 wins of 5 decided (p better 0.031), but 7 scored pairs and 8 needed
    write_pairs(config, model, v1, v2, [("up", "left", 200, 5.0)] * 3, scored=True)
    assert auto.tick() == []  # 5 wins, 3 losses: not a win (p better 0.36)
    write_pairs(config, model, v1, v2, [("left", "up", 200, 5.0)] * 6, scored=True)

    started = auto.tick()  # 11 wins, 3 losses, 2 ties: p better 0.029
    assert [(s["model"], s["alias"], s["version"], s["weight"]) for s in started] == [(model, "production", v2, 15)]
    manifest = assert_manifest_consistent(stack, config)
    assert {a: c.version for a, c in manifest.canaries.items()} == {"production": v2} and manifest.shadows == {}
    canary = next(e for e in reversed(manifest.history) if e.event == "canary")
    assert (canary.trigger, canary.actor, canary.weight) == ("shadow", AUTO_CANARY_ACTOR, 15)
    assert canary.reason.startswith("the shadow won on live traffic: 16 pairs: shadow 11 wins, 3 losses, 2 ties")
    assert "shadow gate passed" in canary.reason  # the configured gate was checked, and recorded on the version
    assert "shadow gate passed" in mlflow_client.get_model_version(model, str(v2)).tags["rlops.shadow_gate"]
    assert auto.tick() == []  # the shadow ended with it: nothing more to start
    assert mlflow_client.get_model_version_by_alias(model, "production").version == str(v1)  # clients: a canary only


def test_promote_shadow_cli_start_status_history_stop_and_usage_errors(stack, test_config, lora_template, tmp_path):
    from click.testing import CliRunner

    from conftest import write_config
    from registry_hooks.cli import main as promote_cli

    model = test_config.registry.models[0]
    v1, v2 = two_versions(test_config, lora_template, tmp_path)
    path = write_config(tmp_path / "mlflow.yaml", test_config.model_dump(exclude_none=True))

    def cli(*args: str):
        result = CliRunner().invoke(promote_cli, ["--config", str(path), *args], catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    assert cli(model, "--version", str(v1), "--to", "production")[0] == 0
    code, out, _ = cli("shadow", model, "--version", str(v2), "--percent", "25", "--reason", "live look")
    assert code == 0 and f"shadow   production: v{v2} gets a copy of 25% of its requests" in out, out
    code, out, _ = cli("shadow", "status", model, "--json")
    assert code == 0 and json.loads(out)["pairs"] == 0 and json.loads(out)["shadow_version"] == v2
    code, out, _ = cli("shadow", "status", model)
    assert code == 0 and f"v{v1} answers, v{v2} shadows 25%" in out and "0 pairs" in out
    for args, expected, message in [
        (("--version", str(v2)), 2, "needs --percent"),
        (("--version", str(v2), "--percent", "0"), 2, "above 0 and at most 100"),
        (("--version", "99", "--percent", "5"), 3, "does not exist"),
        (("--version", str(v2), "--percent", "5", "--alias", "nope"), 3, "not served"),
    ]:
        code, _, err = cli("shadow", model, *args)
        assert code == expected and message in err, (args, code, err)
    assert cli("shadow", model, "--stop", "--reason", "enough")[0] == 0
    code, _, err = cli("shadow", "status", model)
    assert code == 3 and "has no shadow" in err
    code, _, err = cli("canary", model, "--version", str(v2), "--weight", "10", "--require-shadow")
    assert code == 3 and "has no shadow" in err
    code, _, err = cli("canary", model, "--abort", "--require-shadow")
    assert code == 2 and "gates the start of a canary" in err
    code, out, _ = cli("history", model)
    assert code == 0 and f"shadow v{v2} at 25% (beside v{v1})" in out and f"shadow v{v2} stopped" in out
