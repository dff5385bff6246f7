"""CPU mode of the SkyRL job: SkyRL 0.3.0's GPU assumptions mapped to CPU at the seams where it makes them.

`setup_worker` is Ray's `worker_process_setup_hook` (set by `start_ray`): it runs first in every Ray
worker of the job, and only there. Each mapping names the SkyRL lines it serves; before any is applied,
those lines are checked against the installed SkyRL and a mismatch stops the worker (a new SkyRL needs
the mappings reviewed, not silently half-applied). It refuses to run where CUDA is available: on a GPU
machine the job runs SkyRL unchanged. See shared/notes/skyrl-cpu.md and docs/skyrl-upstream.md.

What has no CPU route and is not mapped: `colocate_all=true` (vLLM sleep mode; `offload_to_cpu`
divides by `torch.cuda.device_count()`, worker.py:333) and full-weight sync (NCCL sender, CUDA-IPC
receiver): the job must sync LoRA over disk (`lora_sync_path`).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

SKYRL_VERSION = "0.3.0"
SETUP_HOOK = "training.skyrl_cpu.setup_worker"
# SkyRL's placement asks for {"GPU": 1, "CPU": 1} bundles (main_base.py:126, setup.py:178,
# server_group.py:125) and per-actor num_gpus (worker.py:631-632): Ray gets logical GPUs to place them.
LOGICAL_GPUS = 4
LOGICAL_CPUS = 8
# vLLM's CPU backend wants 92% of NUMA node 0 free by default; a 1 GiB KV cache fits beside the trainer.
WORKER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


class SkyRLChanged(RuntimeError):
    """The installed SkyRL no longer has a line a CPU mapping was written for."""


@dataclass(frozen=True)
class Seam:
    """A SkyRL source line (path under the `skyrl` package, 1-based line) that must contain `text`."""

    path: str
    line: int
    text: str

    def problem(self, root: Path) -> str | None:
        lines = (root / self.path).read_text().splitlines()
        found = lines[self.line - 1].strip() if self.line <= len(lines) else "<end of file>"
        return None if self.text in found else f"skyrl/{self.path}:{self.line}: expected {self.text!r}, found {found!r}"


WORKERS, DIST = "backends/skyrl_train/workers/", "backends/skyrl_train/distributed/"
SERVERS = "backends/skyrl_train/inference_servers/"


# --- the mappings -------------------------------------------------------------------------------------

def map_cuda_calls() -> None:
    """`torch.cuda.current_device()` used as the device; set_device/synchronize/empty_cache as bookkeeping."""
    import torch

    torch.cuda.current_device = lambda: "cpu"
    for name in ("set_device", "synchronize", "empty_cache"):
        setattr(torch.cuda, name, lambda *args, **kwargs: None)


def map_process_group() -> None:
    """The `cpu:gloo,cuda:nccl` process group and `cuda` device meshes become gloo and `cpu`."""
    import torch.distributed
    import torch.distributed.device_mesh as device_mesh

    init_process_group, init_device_mesh = torch.distributed.init_process_group, device_mesh.init_device_mesh

    def gloo_process_group(*args, backend=None, **kwargs):
        return init_process_group(*args, backend="gloo" if backend == "cpu:gloo,cuda:nccl" else backend, **kwargs)

    def cpu_device_mesh(device_type, *args, **kwargs):
        return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    torch.distributed.init_process_group = gloo_process_group
    device_mesh.init_device_mesh = cpu_device_mesh  # fsdp_utils imports it by name, after this hook


def sync_buffers_on_cpu(fsdp_utils: types.ModuleType) -> None:
    """`_sync_non_persistent_buffers` broadcasts through `.cuda()` tensors (only with >= 2 ranks)."""
    import torch
    import torch.distributed as dist

    def _sync_non_persistent_buffers(model, loaded_sd):
        for module in model.modules():
            for key in sorted(getattr(module, "_non_persistent_buffers_set", set())):
                buf = module._buffers.get(key)
                if buf is not None:
                    src = buf.detach().cpu() if dist.get_rank() == 0 else torch.empty(buf.shape, dtype=buf.dtype)
                    dist.broadcast(src, src=0)
                    module._buffers[key] = src

    fsdp_utils._sync_non_persistent_buffers = _sync_non_persistent_buffers


def stub_flash_attn() -> None:
    """model_wrapper imports flash_attn (a CUDA build) at module level; only `remove_microbatch_padding=true`
    calls it, so the stub's functions say that instead of computing anything."""
    if importlib.util.find_spec("flash_attn") is not None:
        return

    def unavailable(*args, **kwargs):
        raise RuntimeError("flash_attn is not available on CPU: set trainer.remove_microbatch_padding=false")

    package = types.ModuleType("flash_attn")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    package.__path__ = []
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
    padding.pad_input = padding.unpad_input = unavailable
    package.bert_padding = padding
    sys.modules.update({"flash_attn": package, "flash_attn.bert_padding": padding})


def lora_sync_without_nccl_group(trainer_module: types.ModuleType) -> None:
    """`init_weight_sync_state` always builds an NCCL weight-transfer group (broadcast_strategy.py:251); the
    LoRA adapter goes to vLLM over disk (fsdp_worker.py `_save_lora_adapters_and_sync`) and never uses it."""
    trainer_cls = trainer_module.RayPPOTrainer

    def init_weight_sync_state(self):
        if not self.cfg.trainer.policy.model.lora.rank:
            raise RuntimeError("SkyRL CPU mode: full-weight sync needs NCCL/CUDA IPC (checked on GPU only); "
                               "set trainer.policy.model.lora.rank > 0 so LoRA syncs over disk")
        log.info("SkyRL CPU mode: no NCCL weight-sync group, the LoRA adapter syncs over disk")

    trainer_cls.init_weight_sync_state = init_weight_sync_state


def alias_vllm_cli_args(openai_package: types.ModuleType) -> None:
    """vLLM 0.29 moved `entrypoints.openai.cli_args` to `entrypoints.launchers.cli_args` (SkyRL 0.3.0 pins 0.23)."""
    from vllm.entrypoints.launchers import cli_args

    sys.modules[f"{openai_package.__name__}.cli_args"] = cli_args
    openai_package.cli_args = cli_args


def alias_vllm_mm_serde(serve_package: types.ModuleType) -> None:
    """vLLM 0.29 moved `entrypoints.serve.disagg.mm_serde` (the render endpoint's `kwargs_data`: a
    MultiModalKwargsItem as base64 msgpack) to `entrypoints.scale_out.token_in_token_out.mm_serde`, same
    `encode_mm_kwargs_item`/`decode_mm_kwargs_item`; the VLM generator decodes each rollout's pixels with it."""
    from vllm.entrypoints.scale_out.token_in_token_out import mm_serde

    disagg = types.ModuleType(f"{serve_package.__name__}.disagg")
    disagg.__spec__ = importlib.machinery.ModuleSpec(disagg.__name__, None, is_package=True)
    disagg.__path__ = []
    disagg.mm_serde = mm_serde
    sys.modules.update({disagg.__name__: disagg, f"{disagg.__name__}.mm_serde": mm_serde})
    serve_package.disagg = disagg


def default_reuse_port(api_server: types.ModuleType) -> None:
    """vLLM 0.29's `create_server_socket` needs a keyword `reuse_port` that SkyRL (for 0.23) does not pass."""
    create_server_socket = api_server.create_server_socket
    api_server.create_server_socket = lambda addr, *, reuse_port=False: create_server_socket(addr, reuse_port=reuse_port)


def router_args_pd_flag(router_args: types.ModuleType) -> None:
    """vllm-router 0.1.17's RouterArgs has no `pd_disaggregation` (only `vllm_pd_disaggregation`)."""
    if not hasattr(router_args.RouterArgs, "pd_disaggregation"):
        router_args.RouterArgs.pd_disaggregation = False


def filter_prompts_in_process(dataset_module: types.ModuleType) -> None:
    """BasePPOExp builds its datasets with `num_workers=8`: 8 spawned processes filter the prompts by length,
    minutes on a machine of 2 cores for a handful of rows. CPU mode filters in the worker itself."""
    prompt_dataset = dataset_module.PromptDataset
    init = prompt_dataset.__init__

    def in_process(self, *args, num_workers: int = 1, **kwargs):
        init(self, *args, num_workers=1, **kwargs)

    prompt_dataset.__init__ = in_process


@dataclass(frozen=True)
class Mapping:
    name: str
    apply: Callable[..., None]
    seams: tuple[Seam, ...]
    after_import: str | None = None  # applied to this module once it is imported (None: at setup)


MAPPINGS = (
    Mapping("cuda calls -> cpu", map_cuda_calls, (
        Seam(WORKERS + "worker.py", 844, "experience.to_device(torch.cuda.current_device())"),
        Seam(WORKERS + "worker.py", 1111, "experience.to_device(torch.cuda.current_device())"),
        Seam(WORKERS + "worker.py", 1191, "device = torch.cuda.current_device()"),
        Seam(DIST + "strategy.py", 84, "data = data.to(torch.cuda.current_device())"),
        Seam(DIST + "fsdp_utils.py", 52, "x.to_empty(device=torch.cuda.current_device()"),
        Seam(DIST + "fsdp_utils.py", 83, "device = torch.cuda.current_device()"),
        Seam(DIST + "fsdp_utils.py", 249, "total_norm.to(torch.cuda.current_device()"),
        Seam(DIST + "fsdp_strategy.py", 106, "torch.cuda.set_device(local_rank)"),
        Seam(DIST + "fsdp_strategy.py", 129, "torch.cuda.synchronize()"),
        Seam(DIST + "fsdp_strategy.py", 141, "load_fsdp_optimizer(optimizer, torch.cuda.current_device())"),
        Seam(WORKERS + "fsdp/fsdp_worker.py", 127, "device = torch.cuda.current_device()"))),
    Mapping("nccl -> gloo, cuda mesh -> cpu", map_process_group, (
        Seam(WORKERS + "worker.py", 122, 'backend="cpu:gloo,cuda:nccl"'),
        Seam(WORKERS + "worker.py", 131, "torch.distributed.device_mesh.init_device_mesh("),
        Seam(WORKERS + "worker.py", 132, '"cuda", mesh_shape=(dp_size'),
        Seam(DIST + "fsdp_utils.py", 28, "from torch.distributed.device_mesh import init_device_mesh"),
        Seam(DIST + "fsdp_utils.py", 256, 'init_device_mesh("cuda"'),
        Seam(DIST + "fsdp_utils.py", 259, '"cuda", mesh_shape=(world_size // fsdp_size'))),
    Mapping("non-persistent buffers broadcast on cpu", sync_buffers_on_cpu, (
        Seam(DIST + "fsdp_utils.py", 111, "def _sync_non_persistent_buffers(model: torch.nn.Module, loaded_sd: dict):"),
        Seam(DIST + "fsdp_utils.py", 125, "src = buf.detach().cuda()"),
        Seam(DIST + "fsdp_utils.py", 127, 'src = torch.empty(buf.shape, dtype=buf.dtype, device="cuda")')),
        after_import="skyrl.backends.skyrl_train.distributed.fsdp_utils"),
    Mapping("flash_attn import stub", stub_flash_attn, (
        Seam(WORKERS + "model_wrapper.py", 12, "from flash_attn.bert_padding import pad_input, unpad_input"),
        Seam(WORKERS + "model_wrapper.py", 278, "if self.remove_microbatch_padding:"))),
    Mapping("no NCCL weight-sync group for disk LoRA sync", lora_sync_without_nccl_group, (
        Seam("train/trainer.py", 278, "self.init_weight_sync_state()"),
        Seam("train/trainer.py", 841, "def init_weight_sync_state(self):"),
        Seam("train/trainer.py", 845, "self.dispatch.init_weight_sync_state(self.inference_engine_client)"),
        Seam("backends/skyrl_train/weight_sync/broadcast_strategy.py", 251, "NCCLWeightTransferEngine.trainer_init(")),
        after_import="skyrl.train.trainer"),
    Mapping("dataset filtering in process", filter_prompts_in_process, (
        Seam("train/entrypoints/main_base.py", 82, "num_workers=8,"),
        Seam("train/entrypoints/main_base.py", 101, "num_workers=8,"),
        Seam("train/dataset/dataset.py", 68, "if self.num_workers > 1:")),
        after_import="skyrl.train.dataset.dataset"),
    Mapping("vllm 0.23 -> 0.29: entrypoints.openai.cli_args", alias_vllm_cli_args, (
        Seam(SERVERS + "utils.py", 63, "from vllm.entrypoints.openai.cli_args import FrontendArgs"),
        Seam(SERVERS + "vllm_server_actor.py", 528, "from vllm.entrypoints.openai.cli_args import FrontendArgs")),
        after_import="vllm.entrypoints.openai"),
    Mapping("vllm 0.23 -> 0.29: entrypoints.serve.disagg.mm_serde", alias_vllm_mm_serde, (
        Seam("backends/renderer.py", 54, "from vllm.entrypoints.serve.disagg.mm_serde import ("),
        Seam("backends/renderer.py", 55, "decode_mm_kwargs_item as _vllm_decode,")),
        after_import="vllm.entrypoints.serve"),
    Mapping("vllm 0.23 -> 0.29: create_server_socket(reuse_port)", default_reuse_port, (
        Seam(SERVERS + "vllm_server_actor.py", 21, "create_server_socket,"),
        Seam(SERVERS + "vllm_server_actor.py", 473, "sock = create_server_socket(sock_addr)")),
        after_import="vllm.entrypoints.openai.api_server"),
    Mapping("vllm-router 0.1.17: RouterArgs.pd_disaggregation", router_args_pd_flag, (
        Seam(SERVERS + "vllm_router.py", 127, "self._router_args.pd_disaggregation"),),
        after_import="vllm_router.router_args"),
)


# --- applying them ------------------------------------------------------------------------------------

def skyrl_root() -> Path:
    spec = importlib.util.find_spec("skyrl")
    if spec is None or not spec.submodule_search_locations:
        raise SkyRLChanged("SkyRL CPU mode: the skyrl package is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def check_seams(root: Path | None = None, mappings=MAPPINGS) -> None:
    """Raise SkyRLChanged naming every seam whose line differs from what its mapping was written for."""
    from importlib.metadata import version

    root = root or skyrl_root()
    problems = [p for m in mappings for p in (s.problem(root) for s in m.seams) if p]
    if version("skyrl") != SKYRL_VERSION:
        problems.insert(0, f"skyrl {version('skyrl')} is installed; the CPU mappings are for {SKYRL_VERSION}")
    if problems:
        raise SkyRLChanged("SkyRL CPU mode: SkyRL changed at the seams it maps:\n  " + "\n  ".join(problems))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a mapping on a module right after the module's own code, wherever it is first imported."""

    def __init__(self, actions: dict[str, Callable[[types.ModuleType], None]]):
        self.actions = actions

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name not in self.actions:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, action = spec.loader.exec_module, self.actions.pop(name)

        def exec_then_map(module):
            exec_module(module)
            action(module)

        spec.loader.exec_module = exec_then_map
        return spec


def setup_worker() -> None:
    """Ray's `worker_process_setup_hook` of a CPU-mode job: check every seam, then apply every mapping."""
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("SkyRL CPU mode started on a machine with a GPU: submit the job without --cpu")
    check_seams()
    later = {}
    for mapping in MAPPINGS:
        if mapping.after_import is None:
            mapping.apply()
        elif mapping.after_import in sys.modules:
            mapping.apply(sys.modules[mapping.after_import])
        else:
            later[mapping.after_import] = mapping.apply
    if later:
        sys.meta_path.insert(0, _AfterImport(later))


class CPUModeError(ValueError):
    """The recipe or the Ray cluster asks for something CPU mode cannot place."""


def gpu_slots_per_node(cfg: Any) -> int:
    placement, engine = cfg.trainer.placement, cfg.generator.inference_engine
    return max(placement.policy_num_gpus_per_node, placement.critic_num_gpus_per_node,
               placement.ref_num_gpus_per_node, engine.tensor_parallel_size)


def gpu_slots_needed(cfg: Any) -> int:
    """Logical GPUs SkyRL's bundles take when nothing is colocated: the policy's, the reference model's (with
    a KL term) and each inference engine's."""
    placement, engine, algorithm = cfg.trainer.placement, cfg.generator.inference_engine, cfg.trainer.algorithm
    slots = placement.policy_num_nodes * placement.policy_num_gpus_per_node
    if algorithm.use_kl_loss or algorithm.use_kl_in_reward:
        slots += placement.ref_num_nodes * placement.ref_num_gpus_per_node
    per_engine = engine.tensor_parallel_size * engine.pipeline_parallel_size * engine.data_parallel_size
    return slots + engine.num_engines * per_engine


def start_ray(cfg: Any, *, local: bool) -> None:
    """`skyrl.train.utils.utils.initialize_ray` for CPU mode: SkyRL's runtime env plus the setup hook. `local`
    starts a Ray here with logical GPUs; otherwise it joins the cluster it runs in (a Ray job's), whose nodes
    declare their own (`ray.gpus_per_node`, `ray start --num-gpus=N`)."""
    import ray
    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries

    from training.skyrl_main import merge_runtime_env_with_the_job, skyrl_env_vars

    if gpu_slots_per_node(cfg) > 1:
        # utils.py:731: with > 1 GPU per node SkyRL probes GPU peer access on a GPU bundle that never comes
        raise CPUModeError("SkyRL CPU mode runs one GPU slot per node: set trainer.placement.*_num_gpus_per_node=1 "
                           "and generator.inference_engine.tensor_parallel_size=1")
    env_vars = {**skyrl_env_vars(cfg), **WORKER_ENV}
    runtime_env = {"env_vars": env_vars, "worker_process_setup_hook": SETUP_HOOK}
    if local:
        for attempt in (1, 2, 3):
            try:
                # no prestarted idle workers: each would run the setup hook on a machine of a few cores
                ray.init(address="local", num_cpus=LOGICAL_CPUS, num_gpus=LOGICAL_GPUS, runtime_env=runtime_env,
                         log_to_driver=True, include_dashboard=False,
                         _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})
                break
            except Exception as exc:  # Ray raises a bare Exception when its raylet dies at startup
                # the raylet waits 15 s for its metrics agent and the driver 30 s for the raylet: a loaded
                # machine of 2 cores misses that at times
                if attempt == 3 or "timed out during startup" not in str(exc):
                    raise
                log.warning("local Ray did not start (%s); trying again", exc)
                ray.shutdown()
    else:
        merge_runtime_env_with_the_job()
        ray.init(runtime_env=runtime_env, log_to_driver=True)
        offered, needed = int(ray.cluster_resources().get("GPU", 0)), gpu_slots_needed(cfg)
        if offered < needed:  # SkyRL's placement groups would wait for them until its timeout
            ray.shutdown()
            raise CPUModeError(
                f"SkyRL CPU mode: the Ray cluster offers {offered} GPU slots and the recipe's bundles take {needed}; "
                "on CPU nodes set ray.gpus_per_node in mlflow.yaml (logical GPUs, `ray start --num-gpus`) and "
                "restart the cluster (`rlops down`, `rlops up`)")
    sync_registries()
