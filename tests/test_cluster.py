"""The cluster path (docker/), checked offline: Dockerfile lint, every manifest against the Kubernetes
schemas (kubernetes-validate) and the KubeRay CRD schemas checked into docker/schemas/, the compose file
against the Compose spec, the RayService's serveConfigV2 against `rlops serve --print-config` and Ray's
own validation, and secrets as references only.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rlops.config import is_secret_key, load_config, mask_value

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
K8S = DOCKER / "k8s"
SCHEMAS = DOCKER / "schemas"
BIN = Path(sys.executable).parent
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
KUBERAY_CRDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml"}
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB each


def _manifest_files() -> list[Path]:
    return sorted([*K8S.glob("*.yaml"), *(K8S / "templates").glob("*.yaml")])


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=_Loader) if doc]


def _render_module():
    spec = importlib.util.spec_from_file_location("render_manifests", DOCKER / "render_manifests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- Dockerfiles


def test_all_three_images_exist():
    assert [p.name for p in DOCKERFILES] == ["mlflow.Dockerfile", "serve.Dockerfile", "train.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile: Path):
    out = subprocess.run([str(BIN / "hadolint"), "--no-color", "--failure-threshold", "style", str(dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints" / "cpu.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def test_images_follow_the_pin_set():
    """Each image's versions are the pin set's: the serving image's Ray, mlflow, psycopg, boto3, skyrl."""
    pins = _pins()
    texts = {p.name: p.read_text() for p in DOCKERFILES}
    serve_from = re.search(r"^FROM rayproject/ray-llm:(\S+)-py\d+-cu\d+$", texts["serve.Dockerfile"], re.M)
    assert serve_from and serve_from.group(1) == pins["ray"], "ray-llm tag must match the ray pin"
    pinned = re.compile(r'"?([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^"\s]+)"?')
    checked = 0
    for name, text in texts.items():
        instructions = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        for package, version in pinned.findall(instructions):
            if package.lower() in pins:
                assert version == pins[package.lower()], f"{name}: {package}=={version}, pin set has {pins[package.lower()]}"
                checked += 1
    assert checked >= 6
    assert "mlflow[auth]==" in texts["mlflow.Dockerfile"] and "psycopg[binary]==" in texts["mlflow.Dockerfile"]
    assert '"/tmp/rlops[skyrl]"' in texts["train.Dockerfile"]
    # SkyRL's trainer pins its Ray: the training image's base must carry the same one.
    skyrl_ray = re.search(r"skyrl-train-ray-([\d.]+)-", texts["train.Dockerfile"]).group(1)
    meta = Path(importlib.util.find_spec("skyrl").origin).parents[1] / f"skyrl-{pins['skyrl']}.dist-info" / "METADATA"
    assert f'ray=={skyrl_ray}; extra == "skyrl-train"' in meta.read_text()


def test_skyrl_extra_agrees_with_skyrl_train_pins():
    """The training image installs skyrl[skyrl-train] and our `skyrl` extra side by side: same exact pins."""
    import tomllib
    from importlib.metadata import requires

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["skyrl"]
    ours = dict(r.split("==", 1) for r in extra if "==" in r)
    theirs = {}
    for requirement in requires("skyrl") or []:
        spec, _, marker = requirement.partition(";")
        if 'extra == "skyrl-train"' in marker and "==" in spec:
            name, version = spec.split("==", 1)
            theirs[name.strip()] = version.strip()
    shared = set(ours) & set(theirs)
    assert shared, "no common pins: the comparison would be empty"
    assert {n: ours[n] for n in shared} == {n: theirs[n] for n in shared}


# ------------------------------------------------------------------------------------- schema validation


def _strict(schema: Any) -> Any:
    """CRD schemas leave additionalProperties open (the API server prunes unknown fields silently); close
    every object that lists its properties, so a misspelled field fails here instead of vanishing there."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def kuberay_validators() -> dict[str, jsonschema.Validator]:
    validators = {}
    for kind, filename in KUBERAY_CRDS.items():
        crd = yaml.load((SCHEMAS / "kuberay-v1.7.0" / filename).read_text(), Loader=_Loader)
        assert crd["spec"]["names"]["kind"] == kind
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        validators[kind] = jsonschema.Draft4Validator(_strict(version["schema"]["openAPIV3Schema"]))
    return validators


def _validate(doc: dict[str, Any], kuberay_validators) -> list[str]:
    if doc["apiVersion"] == "ray.io/v1":
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in kuberay_validators[doc["kind"]].iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'/'.join(map(str, exc.path))}: {exc.message}"]
    return []


def test_manifest_set_is_complete():
    kinds = {(d["kind"], d["metadata"]["name"]) for p in K8S.glob("*.yaml") for d in _documents(p)}
    assert {("RayCluster", "rlops-train"), ("RayService", "rlops-serve"), ("Deployment", "mlflow"),
            ("Service", "mlflow"), ("Deployment", "promotion-hooks"), ("ConfigMap", "rlops-config")} <= kinds


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_schemas(path: Path, kuberay_validators):
    docs = _documents(path)
    assert docs
    for doc in docs:
        errors = _validate(doc, kuberay_validators)
        assert not errors, f"{path.name} {doc['kind']}/{doc['metadata']['name']}:\n  " + "\n  ".join(errors)


def test_validators_reject_a_misspelled_field(kuberay_validators):
    rayservice = _documents(K8S / "rayservice.yaml")[0]
    bad = copy.deepcopy(rayservice)
    bad["spec"]["serveConfigV3"] = bad["spec"].pop("serveConfigV2")
    assert _validate(bad, kuberay_validators)
    bad = copy.deepcopy(rayservice)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagee"] = "x"
    assert _validate(bad, kuberay_validators)
    deployment = next(d for d in _documents(K8S / "mlflow.yaml") if d["kind"] == "Deployment")
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["nmae"] = "x"
    assert _validate(bad, kuberay_validators)


def test_compose_file_validates_against_the_compose_spec():
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(compose)
    assert {"postgres", "s3", "mlflow"} <= set(compose["services"])
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (DOCKER / source).exists(), f"compose mounts missing {source}"


def test_compose_bucket_job_creates_the_bucket(stack, unique_name):
    """The compose file's one-shot bucket job, run as written against the session's real S3 server."""
    job = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["bucket"]
    assert job["entrypoint"] == ["python", "-c"]
    bucket = f"compose-{unique_name}"[:63]
    env = dict(stack.env, BUCKET=bucket)
    for _ in range(2):  # idempotent: a second run finds the bucket and succeeds
        out = subprocess.run([sys.executable, "-c", job["command"][0]], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
    assert bucket in [b["Name"] for b in stack.s3().list_buckets()["Buckets"]]
    stack.s3().delete_bucket(Bucket=bucket)


# --------------------------------------------------------------------------------- RayService vs the CLI


@pytest.fixture(scope="module")
def printed_config() -> dict[str, Any]:
    """What `rlops serve --print-config` prints today for the cluster's mlflow.yaml (the ConfigMap)."""
    return _render_module().print_config()


def _rayservice() -> dict[str, Any]:
    return _documents(K8S / "rayservice.yaml")[0]


def test_rayservice_serve_config_equals_print_config(printed_config):
    rayservice = _rayservice()
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == printed_config["serveConfigV2"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            for ref in printed_config["podEnv"]:
                assert ref in container["env"], f"{container['name']} lacks {ref['name']}"
    out = subprocess.run([sys.executable, str(DOCKER / "render_manifests.py"), "--check"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr


def test_serve_config_round_trips_through_ray_validation(printed_config):
    from ray.llm._internal.serve.core.ingress.builder import LLMServingArgs
    from ray.serve.llm import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    from serving.feedback import FeedbackSettings

    serve_config = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])
    deploy = ServeDeploySchema.model_validate(serve_config)  # what the Ray dashboard checks on apply
    assert [(app.import_path, app.route_prefix) for app in deploy.applications] == [
        ("ray.serve.llm:build_openai_app", "/"), ("serving.feedback:build", "/v1/feedback")]
    feedback = FeedbackSettings.model_validate(serve_config["applications"][1]["args"]["settings"])  # what its replica checks
    assert feedback.models == ["maze-grpo"] and feedback.api_keys_env == "RLOPS_API_KEYS"
    raw_args = serve_config["applications"][0]["args"]
    args = LLMServingArgs.model_validate(raw_args)  # what build_openai_app checks
    assert args.ingress_cls_config.ingress_cls.__name__ == "AliasIngress"
    assert len(args.llm_configs) == len(raw_args["llm_configs"]) == 1
    for raw in raw_args["llm_configs"]:
        validated = LLMConfig.model_validate(raw)
        assert validated.server_cls.__name__ == "PreloadingLLMServer"  # Ray imports the path to the class
        dumped = validated.model_dump(exclude_unset=True)
        rest = {k: v for k, v in raw.items() if k != "server_cls"}
        assert _is_subset(rest, dumped), f"LLMConfig validation changed the config:\n{raw}\n{dumped}"
        assert LLMConfig.model_validate(dumped).model_dump(exclude_unset=True) == dumped
        assert validated.lora_config.dynamic_lora_loading_path.startswith("s3://")
        assert validated.engine_kwargs["enable_lora"] is True


def _is_subset(part: Any, whole: Any) -> bool:
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and _is_subset(v, whole[k]) for k, v in part.items())
    return part == whole


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield from node["containers"]
        for v in node.values():
            yield from _containers(v)
    elif isinstance(node, list):
        for v in node:
            yield from _containers(v)


def test_manifest_commands_are_real_cli_commands():
    """A container that runs `rlops ...` names a command the installed CLI has (e.g. `rlops hooks serve`)."""
    commands = [c["command"] for p in K8S.glob("*.yaml") for d in _documents(p) for c in _containers(d)
                if c.get("command", [None])[0] == "rlops"]
    assert ["rlops", "hooks", "serve"] in commands
    for command in commands:
        out = subprocess.run([str(BIN / "rlops"), *command[1:], "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{' '.join(command)}: {out.stderr}"


def test_cluster_config_is_valid_and_external(tmp_path):
    config = load_config(_cluster_config_file(tmp_path), environ={})
    assert not config.server.managed and not config.storage.managed
    assert config.tracking_uri == "http://mlflow.rlops.svc:5000"
    assert config.lora_path.startswith("s3://") and config.serving.accelerator == "gpu"


def _cluster_config_file(directory: Path) -> Path:
    """The ConfigMap's mlflow.yaml as a file, as the pods see it at /etc/rlops/mlflow.yaml."""
    path = directory / "mlflow.yaml"
    path.write_text(yaml.safe_load((K8S / "config.yaml").read_text())["data"]["mlflow.yaml"])
    return path


def test_guide_shows_the_exact_ray_job_submit_of_the_cluster_config(tmp_path):
    """The `ray job submit` in docs/deployment.md carries what train_job.sh submits for the ConfigMap's
    config on the shared volume (`python -m training.skyrl_main --print-overrides`), override by override."""
    guide = (REPO / "docs" / "deployment.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", guide, re.S) if b.startswith("ray job submit"))
    words = shlex.split(block.replace("\\\n", " "))
    documented = words[words.index("training.skyrl_main") + 1:]
    raycluster = _documents(K8S / "raycluster-train.yaml")[0]
    head = raycluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    pod_env = {e["name"]: e["value"] for e in head["env"] if "value" in e}
    env = {"PATH": os.environ["PATH"], "RLOPS_CONFIG": str(_cluster_config_file(tmp_path)), "RLOPS_DATA_DIR": pod_env["RLOPS_DATA_DIR"]}
    out = subprocess.run([sys.executable, "-m", "training.skyrl_main", "--print-overrides"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert documented == out.stdout.split()
    assert (REPO / "training" / "train_job.sh").exists()
    assert "COPY --chown=ray:users training/train_job.sh /opt/rlops/training/train_job.sh" in (
        DOCKER / "train.Dockerfile").read_text()


# ---------------------------------------------------------------------------------- secrets as references


def _secret_named(name: str) -> bool:
    return is_secret_key(name) and not name.endswith("_PATH")


def _walk_strings(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk_strings(v, str(k))
    elif isinstance(node, list):
        for v in node:
            yield from _walk_strings(v, key)
    elif isinstance(node, str):
        yield key, node


def _k8s_secret_problems(doc: dict[str, Any]) -> list[str]:
    problems = []
    if doc.get("kind") == "Secret":
        problems.append(f"Secret/{doc['metadata']['name']} carries values: ship references only")
    for _, value in _walk_strings(doc):
        if mask_value("value", value) != value:
            problems.append(f"credential-looking value {value[:12]}...")
    for key, value in _walk_strings(doc):
        if key == "serveConfigV2":
            problems += [f"serveConfigV2: {p}" for p in _k8s_secret_problems(yaml.safe_load(value))]
            for env_name in _walk_env_var_names(yaml.safe_load(value)):
                if _secret_named(env_name):
                    problems.append(f"serveConfigV2 runtime_env sets {env_name}: use the pod env secretKeyRef")
    for env in _env_lists(doc):
        for var in env:
            if _secret_named(var["name"]) and ("value" in var or "secretKeyRef" not in var.get("valueFrom", {})):
                problems.append(f"env {var['name']} must come from a secretKeyRef")
    return problems


def _walk_env_var_names(serve_config: dict[str, Any]) -> Iterator[str]:
    for app in serve_config.get("applications", []):
        yield from app.get("runtime_env", {}).get("env_vars", {})


def _env_lists(node: Any) -> Iterator[list[dict[str, Any]]]:
    if isinstance(node, dict):
        if isinstance(node.get("env"), list) and "name" in node:
            yield node["env"]
        for v in node.values():
            yield from _env_lists(v)
    elif isinstance(node, list):
        for v in node:
            yield from _env_lists(v)


def _compose_secret_problems(compose: dict[str, Any]) -> list[str]:
    problems = []
    for name, service in compose["services"].items():
        for var, value in (service.get("environment") or {}).items():
            value = str(value)
            if _secret_named(var) and not re.fullmatch(r"\$\{[A-Z_][A-Z0-9_]*(:\?[^}]*)?\}", value):
                problems.append(f"{name}: {var} must be a ${{VAR}} reference to the caller's environment")
            if mask_value("value", value) != value:
                problems.append(f"{name}: {var} holds a credential-looking value")
    return problems


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifests_carry_secret_references_not_values(path: Path):
    for doc in _documents(path):
        assert not _k8s_secret_problems(doc), _k8s_secret_problems(doc)


def test_compose_and_auth_config_carry_no_secret_values():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert not _compose_secret_problems(compose)
    for line in (DOCKER / "compose-auth.ini").read_text().splitlines():
        assert mask_value("value", line.split("=", 1)[-1].strip()) == line.split("=", 1)[-1].strip()
        assert not line.lower().startswith("admin_password")


def test_secret_checks_catch_leaks():
    """The checks above are not vacuous: literal secrets in each place they could hide are flagged."""
    deployment = next(d for d in _documents(K8S / "mlflow.yaml") if d["kind"] == "Deployment")
    leaky = copy.deepcopy(deployment)
    env = leaky["spec"]["template"]["spec"]["containers"][0]["env"]
    env.append({"name": "AWS_SECRET_ACCESS_KEY", "value": "literal"})
    env.append({"name": "MLFLOW_BACKEND_STORE_URI", "value": "postgresql://mlflow:hunter2@db/mlflow"})
    problems = _k8s_secret_problems(leaky)
    assert any("AWS_SECRET_ACCESS_KEY" in p for p in problems) and any("credential-looking" in p for p in problems)
    rayservice = _rayservice()
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    serve_config["applications"][0]["runtime_env"]["env_vars"]["AWS_SECRET_ACCESS_KEY"] = "x"
    rayservice["spec"]["serveConfigV2"] = yaml.safe_dump(serve_config)
    assert _k8s_secret_problems(rayservice)
    assert _k8s_secret_problems({"kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}})
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    compose["services"]["mlflow"]["environment"]["PGPASSWORD"] = "hunter2"
    assert _compose_secret_problems(compose)


# ------------------------------------------------------------------- the local cluster vs the manifests


def _config_keys(model, prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
            keys |= _config_keys(field.annotation, f"{prefix}{name}.")
    return keys


def _head_container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def test_local_cluster_keys_map_onto_the_manifests(tmp_path):
    """docs/deployment.md's table of `ray.*`/`serving.*` keys names real config keys, and the rows that are
    values in both places agree: the ConfigMap's config against the RayCluster, the RayService and its
    rendered serveConfigV2."""
    from rlops.config import Config

    guide = (REPO / "docs" / "deployment.md").read_text()
    table = guide[guide.index("| config key |"):].split("\n\n", 1)[0]
    documented = {key for row in table.splitlines()[2:] for key in re.findall(r"`((?:ray|serving)\.[a-z_]+)`",
                                                                               row.split("|")[1])}
    assert {"ray.nodes", "ray.port", "ray.dashboard_port", "ray.job_stop_wait_s", "serving.min_replicas",
            "serving.max_replicas", "serving.ingress_replicas"} <= documented
    assert documented <= _config_keys(Config), documented - _config_keys(Config)

    config = load_config(_cluster_config_file(tmp_path), environ={})
    assert config.ray.nodes == 0  # KubeRay runs the cluster: nothing for `rlops up` to start in a pod
    train = _documents(K8S / "raycluster-train.yaml")[0]["spec"]
    service = _rayservice()["spec"]
    for head in (_head_container(train["headGroupSpec"]), _head_container(service["rayClusterConfig"]["headGroupSpec"])):
        ports = {p["name"]: p["containerPort"] for p in head["ports"]}
        assert (ports["gcs"], ports["dashboard"]) == (config.ray.port, config.ray.dashboard_port)
    train_env = {e["name"]: e.get("value") for e in _head_container(train["headGroupSpec"])["env"]}
    assert train_env["RAY_JOB_STOP_WAIT_TIME_S"] == str(config.ray.job_stop_wait_s)

    args = yaml.safe_load(service["serveConfigV2"])["applications"][0]["args"]
    llm_scaling = args["llm_configs"][0]["deployment_config"]["autoscaling_config"]
    assert (llm_scaling["min_replicas"], llm_scaling["max_replicas"]) == (config.serving.min_replicas,
                                                                          config.serving.max_replicas)
    ingress_scaling = args["ingress_deployment_config"]["autoscaling_config"]
    assert ingress_scaling == {"min_replicas": config.serving.ingress_replicas,
                               "max_replicas": config.serving.ingress_replicas}
    [gpu] = service["rayClusterConfig"]["workerGroupSpecs"]
    assert gpu["maxReplicas"] >= config.serving.max_replicas  # one GPU worker per vLLM replica
    llm = args["llm_configs"][0]
    assert config.serving.preload_adapters == ("rlops_preload" in llm.get("experimental_configs", {}))
    assert llm["server_cls"] == "serving.preload:PreloadingLLMServer"
