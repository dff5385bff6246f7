"""Copy paths and Ray compatibility: streaming between two S3 servers with different credentials, the
MLflow-proxy path, and Ray Serve LLM's own adapter helpers reading the folders promotion writes."""
from __future__ import annotations

import asyncio
import hashlib
import json

import boto3
import pytest
from botocore.exceptions import ClientError

from registry_hooks.sync import sync_model
from rlops import stack as rlops_stack
from rlops.config import load_config, s3_credentials, s3_environment
from rlops.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, RoutesManifest, parse_s3_uri, routes_key, version_folder

from conftest import write_config
from rlops.stack import free_s3_port
from test_promotion_support import (  # noqa: F401 - fixtures
    assert_manifest_consistent,
    lora_template,
    register_version,
    write_adapter,
)


@pytest.fixture
def other_s3(tmp_path, monkeypatch):
    """A second real SeaweedFS with its own generated credentials (no MLflow)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    path = write_config(tmp_path / "other.yaml", {
        "data_dir": str(tmp_path / "other"), "server": {"managed": False},
        "storage": {"endpoint_url": f"http://127.0.0.1:{free_s3_port()}", "bucket": "rlops-other"}})
    config = load_config(path, environ={})
    rlops_stack.up(config, timeout_s=60)
    yield config
    rlops_stack.down(config)


def test_streaming_copy_between_servers_with_different_credentials(stack, test_config, mlflow_client, other_s3,
                                                                   lora_template, tmp_path, monkeypatch):
    model = test_config.registry.models[0]
    adapter = write_adapter(lora_template, tmp_path / "a1", test_config, seed=1, padding_mb=20)  # > 2 parts
    v1 = register_version(test_config, adapter)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    # Serving S3 = the other server; MLflow's artifacts stay on the session's server, with its own keys.
    cfg = test_config.model_copy(deep=True)
    cfg.data_dir = other_s3.data_dir
    cfg.storage = other_s3.storage.model_copy()
    cfg.serving.model_source = test_config.base_model_source
    cfg.serving.dynamic_lora_loading_path = "s3://rlops-other/lora"
    cfg.server.artifacts_destination = test_config.artifacts_destination
    cfg.registry.artifacts_endpoint_url = test_config.storage.endpoint_url
    session_key, session_secret = s3_credentials(test_config)
    monkeypatch.setenv("ARTIFACTS_AWS_ACCESS_KEY_ID", session_key)
    monkeypatch.setenv("ARTIFACTS_AWS_SECRET_ACCESS_KEY", session_secret)
    other_key, _ = s3_credentials(cfg, environ={})
    assert other_key != session_key
    with pytest.raises(ClientError):  # the session's keys really are no good on the other server
        boto3.client("s3", endpoint_url=cfg.storage.endpoint_url, region_name="us-east-1",
                     aws_access_key_id=session_key, aws_secret_access_key=session_secret).list_objects_v2(Bucket="rlops-other")

    report = sync_model(cfg, model, trigger="test")

    assert report.copy_mode == "streaming" and report.served == {"production": v1}
    assert report.bytes_copied == sum(p.stat().st_size for p in adapter.iterdir())
    dest = rlops_stack.s3_client(cfg, timeout_s=10)
    location = parse_s3_uri(cfg.lora_path)
    manifest = RoutesManifest.model_validate_json(
        dest.get_object(Bucket=location.bucket, Key=routes_key(location, model))["Body"].read())
    route = manifest.aliases["production"]
    for name, digest in route.files.items():
        body = dest.get_object(Bucket=location.bucket, Key=location.key(route.folder, name))["Body"].read()
        assert hashlib.sha256(body).hexdigest() == digest == hashlib.sha256((adapter / name).read_bytes()).hexdigest()


def test_proxy_copy_through_mlflow(stack, test_config, mlflow_client, lora_template, tmp_path):
    model = test_config.registry.models[0]
    v1 = register_version(test_config, write_adapter(lora_template, tmp_path / "a1", test_config, seed=3))
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    test_config.registry.copy_mode = "proxy"
    report = sync_model(test_config, model, trigger="test")
    assert report.copy_mode == "proxy" and report.served == {"production": v1}
    assert_manifest_consistent(stack, test_config)


def test_ray_serve_llm_helpers_read_promoted_folders(stack, test_config, mlflow_client, lora_template, tmp_path,
                                                     monkeypatch):
    from peft import LoraConfig
    from ray.llm._internal.common.utils.cloud_utils import LoraMirrorConfig
    from ray.llm._internal.common.utils.lora_utils import get_lora_model_ids
    from ray.llm._internal.serve.utils.lora_serve_utils import LoraModelLoader, get_lora_model_metadata

    for key, value in s3_environment(test_config).items():
        monkeypatch.setenv(key, value)
    model = test_config.registry.models[0]
    adapter = write_adapter(lora_template, tmp_path / "a1", test_config, seed=4)
    v1 = register_version(test_config, adapter)
    mlflow_client.set_registered_model_alias(model, "production", str(v1))
    sync_model(test_config, model, trigger="test")
    base, folder = test_config.serving.base_model_id, version_folder(model, v1)

    listed = get_lora_model_ids(dynamic_lora_loading_path=test_config.lora_path, base_model_id=base)
    assert f"{base}:{folder}" in listed
    metadata = asyncio.run(get_lora_model_metadata(f"{base}:{folder}", test_config.lora_path))
    assert metadata["bucket_uri"] == f"{test_config.lora_path}/{folder}"
    loader = LoraModelLoader(lora_root=str(tmp_path / "ray-cache"), download_timeout_s=30)
    mirror = LoraMirrorConfig(lora_model_id=f"{base}:{folder}", bucket_uri=metadata["bucket_uri"],
                              max_total_tokens=metadata["max_request_context_length"])
    disk = asyncio.run(loader.load_model(f"{base}:{folder}", mirror))
    local = tmp_path / "ray-cache" / folder
    assert disk.local_path == str(local)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        assert (local / name).read_bytes() == (adapter / name).read_bytes()
    lora = LoraConfig.from_pretrained(str(local))
    assert lora.r == 8 and lora.base_model_name_or_path == test_config.base_model_source
    # The routes manifest folder is listed as a subfolder but has no adapter_config.json, so Ray's
    # metadata check (what /v1/models and loading use) never takes it for an adapter.
    routes_config = f"{test_config.lora_path}/_routes/{ADAPTER_CONFIG}"
    s3 = stack.s3()
    location = parse_s3_uri(routes_config)
    with pytest.raises(ClientError):
        s3.head_object(Bucket=location.bucket, Key=location.prefix)
    assert json.loads((local / ADAPTER_CONFIG).read_text())["peft_type"] == "LORA"
