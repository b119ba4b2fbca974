"""The training loop for one stage: the same code in-process on CPU and under torchrun/deepspeed on GPUs.

A TrainJob says everything: the recipe (architecture, optimizer, the schedule over all stages, which stage to
train), where the tokenized sources are, what to continue from, and where to keep checkpoints. Running the
same job again resumes from its newest complete checkpoint and produces bitwise the same weights on CPU.

The loop itself only draws batches, accumulates gradients and steps the optimizer; metrics, progress,
monitors and checkpoints are callbacks (model/callbacks.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compass.model import checkpoint as ckpt
from compass.model.architecture import build_model, hf_config, parameter_groups
from compass.model.callbacks import Callback, Checkpointing, MetricsFile, Monitoring, Progress, Rollback
from compass.model.engine import DeepSpeedEngine, Engine, TorchEngine, dist_env, init_distributed
from compass.model.job import TrainJob
from compass.model.loss import lm_loss
from compass.model.monitors import Event, TrainingStopped
from compass.model.packing import PackedBatch, Packer
from compass.model.schedules import schedule_shape
from compass.model.token_files import TokenizedSource
from compass.model.validation import heldout_losses
from compass.specs.costs import flops_per_token

log = logging.getLogger("compass.train")


@dataclass
class StageResult:
    steps: int
    tokens: int
    final_loss: float
    val_loss: dict[str, float]
    resumed_from: int | None
    rank_check: str = "single process"
    events: list[dict[str, Any]] = field(default_factory=list)


def cpu_peak_tflops() -> float:
    """A measured fp32 matmul peak for MFU on CPU (there is no data-sheet number to use)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    start = time.perf_counter()
    for _ in range(8):
        a @ b
    return 8 * 2 * 1024**3 / (time.perf_counter() - start) / 1e12


def training_device(accelerator: str) -> torch.device:
    """The local GPU of this rank when `how` names one and CUDA is present, else the CPU."""
    _, _, local_rank = dist_env()
    if accelerator != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def default_callbacks(job: TrainJob) -> list[Callback]:
    """Monitors first (they may veto the step), then the metrics line, progress, and checkpoints last."""
    return [Monitoring(job.recipe.monitors), MetricsFile(job.workdir / "metrics.jsonl"), Progress(),
            Checkpointing(job.checkpoints.every_steps, job.checkpoints.keep_last)]


class Trainer:
    """One stage of training. `fit()` resumes from the newest complete checkpoint in the job's work folder (or
    starts from `init_from`), trains to the stage's last step and returns the stage's result."""

    def __init__(self, job: TrainJob, callbacks: list[Callback] | None = None):
        self.job = job
        self.rank, self.world, _ = dist_env()
        recipe = job.recipe
        self.stage = recipe.current
        shape = schedule_shape(recipe.schedule, recipe.stages)
        names = [s.name for s in shape.stages]
        self.shape = shape
        self.offset = sum(s.steps for s in shape.stages[: names.index(self.stage.name)])
        self.stage_steps = shape.stages[names.index(self.stage.name)].steps
        gbs = self.stage.global_batch_size
        if gbs % (job.micro_batch_size * self.world):
            raise ValueError(f"global batch {gbs} is not a multiple of micro-batch {job.micro_batch_size} x world "
                             f"{self.world}")
        self.accumulation = gbs // (job.micro_batch_size * self.world)
        self.checkpoint_root = job.workdir / "checkpoints"
        self.device = training_device(job.hardware.accelerator)
        self.engine = self._engine()
        self.packer = Packer({n: TokenizedSource(p) for n, p in job.sources.items()}, self.stage.mixture,
                             self.stage.sequence_length, seed=recipe.seed + 7919 * (self.offset + 1),
                             whole_from=job.whole_from, pad_id=job.special_ids.pad)
        self.callbacks = default_callbacks(job) + list(callbacks or [])
        self.step = 0  # optimizer steps of this stage done so far
        self.events: list[dict[str, Any]] = []
        self.last_loss = float("nan")

    # --- set-up -------------------------------------------------------------------------------------------
    def _engine(self) -> Engine:
        job, recipe = self.job, self.job.recipe
        arch = recipe.architecture
        special = {"bos": job.special_ids.eos, "eos": job.special_ids.eos, "pad": job.special_ids.pad}
        model = build_model(hf_config(arch, job.vocab_size, special, max_positions=recipe.max_positions),
                            recipe.seed)
        if job.parallelism.activation_checkpointing:  # recompute each layer's activations in the backward pass
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        groups = parameter_groups(model, recipe.optimizer.weight_decay, arch.embedding_weight_decay)
        par = job.parallelism
        if par.deepspeed:
            if self.device.type == "cpu":
                init_distributed("gloo")  # on GPUs DeepSpeed initialises NCCL itself
            return DeepSpeedEngine(model, groups, recipe.optimizer, self.accumulation, job.micro_batch_size,
                                   par.zero_stage, job.precision)
        init_distributed("gloo" if self.device.type == "cpu" else "nccl")
        return TorchEngine(model.to(self.device), groups, recipe.optimizer, self.accumulation)

    @property
    def global_step(self) -> int:
        """Optimizer steps over every stage of the schedule, this one included."""
        return self.offset + self.step

    # --- hooks --------------------------------------------------------------------------------------------
    def _dispatch(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def report(self, event: Event) -> None:
        """A monitor event: logged and kept for the stage's result."""
        self.events.append(event.as_dict())
        log.warning(event.describe())

    # --- the loop -----------------------------------------------------------------------------------------
    def fit(self) -> StageResult:
        resumed = self._resume()
        self._dispatch("on_start")
        peak = (self.job.peak_tflops or cpu_peak_tflops()) * self.world
        seq, gbs = self.stage.sequence_length, self.stage.global_batch_size
        flops_tok = flops_per_token(self.job.recipe.architecture, self.job.vocab_size, seq)
        rank_check = "single process"
        first = True
        self.engine.module.train()
        try:
            while self.step < self.stage_steps:
                self._dispatch("pre_step")
                t0 = time.perf_counter()
                batch = self.packer.next_batch(gbs)
                local = batch.slice(self.rank * gbs // self.world, (self.rank + 1) * gbs // self.world)
                if self.world > 1 and first:
                    rank_check = check_ranks(self.engine.module, local)
                first = False
                loss = self._accumulate(local)
                grad_norm = self.engine.grad_norm()
                try:
                    self._dispatch("before_update", loss, grad_norm)
                except Rollback as rollback:
                    self.restore_newest_checkpoint(rollback.event)
                    continue  # the packer keeps its position: the offending batches are skipped
                lr = self.job.recipe.optimizer.lr * self.shape.lr_factor(self.global_step)
                self.engine.step(lr, grad_norm)
                elapsed = time.perf_counter() - t0
                self.step += 1
                self.last_loss = loss
                self._dispatch("post_step", self._record(loss, grad_norm, lr, elapsed, flops_tok, peak))
        except BaseException as exc:
            self._dispatch("on_error", exc)
            raise
        self._dispatch("on_end")
        masking = self.job.recipe.intra_document_masking
        val = heldout_losses(self.engine.module, self.job.sources, seq, masking, self.device) if self.rank == 0 else {}
        return StageResult(self.stage_steps, self.stage_steps * gbs * seq, self.last_loss, val,
                           int(resumed.name.split("-")[1]) if resumed else None, rank_check, self.events)

    def _accumulate(self, local: PackedBatch) -> float:
        """Forward and backward over the rank's micro-batches; returns the cross-entropy averaged over ranks."""
        micro, arch = self.job.micro_batch_size, self.job.recipe.architecture
        total = 0.0
        for m in range(self.accumulation):
            part = local.slice(m * micro, (m + 1) * micro)
            out = self._forward(part)
            loss, ce = lm_loss(out.logits, part.labels.to(self.device), arch.z_loss)
            if getattr(out, "aux_loss", None) is not None and arch.moe:
                loss = loss + arch.moe.load_balancing_coef * out.aux_loss
            self.engine.backward(loss)
            total += float(ce.detach()) / self.accumulation
            if m < self.accumulation - 1:
                self.engine.micro_step()
        return _mean_across_ranks(total, self.world)

    def _forward(self, batch: PackedBatch) -> Any:
        inputs = batch.model_inputs(self.job.recipe.intra_document_masking, self.device)
        if self.device.type == "cuda" and self.job.precision == "bf16" and isinstance(self.engine, TorchEngine):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return self.engine(**inputs)
        return self.engine(**inputs)

    def _record(self, loss: float, grad_norm: float, lr: float, elapsed: float, flops_tok: float,
                peak: float) -> dict[str, Any]:
        tokens = self.stage.global_batch_size * self.stage.sequence_length
        record = {"step": self.global_step, "stage": self.stage.name, "stage_step": self.step, "loss": loss,
                  "grad_norm": grad_norm, "lr": lr, "tokens": self.job.tokens_before + self.global_step * tokens,
                  "tokens_per_s": tokens / elapsed, "mfu": flops_tok * tokens / elapsed / (peak * 1e12),
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if self.device.type == "cuda":
            record["gpu_mem_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return record

    # --- checkpoints --------------------------------------------------------------------------------------
    def _resume(self) -> Path | None:
        """Continue from the newest complete checkpoint of this stage, else from the previous stage's state."""
        resumed = ckpt.newest_valid(self.checkpoint_root)
        if resumed is not None:
            extra = self.engine.load(resumed)
            self.packer.load_state_dict(extra["packer"])
            ckpt.set_rng_state(extra["rng"])
            self.step = extra["stage_step"]
            log.info("resuming %s from %s (step %d of %d)", self.stage.name, resumed.name, self.step,
                     self.stage_steps)
        elif self.job.init_from:
            self.engine.load(self.job.init_from, load_optimizer=not self.stage.reset_optimizer)
            log.info("continuing from the previous stage's final state %s", self.job.init_from)
        return resumed

    def save_checkpoint(self) -> Path:
        """Write model, optimizer, RNG and data position at this step, checksummed and renamed into place."""
        rank, world = self.rank, self.world
        self.checkpoint_root.mkdir(parents=True, exist_ok=True)
        final = ckpt.step_dir(self.checkpoint_root, self.step)
        tmp = final.with_name(final.name + ".tmp")
        if rank == 0:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier(world)
        extra = {"packer": self.packer.state_dict(), "rng": ckpt.rng_state(), "stage_step": self.step,
                 "global_step": self.global_step, "engine": self.engine.name}
        self.engine.save(tmp, extra)
        state = self.engine.export_state_dict()
        if rank == 0:
            export_hf(self.engine.module, state, self.job.tokenizer_dir, tmp / "hf")
        _barrier(world)
        if rank == 0:
            ckpt.finalize(tmp, final)
        _barrier(world)
        self._dispatch("post_checkpoint", final)
        return final

    def restore_newest_checkpoint(self, event: Event) -> None:
        """Roll back: the newest good checkpoint's weights, optimizer and RNG; the step count returns there."""
        self.engine.discard()
        good = ckpt.newest_valid(self.checkpoint_root)
        if good is None:
            raise TrainingStopped(event, "(no checkpoint to roll back to yet)")
        extra = self.engine.load(good)
        ckpt.set_rng_state(extra["rng"])
        self.step = extra["stage_step"]
        log.warning("rolled back to %s; skipping the batches since then", good.name)
        self._dispatch("post_restore", self.step)


def train_stage(job: TrainJob, callbacks: list[Callback] | None = None) -> StageResult:
    # grad mode is per thread, and libraries run in the same process (lighteval) switch it off globally
    with torch.enable_grad():
        return Trainer(job, callbacks).fit()


def _digest(tensors) -> int:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return int(h.hexdigest()[:12], 16)


def check_ranks(model: torch.nn.Module, local: PackedBatch) -> str:
    """Data-parallel ranks must hold identical weights and see different data. SmolLM3 lost 1T tokens to
    ranks that were seeded alike where they should not have been; this check fails fast instead."""
    world = torch.distributed.get_world_size()
    mine = torch.tensor([_digest(model.state_dict().values()), _digest([local.input_ids])], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    torch.distributed.all_gather(everyone, mine)
    weights = {int(t[0]) for t in everyone}
    data = [int(t[1]) for t in everyone]
    if len(weights) != 1:
        raise RuntimeError("data-parallel ranks start from different weights: check seeding and broadcasting")
    if len(set(data)) != world:
        raise RuntimeError("data-parallel ranks received identical batches: check the data sharding")
    return f"{world} ranks: identical weights, distinct data"


def _mean_across_ranks(value: float, world: int) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t) / world


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def export_hf(model: torch.nn.Module, state: dict[str, torch.Tensor], tokenizer_dir: Path, out: Path) -> None:
    """A Hugging Face folder (config, safetensors, tokenizer) that transformers loads as is."""
    import shutil

    model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


def main(argv: list[str] | None = None) -> int:
    """Entry point for launchers: `python -m compass.model.trainer JOB.json` (torchrun / deepspeed run it per
    rank); rank 0 writes `result.json` beside the job."""
    args = argv if argv is not None else sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    job_path = Path(args[0])
    result = train_stage(TrainJob.read(job_path))
    rank, _, _ = dist_env()
    if rank == 0:
        (job_path.parent / "result.json").write_text(json.dumps(result.__dict__))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
