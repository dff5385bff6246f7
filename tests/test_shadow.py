"""Shadow intent on the real stack (MLflow registry + S3): start, reshare, stop, with the manifest, the registry
and the history agreeing at each step."""
from __future__ import annotations

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
