"""Pure promotion logic (no servers): manifest planning, rollback, drift, adapter checks, webhook auth."""
from __future__ import annotations

import json
import struct

import pytest

from registry_hooks.adapter import (
    AdapterPolicy,
    InvalidAdapter,
    check_adapter_config,
    check_files,
    check_safetensors_header,
    copy_order,
    safetensors_header_length,
)
from registry_hooks.plan import drift, needs_sync, next_manifest, rollback_target
from registry_hooks.webhook import Rejected, SeenDeliveries, authenticate, parse_delivery, sign
from rlops.layout import AliasRoute, RoutesManifest

POLICY = AdapterPolicy(max_rank=32, base_models=frozenset({"/models/base"}), target_modules=frozenset({"q_proj", "v_proj"}))
CONFIG = {"peft_type": "LORA", "r": 8, "base_model_name_or_path": "/models/base",
          "target_modules": ["model.layers.0.self_attn.q_proj", "v_proj"]}


def route(version: int) -> AliasRoute:
    return AliasRoute(version=version, folder=f"m-v{version}", files={"a.json": "0" * 64}, promoted_at="t0", trigger="x")


def test_next_manifest_moves_refuses_and_drops_aliases():
    old = next_manifest(RoutesManifest(model="m"), {"production": 1, "staging": 1}, {1: route(1)}, {},
                        trigger="a", now="t1", history_limit=10)
    assert old.generation == 1 and old.aliases["production"].promoted_at == "t1"
    same = next_manifest(old, {"production": 1, "staging": 1}, {}, {}, trigger="b", now="t2", history_limit=10)
    assert same is old  # nothing changed: no new generation, nothing to write
    new = next_manifest(old, {"production": 2}, {}, {2: "bad rank"}, trigger="b", now="t3", history_limit=10)
    assert new.aliases == {"production": old.aliases["production"]}  # refused: keeps the old target
    assert new.refused["production"].version == 2 and new.refused["production"].reason == "bad rank"
    assert "staging" not in new.aliases and new.generation == 2
    again = next_manifest(new, {"production": 2}, {}, {2: "bad rank"}, trigger="c", now="t4", history_limit=10)
    assert again is new  # a standing refusal is not rewritten
    fixed = next_manifest(new, {"production": 3}, {3: route(3)}, {}, trigger="d", now="t5", history_limit=2)
    assert fixed.aliases["production"].version == 3 and fixed.refused == {}
    assert [(h.alias, h.version) for h in fixed.history] == [("staging", 1), ("production", 3)]  # limit 2



def test_needs_sync_is_true_exactly_when_a_sync_would_change_the_manifest():
    """The reconciler skips a model only when next_manifest would return the manifest unchanged."""
    served = next_manifest(RoutesManifest(model="m"), {"production": 1}, {1: route(1)}, {}, trigger="a", now="t1",
                           history_limit=10)
    refused = next_manifest(served, {"production": 2}, {}, {2: "bad rank"}, trigger="a", now="t2", history_limit=10)
    guarded = next_manifest(served, {"production": 2}, {}, {}, trigger="a", now="t2", history_limit=10,
                            held={"production": ("guardrail", "v2 does not beat v1")})
    assert guarded.aliases["production"].version == 1 and guarded.refused["production"].kind == "guardrail"
    cases = [
        ({"production": 2}, guarded, True),  # a guardrail refusal is re-checked each pass (rlops.force may be set)
        ({"production": 1}, served, False),
        ({"production": 2}, served, True),  # alias moved
        ({"production": 1, "staging": 1}, served, True),  # alias added
        ({}, served, True),  # alias deleted: the route must go
        ({}, RoutesManifest(model="m"), False),  # nothing intended, nothing published
        ({"production": 1}, RoutesManifest(model="m"), True),  # manifest missing
        ({"production": 2}, refused, False),  # the refusal of v2 is sticky: no retry each pass
        ({"production": 3}, refused, True),  # moved again: a new attempt
        ({"production": 1}, refused, True),  # moved back: the stale refusal record goes
    ]
    for intent, manifest, expected in cases:
        assert needs_sync(intent, manifest) is expected, (intent, manifest.aliases, manifest.refused)
        if not expected:  # the same judgement as the sync's own planning
            assert next_manifest(manifest, intent, {}, {2: "bad rank"}, trigger="b", now="t3", history_limit=10) is manifest


def test_rollback_target_and_drift():
    m = RoutesManifest(model="m")
    m = next_manifest(m, {"production": 1}, {1: route(1)}, {}, trigger="a", now="t1", history_limit=10)
    assert rollback_target(m, "production") is None
    m = next_manifest(m, {"production": 2}, {2: route(2)}, {}, trigger="a", now="t2", history_limit=10)
    assert rollback_target(m, "production") == 1
    m = next_manifest(m, {"production": 1}, {1: route(1)}, {}, trigger="rollback", now="t3", history_limit=10)
    assert rollback_target(m, "production") == 2
    assert drift({"production": 1}, m) == []
    assert [d.describe() for d in drift({"production": 4, "staging": 2}, m)] == [
        "production: registry v4, served v1", "staging: registry v2, served nothing"]


def test_adapter_checks():
    check_files({"adapter_config.json": 1, "adapter_model.safetensors": 2},
                {"adapter_config.json": "a" * 64, "adapter_model.safetensors": "b" * 64})
    with pytest.raises(InvalidAdapter, match="no recorded sha256"):
        check_files({"adapter_config.json": 1, "adapter_model.safetensors": 2}, {"adapter_config.json": "a" * 64})
    with pytest.raises(InvalidAdapter, match="missing adapter files: adapter_model.safetensors"):
        check_files({"adapter_config.json": 1}, {"adapter_config.json": "a" * 64})
    with pytest.raises(InvalidAdapter, match="other than .safetensors/.json.*sub/x.json"):
        check_files({"sub/x.json": 1}, {})
    assert check_adapter_config(CONFIG, POLICY) == 8
    assert check_adapter_config({**CONFIG, "base_model_name_or_path": None}, POLICY, base_model_tag="/models/base") == 8
    for bad, reason in [({"r": 64}, "rank 64"), ({"rank_pattern": {"q": 40}}, "rank 40"), ({"peft_type": "IA3"}, "not a LoRA"),
                        ({"target_modules": "all-linear"}, "explicit list"), ({"target_modules": ["lm_head"]}, "lm_head"),
                        ({"base_model_name_or_path": "x"}, "not the served base"), ({"modules_to_save": ["e"]}, "modules_to_save")]:
        with pytest.raises(InvalidAdapter, match=reason):
            check_adapter_config({**CONFIG, **bad}, POLICY)
    assert copy_order(["adapter_config.json", "b.json", "adapter_model.safetensors"])[-1] == "adapter_config.json"


def test_an_adapter_trained_on_another_machine_is_served_by_its_portable_base_and_same_weights():
    """A run trained elsewhere (the offline GPU run) records that machine's base path in adapter_config.json
    and the portable id plus content digest in its tags: the tag names the served base, the digests must match."""
    served = AdapterPolicy(max_rank=32, base_models=frozenset({"/here/models/base", "visgym-qwen3vl"}),
                           target_modules=frozenset({"q_proj", "v_proj"}), base_sha256="a" * 64)
    elsewhere = {**CONFIG, "base_model_name_or_path": "/tmp/gpu-data/models/base"}
    assert check_adapter_config(elsewhere, served, base_model_tag="visgym-qwen3vl", base_sha256="a" * 64) == 8
    assert check_adapter_config(elsewhere, served, base_model_tag="visgym-qwen3vl") == 8  # no digest recorded
    with pytest.raises(InvalidAdapter, match=r"other base weights than the served ones \(content sha256 bbbbbbbbbbbb"):
        check_adapter_config(elsewhere, served, base_model_tag="visgym-qwen3vl", base_sha256="b" * 64)
    with pytest.raises(InvalidAdapter, match="'another-base' is not the served base"):
        check_adapter_config(elsewhere, served, base_model_tag="another-base")
    with pytest.raises(InvalidAdapter, match="'meta-llama/Llama-3-8B' is not the served base"):  # an id is an id
        check_adapter_config({**CONFIG, "base_model_name_or_path": "meta-llama/Llama-3-8B"}, served,
                             base_model_tag="visgym-qwen3vl")


def test_safetensors_header_checks():
    header = json.dumps({"a.lora_A.weight": {"shape": [8, 32], "dtype": "F32"},
                         "a.lora_B.weight": {"shape": [32, 8], "dtype": "BF16"},
                         "__metadata__": {"format": "pt"}}).encode()
    assert safetensors_header_length(struct.pack("<Q", len(header))) == len(header)
    check_safetensors_header(header, 8, POLICY)
    with pytest.raises(InvalidAdapter, match="above the declared rank"):
        check_safetensors_header(header, 4, POLICY)
    with pytest.raises(InvalidAdapter, match="non-LoRA tensor"):
        check_safetensors_header(json.dumps({"model.embed.weight": {"shape": [4, 4], "dtype": "F32"}}).encode(), 8, POLICY)
    with pytest.raises(InvalidAdapter, match="'a.lora_A.weight' is F64; the engine loads LoRA weights in BF16, F16, F32"):
        check_safetensors_header(json.dumps({"a.lora_A.weight": {"shape": [8, 32], "dtype": "F64"}}).encode(), 8, POLICY)


def test_vision_tower_weights_need_tower_lora_in_the_engine():
    tensors = {f"base_model.model.model.visual.{module}.lora_{ab}.weight": {"shape": [8, 8], "dtype": "F32"}
               for module in ("blocks.0.attn.qkv", "blocks.1.attn.qkv", "merger.linear_fc1") for ab in "AB"}
    tensors["base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"] = {"shape": [8, 8], "dtype": "F32"}
    header = json.dumps(tensors).encode()
    with pytest.raises(InvalidAdapter, match=r"vision tower/connector \(visual\.blocks\.\*\.attn\.qkv, "
                                             r"visual\.merger\.linear_fc1\) .*enable_tower_connector_lora"):
        check_safetensors_header(header, 8, POLICY)
    check_safetensors_header(header, 8, AdapterPolicy(POLICY.max_rank, POLICY.base_models, POLICY.target_modules,
                                                      tower_connector_lora=True))
    with pytest.raises(InvalidAdapter, match="not a safetensors"):
        safetensors_header_length(struct.pack("<Q", 1 << 40))


def test_webhook_authentication_window_and_dedup():
    body = json.dumps({"entity": "model_version_alias", "action": "created", "data": {"name": "m", "version": "9"}}).encode()
    headers = {"x-mlflow-delivery-id": "d1", "x-mlflow-timestamp": "1000", "x-mlflow-signature": sign("s", "d1", "1000", body)}
    assert authenticate(headers, body, "s", now=1100, tolerance_s=300) == "d1"
    for hdrs, now, secret, reason in [({**headers, "x-mlflow-signature": "v1,AAAA"}, 1100, "s", "bad signature"),
                                      (headers, 1400.5, "s", "outside"), (headers, 1100, "other", "bad signature"),
                                      ({}, 1100, "s", "missing"),
                                      ({**headers, "x-mlflow-signature": "v1,\u00e9\u00e8=="}, 1100, "s", "bad signature")]:
        with pytest.raises(Rejected, match=reason) as err:
            authenticate(hdrs, body, secret, now=now, tolerance_s=300)
        assert err.value.status == 401
    delivery = parse_delivery("d1", body)
    assert (delivery.event, delivery.model) == ("model_version_alias.created", "m")
    with pytest.raises(Rejected, match="not an MLflow webhook payload"):
        parse_delivery("d1", b"[1]")
    seen = SeenDeliveries(window_s=10)
    assert seen.first_time("d1", now=0) and not seen.first_time("d1", now=5)
    assert seen.first_time("d1", now=100)  # forgotten after the window (stale deliveries are rejected anyway)


def test_reconciler_errors_are_masked_and_bounded_for_healthz():
    from registry_hooks.service import ERROR_TEXT_LIMIT, Metrics, Reconciler
    from rlops.config import Config

    config = Config.model_validate({"hooks": {"secret": "whsec-topsecret"}, "registry": {"models": ["m"]}})

    def failing_sync(*args, **kwargs):
        raise RuntimeError("cannot reach postgresql://mlflow:db-pass@db:5432/mlflow (signed with whsec-topsecret) "
                           + "x" * 2000)

    reconciler = Reconciler(config, Metrics(), sync=failing_sync)
    reconciler._run("m", "webhook")
    error = reconciler.health()["last_error"]
    assert error.startswith("m: RuntimeError: cannot reach postgresql://mlflow:****@db:5432/mlflow")
    assert "db-pass" not in error and "whsec-topsecret" not in error and len(error) <= ERROR_TEXT_LIMIT


def test_guardrail_direction_margin_and_eval_set():
    from types import SimpleNamespace

    from registry_hooks.plan import guardrail_refusal

    def facts(version, value, key="eval/maze_2d/easy/avg_score", eval_set=None):
        return SimpleNamespace(version=version, metric_key=key, metric_value=value, eval_set=eval_set)

    higher = {"direction": "higher", "min_delta": 0.0}
    assert guardrail_refusal(facts(2, 0.5), None, **higher) is None  # nothing served yet
    assert guardrail_refusal(facts(2, 0.5), facts(1, 0.5), **higher) is None
    assert "does not beat" in guardrail_refusal(facts(2, 0.4), facts(1, 0.5), **higher)
    assert guardrail_refusal(facts(2, 0.4), facts(1, 0.5), direction="lower", min_delta=0.0) is None
    assert "by 0.05" in guardrail_refusal(facts(2, 0.52), facts(1, 0.5), direction="higher", min_delta=0.05)
    assert guardrail_refusal(facts(2, 0.48), facts(1, 0.5), direction="higher", min_delta=-0.05) is None
    assert "no eval metric comparable" in guardrail_refusal(facts(2, 0.9, key="eval/other/avg_score"), facts(1, 0.5), **higher)
    assert "no eval metric comparable" in guardrail_refusal(facts(2, None), facts(1, 0.5), **higher)
    assert "different eval sets" in guardrail_refusal(facts(2, 0.9, eval_set="a" * 64), facts(1, 0.5, eval_set="b" * 64),
                                                      **higher)
