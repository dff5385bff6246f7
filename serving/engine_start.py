"""Two fewer Python processes per vLLM replica start, where they would only import vLLM again.

Each process that imports vLLM pays 15-30 s on a small CPU machine (bench/README.md, "Engine start"):
- Ray's node initialisation runs a task per node of the replica's placement group, and it only downloads
  something for a model in cloud storage (an `s3://` or `gs://` source, or a mirror config). For any other
  source (a local folder, an HF id that vLLM fetches itself) `LocalModelCallback` skips it.
- On CPU Ray hands vLLM the multiprocessing executor, which spawns one worker process beside the engine
  core even for a single worker. `OneProcessVLLMEngine` runs that worker inside the engine core process
  (vLLM's own choice for one worker) where the replica has one worker. The worker's OpenMP binding
  (`VLLM_CPU_OMP_THREADS_BIND`, `auto` by default) then applies to the engine core process: its scheduler
  shares the bound cores instead of keeping the one core `auto` leaves it.
"""
from __future__ import annotations

import os

import torch
from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.llm._internal.common.utils.cloud_utils import is_remote_path
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
from ray.llm._internal.serve.engines.vllm.vllm_models import EXECUTOR_BACKEND_MP
from vllm.utils.ompmultiprocessing import OMPProcessManager

IN_PROCESS_EXECUTOR = "uni"  # vLLM's name for its one-process executor


class LocalModelCallback(CallbackBase):
    """`llm_config.callback_config.callback_class`: node initialisation only for a model in cloud storage."""

    async def on_before_node_init(self) -> None:
        engine_config = self.llm_config.get_engine_config()
        if engine_config.mirror_config is None and not is_remote_path(engine_config.actual_hf_model_id):
            self.ctx.run_init_node = False
            # the one other thing node initialisation does (a workaround for torch, kept as Ray has it)
            os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)


class OneProcessVLLMEngine(VLLMEngine):
    """`VLLMEngine` with a single worker run by the engine core process itself."""

    def _prepare_engine_config(self, callback_ctx):
        engine_args, frontend_args, engine_config = super()._prepare_engine_config(callback_ctx)
        parallel = engine_config.parallel_config
        if parallel.world_size == 1 and parallel.distributed_executor_backend == EXECUTOR_BACKEND_MP:
            parallel.distributed_executor_backend = IN_PROCESS_EXECUTOR
        return engine_args, frontend_args, engine_config

    def _start_async_llm_engine(self, engine_args, engine_config, placement_group):
        if engine_config.parallel_config.distributed_executor_backend != IN_PROCESS_EXECUTOR:
            return super()._start_async_llm_engine(engine_args, engine_config, placement_group)
        # the OpenMP environment vLLM gives its worker process, given to the engine core process it spawns now
        with OMPProcessManager(engine_config).configure_omp_envs(rank=0, local_rank=0):
            return super()._start_async_llm_engine(engine_args, engine_config, placement_group)
