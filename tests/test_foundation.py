"""Foundation: config loading and overrides, the embedded stack, `rlops up/down/status`."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import mlflow
import psutil
import pytest
from botocore.exceptions import ClientError

from rlops.config import ConfigError, load_config, mask_value
from rlops import processes
from rlops.layout import parse_s3_uri

from conftest import write_config
from rlops.stack import free_s3_port

RLOPS = [sys.executable, "-m", "rlops.cli"]


def run_cli(args, env, timeout=120):
    return subprocess.run([*RLOPS, *args], env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------------ config


def test_defaults_load_without_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ={})
    assert cfg.tracking_uri == "http://127.0.0.1:5000"
    assert cfg.lora_path == "s3://rlops/lora"
    assert cfg.registry.served_aliases == ["production", "staging"]


def test_repo_config_file_is_valid():
    cfg = load_config(Path(__file__).parents[1] / "mlflow.yaml", environ={})
    assert cfg.serving.base_model_id == "visgym-qwen3vl"
    assert cfg.training.lora_rank == 32


def test_unknown_key_names_key_and_file(tmp_path):
    path = write_config(tmp_path / "mlflow.yaml", {"serving": {"prot": 8000}})
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert str(path) in str(err.value) and "serving.prot" in str(err.value) and "unknown key" in str(err.value)


def test_wrong_type_names_key_and_value(tmp_path):
    path = write_config(tmp_path / "mlflow.yaml", {"server": {"port": "eighty"}})
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert "server.port" in str(err.value) and "'eighty'" in str(err.value)
    path = write_config(tmp_path / "mlflow.yaml", {"training": {"local": {"lean_rollouts": "sometimes"}}})
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert "training.local.lean_rollouts" in str(err.value) and "'sometimes'" in str(err.value)


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})


def test_env_overrides_win_and_are_typed(tmp_path):
    path = write_config(tmp_path / "mlflow.yaml", {"serving": {"port": 8000}})
    cfg = load_config(path, environ={"RLOPS_SERVING__PORT": "8123", "RLOPS_REGISTRY__SERVED_ALIASES": "[production]",
                                     "RLOPS_DATA_DIR": str(tmp_path / "d")})
    assert cfg.serving.port == 8123
    assert cfg.registry.served_aliases == ["production"]
    assert cfg.data_path == tmp_path / "d"


def test_env_override_error_names_variable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="environment variable RLOPS_SERVING__PORT: serving.port"):
        load_config(None, environ={"RLOPS_SERVING__PORT": "abc"})
    with pytest.raises(ConfigError, match="serving.bogus: unknown key"):
        load_config(None, environ={"RLOPS_SERVING__BOGUS": "1"})


def test_config_show_masks_secrets(tmp_path):
    path = write_config(tmp_path / "mlflow.yaml", {"data_dir": str(tmp_path / "d")})
    env = dict(os.environ, RLOPS_SERVER__BACKEND_STORE_URI="postgresql://mlflow:hunter2pw@db:5432/mlflow",
               RLOPS_CONFIG=str(path))
    out = run_cli(["config", "show"], env)
    assert out.returncode == 0, out.stderr
    assert "hunter2pw" not in out.stdout and "postgresql://mlflow:****@db:5432/mlflow" in out.stdout
    assert "port: 5000" in out.stdout


def test_mask_value_rules():
    assert mask_value("db_password", "x") == "****"
    assert mask_value("trainer.api_key", "abc") == "****"
    assert mask_value("note", "AKIAABCDEFGHIJKLMNOP") == "****"
    assert mask_value("lr", 0.001) == 0.001
    assert mask_value("uri", "http://u:p@h:1/x") == "http://u:****@h:1/x"


def test_cli_config_error_is_one_clear_message(tmp_path):
    path = write_config(tmp_path / "mlflow.yaml", {"storage": {"bucket": 12}})
    out = run_cli(["up"], dict(os.environ, RLOPS_CONFIG=str(path)))
    assert out.returncode == 1
    assert "storage.bucket" in out.stderr and str(path) in out.stderr and "Traceback" not in out.stderr


HEAVY_MODULES = ("pydantic", "mlflow", "boto3", "httpx", "torch", "transformers", "ray", "serving", "training", "tracker")


def test_cli_help_and_usage_errors_answer_before_heavy_imports():
    """`--help` and a usage error are parsed before MLflow, boto3 or torch load (each took seconds): the two
    console scripts answer in < 0.5 s, the median of three calls so one scheduler hiccup on 2 cores is not it."""
    scripts = Path(sys.executable).parent
    calls = {"rlops --help": [scripts / "rlops", "--help"], "promote --help": [scripts / "promote", "--help"],
             "promote typo": [scripts / "promote", "stauts"], "promote canary": [scripts / "promote", "canary"],
             "rlops train --bogus": [scripts / "rlops", "train", "--bogus"],
             "rlops runs flush": [scripts / "rlops", "runs", "flush"]}
    for label, argv in calls.items():
        seconds = []
        for _ in range(3):
            started = time.monotonic()
            proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)
            seconds.append(time.monotonic() - started)
        assert proc.returncode == (0 if label.endswith("--help") else 2), (label, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert sorted(seconds)[1] < 0.5, f"{label}: {sorted(seconds)} s"
    loaded = subprocess.run([sys.executable, "-c", "import sys, rlops.cli, registry_hooks.cli; "
                             "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert not set(HEAVY_MODULES) & set(loaded), set(HEAVY_MODULES) & set(loaded)


QUIET_PROGRAM = """
import logging, subprocess, sys, warnings
from pathlib import Path
from rlops.terminal import quiet
logging.basicConfig(level=logging.INFO)  # a handler made before: it holds the stream object, not the descriptor
with quiet(Path(sys.argv[1]), verbose=sys.argv[2] == "-v", on_stderr=sys.argv[3] == "stderr") as terminal:
    terminal.line("[1/2] one: done")
    print("a library print")
    logging.getLogger("lib").info("a library log line")
    warnings.warn("a library warning", FutureWarning)
    subprocess.run(["echo", "a child process"], check=True)
    terminal.live("step 1/3")
    terminal.line("[2/2] two: done")
print("after the block")
"""


@pytest.mark.parametrize("verbose,stream", [("quiet", "stdout"), ("quiet", "stderr"), ("-v", "stdout")])
def test_quiet_keeps_our_lines_on_the_terminal_and_the_rest_in_the_log(tmp_path, verbose, stream):
    log = tmp_path / "logs" / "command.log"
    out = subprocess.run([sys.executable, "-c", QUIET_PROGRAM, str(log), verbose, stream], capture_output=True,
                         text=True, check=True)
    ours = out.stderr if stream == "stderr" else out.stdout
    library = ["a library print", "a library log line", "a library warning", "a child process"]
    assert "step 1/3" not in ours  # not a terminal: no live line
    assert out.stdout.endswith("after the block\n")
    if verbose == "-v":
        assert "[1/2] one: done\na library print\n" in ours and "[2/2] two: done\n" in ours
        assert all(line in out.stdout + out.stderr for line in library) and not log.exists()
    else:
        assert ours.startswith("[1/2] one: done\n[2/2] two: done\n")
        assert all(line in log.read_text() for line in library)
        assert not any(line in out.stdout + out.stderr for line in library) and "[1/2]" not in log.read_text()


# ------------------------------------------------------------------------------------------------- stack


def test_mlflow_run_artifacts_land_in_s3(stack, unique_name, tmp_path):
    mlflow.set_tracking_uri(stack.tracking_uri)
    exp = mlflow.set_experiment(f"exp-{unique_name}")
    artifact = tmp_path / "hello.txt"
    artifact.write_text("hello s3")
    with mlflow.start_run(experiment_id=exp.experiment_id) as run:
        mlflow.log_metric("x", 1.0)
        mlflow.log_artifact(str(artifact))
    loc = parse_s3_uri(stack.config.artifacts_destination)
    s3 = stack.s3()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.prefix).get("Contents", [])]
    key = next(k for k in keys if k.endswith(f"{run.info.run_id}/artifacts/hello.txt"))
    assert s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read() == b"hello s3"


def test_s3_rejects_wrong_credentials(stack):
    bad = boto3.client("s3", endpoint_url=stack.config.storage.endpoint_url, region_name="us-east-1",
                       aws_access_key_id="wrong", aws_secret_access_key="wrong-secret")
    with pytest.raises(ClientError) as err:
        bad.list_objects_v2(Bucket=stack.config.storage.bucket)
    assert err.value.response["Error"]["Code"] in ("InvalidAccessKeyId", "AccessDenied", "SignatureDoesNotMatch")


def test_stack_processes_are_loopback_only_and_keep_db_uri_off_command_line(stack):
    mlflow_record = processes.read_record(stack.config.data_path, "mlflow")
    assert mlflow_record is not None
    proc = mlflow_record.process()
    for p in [proc, *proc.children(recursive=True)]:
        assert "--backend-store-uri" not in p.cmdline()
    s3 = processes.read_record(stack.config.data_path, "s3").process()
    listening = [c.laddr.ip for c in s3.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and set(listening) == {"127.0.0.1"}


def test_up_refuses_occupied_port_and_leaves_nothing(tmp_path):
    blocker = processes.free_port()
    import socket

    with socket.create_server(("127.0.0.1", blocker)):
        path = write_config(tmp_path / "mlflow.yaml", {
            "data_dir": str(tmp_path / "d"), "server": {"port": blocker},
            "storage": {"endpoint_url": f"http://127.0.0.1:{free_s3_port()}"},
        })
        out = run_cli(["up"], dict(os.environ, RLOPS_CONFIG=str(path)))
    assert out.returncode == 1
    assert f"port {blocker}" in out.stderr and "server.port" in out.stderr and "already in use" in out.stderr
    assert "nothing left running" in out.stderr
    assert processes.list_records(tmp_path / "d") == []


def test_every_environment_variable_the_code_reads_is_documented():
    """A name read from the environment is a config override (RLOPS_*) or listed in the README's config section."""
    import re

    root = Path(__file__).parents[1]
    read = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\()\s*["']([A-Z][A-Z0-9_]*)["']""")
    names = {name for package in ("rlops", "registry_hooks", "serving", "tracker", "training")
             for path in (root / package).rglob("*.py") for name in read.findall(path.read_text())}
    from rlops.config import ARTIFACTS_CREDENTIAL_ENV
    from training.skyrl_main import FORWARDED_ENV

    names |= set(ARTIFACTS_CREDENTIAL_ENV) | set(FORWARDED_ENV)
    assert "AWS_ACCESS_KEY_ID" in names  # the scan sees reads
    readme = (root / "README.md").read_text()
    section = readme[readme.index("## Configuration"):readme.index("## Tracking")]
    undocumented = sorted(n for n in names if f"`{n}`" not in section)
    assert undocumented == [], f"read from the environment but not documented in README's configuration: {undocumented}"


def test_status_before_up_says_what_is_not_running(tmp_path):
    path = write_config(tmp_path / "mlflow.yaml", {
        "data_dir": str(tmp_path / "fresh"), "server": {"port": processes.free_port()},
        "storage": {"endpoint_url": f"http://127.0.0.1:{free_s3_port()}"},
    })
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {"RLOPS_CONFIG": str(path)}
    out = run_cli(["status"], env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "not running: s3, mlflow" in out.stderr and "rlops up" in out.stderr
    lines = out.stdout.splitlines()
    assert any("s3" in line and "down" in line and "no credentials yet" in line for line in lines), out.stdout
    assert any("mlflow" in line and "down" in line for line in lines), out.stdout


def test_up_down_cycle_keeps_data_and_leaves_no_process(tmp_path):
    path = write_config(tmp_path / "mlflow.yaml", {
        "data_dir": str(tmp_path / "d"), "server": {"port": processes.free_port()},
        "storage": {"endpoint_url": f"http://127.0.0.1:{free_s3_port()}"},
    })
    env = dict(os.environ, RLOPS_CONFIG=str(path))
    out = run_cli(["up"], env)
    assert out.returncode == 0, out.stderr
    assert "MLflow UI:" in out.stdout and "S3 endpoint:" in out.stdout
    cfg = load_config(path, environ={})
    pids = [r.pid for r in processes.list_records(cfg.data_path)]
    family = [c.pid for pid in pids for c in psutil.Process(pid).children(recursive=True)] + pids
    client = mlflow.MlflowClient(cfg.tracking_uri)
    exp_id = client.create_experiment(f"persist-{uuid.uuid4().hex[:6]}")
    assert run_cli(["status"], env).returncode == 0

    out = run_cli(["down"], env)
    assert out.returncode == 0 and "mlflow" in out.stdout and "s3" in out.stdout
    assert not [pid for pid in family if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert run_cli(["status"], env).returncode == 1

    assert run_cli(["up"], env).returncode == 0
    try:
        assert mlflow.MlflowClient(cfg.tracking_uri).get_experiment(exp_id).experiment_id == exp_id
    finally:
        assert run_cli(["down"], env).returncode == 0


def test_down_never_signals_a_reused_pid(tmp_path):
    data = tmp_path / "d"
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        processes.write_record(data, processes.ProcessRecord("ghost", victim.pid, 12345.0, ["x"], ""))
        assert processes.stop(data, "ghost") is False
        assert victim.poll() is None
    finally:
        victim.kill()


def test_loopback_proxy_cuts_and_restores(stack, mlflow_proxy):
    client = mlflow.MlflowClient(mlflow_proxy.url)
    client.search_experiments(max_results=1)
    mlflow_proxy.cut()
    import httpx

    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{mlflow_proxy.url}/health", timeout=2)
    mlflow_proxy.restore()
    assert httpx.get(f"{mlflow_proxy.url}/health", timeout=5).status_code == 200


def test_names_and_aliases_follow_the_shared_grammar():
    with pytest.raises(ConfigError, match="environment variable RLOPS_REGISTRY__SERVED_ALIASES: registry.served_aliases.0"):
        load_config(None, environ={"RLOPS_REGISTRY__SERVED_ALIASES": "[latest]"})
    with pytest.raises(ConfigError, match="registry.models.0.*'a/b'"):
        load_config(None, environ={"RLOPS_REGISTRY__MODELS": "[a/b]"})
    with pytest.raises(ConfigError, match="tracking.register_aliases.0"):
        load_config(None, environ={"RLOPS_TRACKING__REGISTER_ALIASES": "[v3]"})


def test_up_starts_nothing_for_external_services(stack, tmp_path):
    """mlflow.yaml pointing at an existing MLflow and S3 (managed: false): `up` only checks them."""
    path = write_config(tmp_path / "mlflow.yaml", {
        "data_dir": str(tmp_path / "d"),
        "tracking": {"uri": stack.tracking_uri},
        "server": {"managed": False, "port": processes.free_port()},
        "storage": {"managed": False, "endpoint_url": stack.config.storage.endpoint_url,
                    "bucket": stack.config.storage.bucket},
    })
    env = dict(stack.env, RLOPS_CONFIG=str(path))
    out = run_cli(["up"], env)
    assert out.returncode == 0, out.stderr
    assert "(external)" in out.stdout and stack.tracking_uri in out.stdout
    assert processes.list_records(tmp_path / "d") == []
    assert run_cli(["status"], env).returncode == 0


def test_each_local_ray_node_binds_vllm_to_its_own_cpus():
    """All nodes of the local cluster share one host: each node's vLLM workers get their own share of its
    CPUs (vLLM's `auto` would pin every engine to the same first core)."""
    from rlops.stack import vllm_cpu_binding

    assert [vllm_cpu_binding(i, 2, [0, 1]) for i in range(2)] == ["0", "1"]
    assert [vllm_cpu_binding(i, 3, [0, 1]) for i in range(3)] == ["0", "1", "0"]  # more nodes than CPUs: round robin
    assert [vllm_cpu_binding(i, 2, [2, 3, 5, 7]) for i in range(2)] == ["2,3", "5,7"]  # the CPUs this process may use
    assert vllm_cpu_binding(0, 1, [0, 1, 2]) == "0,1,2"


def test_ray_section_default_is_no_cluster_and_nodes_get_their_own_ports(tmp_path):
    from rlops.stack import RAY_TOKEN_FILE, ray_argv, ray_node_env, ray_node_names

    default = load_config(None, environ={})
    assert default.ray.nodes == 0 and default.ray_address is None and ray_node_names(default) == []
    with pytest.raises(ConfigError, match="ray.nodes"):
        load_config(None, environ={"RLOPS_RAY__NODES": "-1"})
    config = load_config(None, environ={"RLOPS_RAY__NODES": "3", "RLOPS_DATA_DIR": str(tmp_path),
                                        "RLOPS_STORAGE__MANAGED": "false"})
    assert config.ray_address == "127.0.0.1:6379" and config.ray_dashboard_url == "http://127.0.0.1:8265"
    names = ray_node_names(config)
    assert names == ["ray-head", "ray-worker-1", "ray-worker-2"]
    argvs = {name: ray_argv(config, name) for name in names}
    assert {"--head", "--port=6379", "--dashboard-port=8265", "--dashboard-host=127.0.0.1"} <= set(argvs["ray-head"])
    assert "--address=127.0.0.1:6379" in argvs["ray-worker-2"] and "--head" not in argvs["ray-worker-2"]
    agent_ports = [a for argv in argvs.values() for a in argv if a.startswith("--dashboard-agent-listen-port=")]
    assert len(set(agent_ports)) == 3  # three raylets on one IP: no shared default port
    env = ray_node_env(config, {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "node-secret", "PATH": "/bin",
                                "RAY_AUTH_TOKEN": "a-token-value"})
    assert env["AWS_SECRET_ACCESS_KEY"] == "node-secret" and env["RAY_JOB_STOP_WAIT_TIME_S"] == "30"
    assert env["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] == "0"  # the head's one proxy feeds every node
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / RAY_TOKEN_FILE)
    assert "RAY_AUTH_TOKEN" not in env and (tmp_path / RAY_TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)  # a job's `python` is this one
