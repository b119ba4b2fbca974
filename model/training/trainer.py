"""The training loop for one stage: the same code in-process on CPU and under torchrun/deepspeed on GPUs.

A TrainJob says everything: the recipe (architecture, optimizer, the schedule over all stages, which stage to
train), where the tokenized sources are, what to continue from, where to keep checkpoints, and how to run
(attention backend, loss kernel, compile, precision, parallelism). Running the same job again resumes from its
newest complete checkpoint and produces bitwise the same weights on CPU (compile off).

The loop draws batches (packed ahead on a thread, each rank only its own rows), accumulates gradients with one
host sync per optimizer step, and steps the optimizer; metrics, progress, monitors and checkpoints are callbacks
(model/training/callbacks.py). Checkpoints are snapshotted to host memory and written on a background thread.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from compass.infra.die_with_parent import die_with_parent
from compass.infra.disk_full import full_disk_met, note_full_disk
from compass.infra.errors import StopRequested
from compass.infra.exits import broken_collective, failed_device
from compass.infra.layout import (
    CheckpointFolder,
    WorkFolder,
)
from compass.model import attention
from compass.model.architecture import build_model, hf_config, load_pretrained, parameter_groups
from compass.model.lm import CausalLMWithLoss
from compass.model.loss import resolve as resolve_loss
from compass.model.training import checkpoints as ckpt
from compass.model.training import collectives, rank_device
from compass.model.training.callbacks import (
    Callback,
    Checkpointing,
    MetricsFile,
    Monitoring,
    Progress,
    Rollback,
    StopWhenAsked,
)
from compass.model.training.collective_ledger import CollectiveLedger
from compass.model.training.collectives import local_world_size, rank_env
from compass.model.training.engines import DeepSpeedEngine, Engine, TorchEngine
from compass.model.training.export_check import check_export, probe_batch, trained_loss
from compass.model.training.goodput import process_start
from compass.model.training.goodput_ledger import GoodputLedger
from compass.model.training.heldout import heldout_losses
from compass.model.training.hf_export import export_hf
from compass.model.training.job import TrainJob
from compass.model.training.monitors import Event, TrainingStopped
from compass.model.training.packing import PackedBatch, Prefetcher, RowPacker, merge_states, node_rows, rank_rows
from compass.model.training.rank_checks import rank_places, ranks_agree, start_digests, state_digests
from compass.model.training.rank_device import RankDevice
from compass.model.training.records import (
    CompileReport,
    DynamoCounts,
    MetricsRow,
    MonitorEvent,
    TrainingSetup,
    TrainResult,
)
from compass.model.training.schedules import schedule_shape
from compass.model.training.staging import stage_sources
from compass.model.training.telemetry import telemetry_callbacks
from compass.model.training.token_files import TokenizedSource
from compass.model.training.watchdog import HangWatchdog, process_group_timeout_s
from compass.model.training.windows import SourceSize, stage_windows
from compass.specs.costs import flops_per_token

log = logging.getLogger("compass.train")


PEAK_ROUNDS = 6  # timed rounds of the CPU matmul peak: the fastest is the peak


def cpu_peak_tflops() -> float:
    """A measured fp32 matmul peak for MFU on CPU (there is no data-sheet number to use): the fastest of a few
    rounds, since one round slowed by another process's burst gave a low peak and an MFU above 1 (1.11 in a
    demo's rows). Its operands come from a generator of its own: measured after a resume restored torch's, a draw
    from that would shift it."""
    numbers = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 1024, generator=numbers), torch.randn(1024, 1024, generator=numbers)
    a @ b
    fastest = math.inf
    for _ in range(PEAK_ROUNDS):
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        fastest = min(fastest, time.perf_counter() - start)
    return 4 * 2 * 1024**3 / fastest / 1e12


def training_device(accelerator: str) -> tuple[torch.device, RankDevice]:
    """This rank's GPU when `how` names one and CUDA is present, else the CPU (model/training/rank_device.py; a GPU
    spec's rank only in a rehearsal); with the GPU it opens, or would open."""
    place = rank_device.resolve(accelerator)
    rank_device.refuse_cpu_ranks(accelerator, place.type == "cuda")
    if place.type == "cuda":
        torch.cuda.set_device(place.index)
    return torch.device(place.torch_device), place


def cpu_rank_kernels(job: TrainJob, cuda: bool) -> tuple[TrainJob, list[str]]:
    """A GPU spec's rank computing on the CPU (a rehearsal on CPU ranks: no CUDA here) keeps every setting but the
    CUDA-only kernels, which give way to their reference through the same dispatch; what was replaced is said."""
    if cuda or job.hardware.accelerator == "cpu":
        return job, []
    update: dict[str, str] = {}
    said: list[str] = []
    dropout = job.recipe.architecture.dropout > 0  # varlen has none: per-document SDPA then
    if job.attention in ("auto", "flash") and not dropout:  # a GPU rank's kernel takes the lengths: so does this one
        update["attention"] = "varlen"
        said.append(f"attention {job.attention} -> varlen (a GPU rank's varlen kernels need CUDA: their "
                    "per-document reference, fed the same lengths)")
    elif problem := attention.unavailable(job.attention, cuda=False):
        update["attention"] = "sdpa"
        said.append(f"attention {job.attention} -> sdpa ({problem})")
    if job.loss == "liger":
        update["loss"] = "chunked"
        said.append("loss liger -> chunked (Liger's fused kernel needs CUDA)")
    return job.with_how(**update), said


LARGE_MODEL = 1_000_000_000  # parameters from which checkpoints export to Hugging Face every 10th time only


def default_callbacks(job: TrainJob, parameters: int) -> list[Callback]:
    """Monitors first (they may veto the step), then the metrics line, progress, and checkpoints last."""
    export_every = job.checkpoints.hf_export_every or (1 if parameters < LARGE_MODEL else 10)
    callbacks = [Monitoring(job.recipe.monitors, on_gpu=job.hardware.accelerator != "cpu"),
                 MetricsFile(WorkFolder(job.workdir).metrics), Progress(),
                 Checkpointing(job.checkpoints.every_steps, job.checkpoints.keep_last, export_every,
                               WorkFolder(job.workdir).evaluation_pending if job.keep_exports_until_evaluated
                               else None)]
    callbacks += telemetry_callbacks(job.telemetry)  # Prometheus endpoint, TensorBoard
    callbacks.append(HangWatchdog(job.hang_timeout_s, workdir=job.workdir))
    if os.environ.get("COMPASS_STOP_FILE"):  # launched by a scheduler that may ask for a stop (infra/slurm.py)
        callbacks.append(StopWhenAsked(Path(os.environ["COMPASS_STOP_FILE"])))
    return callbacks


class Trainer:
    """One stage of training. `fit()` resumes from the newest complete checkpoint in the job's work folder (or
    starts from `init_from`), trains to the stage's last step and returns the stage's result."""

    def __init__(self, job: TrainJob, callbacks: list[Callback] | None = None, started_at: float | None = None):
        """`started_at`: when this attempt began (a rank's process start; None: now, for training in-process)."""
        started_at = time.time() if started_at is None else started_at
        self.rank, self.world, local_rank = rank_env()
        recipe = job.recipe
        self.stage = recipe.current
        self.tp = job.parallelism.tensor_parallel
        self.held = held_dtype(job.parallelism.deepspeed, job.precision)  # the weights' dtype inside the engine
        gbs = self.stage.global_batch_size
        if job.staging is not None:  # every node reads its own verified copy of the data (model/training/staging.py)
            rows = node_rows(self.rank, local_rank, local_world_size(), self.world, self.tp, gbs)
            job = job.model_copy(update={"sources": stage_sources(job.staging, local_rank, rows, gbs, job.workdir,
                                                                  recipe=recipe)})
        self.job = job
        self.shape = schedule_shape(recipe.schedule, recipe.stages)
        names = [s.name for s in self.shape.stages]
        self.offset = sum(s.steps for s in self.shape.stages[: names.index(self.stage.name)])
        self.stage_steps = self.shape.stages[names.index(self.stage.name)].steps
        self.resumed: Path | None = None
        self.dp, self.dp_rank, self.tp_rank = self.world // self.tp, self.rank // self.tp, self.rank % self.tp
        if gbs % (job.micro_batch_size * self.dp):
            raise ValueError(f"global batch {gbs} is not a multiple of micro-batch {job.micro_batch_size} x data "
                             f"parallel {self.dp}")
        self.accumulation = gbs // (job.micro_batch_size * self.dp)
        self.checkpoint_root = WorkFolder(job.workdir).checkpoints
        job.workdir.mkdir(parents=True, exist_ok=True)
        self.device, self.place = training_device(job.hardware.accelerator)
        cuda = self.device.type == "cuda"
        job, substituted = cpu_rank_kernels(job, cuda)
        self.job = job
        loss = resolve_loss(job.loss)  # `auto` picks liger where installed: not under ZeRO-3 (below)
        if job.parallelism.sharding_stage == 3:  # ZeRO-3 or FSDP2
            loss = "recomputed"  # the head's weight is whole only inside its own forward (liger: refused)
        dropout = recipe.architecture.dropout > 0
        self.attention, self.loss_kind = attention.implementation(job.attention, cuda, dropout), loss
        self.sequence_lengths = attention.takes_sequence_lengths(self.attention)
        self.dynamo_start: DynamoCounts | None = None  # set where the model is compiled
        ckpt.seed_rngs(recipe.seed)  # a resumed run's checkpoints then hold the generators an uninterrupted run's do
        self.lm = self._model()
        self.parameters = sum(p.numel() for p in self.lm.parameters())  # whole: counted before any sharding
        self.engine = self._engine(self.lm)
        self.setup = TrainingSetup(attention=self.attention, loss=loss, compile=job.compile, precision=job.precision,
                                   engine=self.engine.name, sharding=self.engine.sharding,
                                   gradients=self.engine.gradients,
                                   prefetch=job.prefetch,
                                   async_checkpoints=job.checkpoints.asynchronous,
                                   data_from=str(job.staging.cache) if job.staging else "store",
                                   substituted=substituted)
        rows = rank_rows(self.dp_rank, self.dp, gbs)  # TP peers: the same rows
        sources = {n: TokenizedSource(p) for n, p in job.sources.items()}
        self.windows = stage_windows(recipe, {n: SourceSize(s.n_documents, s.n_tokens) for n, s in sources.items()})
        self.packer = RowPacker(sources, self.stage.mixture,
                                self.stage.sequence_length, seed=recipe.seed + 7919 * (self.offset + 1), rows=gbs,
                                owned=rows, whole_from=job.whole_from, pad_id=job.special_ids.pad,
                                masking=recipe.intra_document_masking, windows=self.windows)
        self._probe = probe_batch(self.lm.hf.config.vocab_size, self.stage.sequence_length)  # the export check's
        self.ledger = GoodputLedger(WorkFolder(job.workdir).goodput, started_at, self.rank)  # where its time goes
        self.callbacks = [*default_callbacks(job, self.parameters), self.ledger, *(callbacks or [])]
        self.writer = ckpt.CheckpointWriter(background=job.checkpoints.asynchronous)
        self.step = 0  # optimizer steps of this stage done so far
        self.events: list[MonitorEvent] = []
        self.last_loss = float("nan")
        self.data_state: dict[str, Any] = {}  # the data position after the last batch consumed
        self.written: Path | None = None  # a checkpoint submitted to the writer, not yet announced
        self.checkpoint_blocked_s = 0.0  # time the loop waited on checkpoints since the last metrics line
        self.stop_asked_here: Callable[[], bool] = lambda: False  # a scheduler's stop request (StopWhenAsked)
        self.stop_asked = False  # ... on any rank, as of the last step
        self.monitor_stop: Event | None = None  # a monitor's stop decided on this rank (callbacks.Monitoring)
        self.monitor_stopped = False  # ... on any rank, as of the last step

    # --- set-up -------------------------------------------------------------------------------------------
    def _model(self) -> CausalLMWithLoss:
        job, recipe = self.job, self.job.recipe
        arch = recipe.architecture
        if job.init_weights is not None:  # a starting checkpoint: its own class and config
            hf = load_pretrained(job.init_weights, recipe.max_positions, arch.positions.rope_theta, self.attention)
        else:
            special = {"bos": job.special_ids.eos, "eos": job.special_ids.eos, "pad": job.special_ids.pad}
            hf = build_model(hf_config(arch, job.vocab_size, special, max_positions=recipe.max_positions),
                             recipe.seed, self.attention)
        if job.parallelism.activation_checkpointing:  # recompute each layer's activations in the backward pass
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.initial = state_digests(hf.state_dict(), self.held) if self.tp > 1 else {}
        lm = CausalLMWithLoss(hf, arch.z_loss, arch.moe.load_balancing_coef if arch.moe else 0.0, self.loss_kind)
        if job.compile:
            self.dynamo_start = DynamoCounts.read()  # the report counts what this stage compiles
            lm.compile()  # in place: parameter names (and so checkpoints) stay those of the eager model
        return lm

    def _engine(self, lm: CausalLMWithLoss) -> Engine:
        job, recipe = self.job, self.job.recipe
        groups = parameter_groups(lm.hf, recipe.optimizer.weight_decay, recipe.architecture.embedding_weight_decay)
        par = job.parallelism
        # the group is opened here, its timeout past the hang watchdog's; DeepSpeed adopts an open group (its own would
        # time out after DeepSpeed's 10 minutes, before the hang watchdog could say where each rank waits)
        backend = "gloo" if self.device.type == "cpu" else "nccl"
        collectives.init(backend, process_group_timeout_s(self.job.hang_timeout_s))
        if collectives.world_size() > 1:  # the hang watchdog names the ranks that did not join a collective
            collectives.keep_ledger(CollectiveLedger(WorkFolder(job.workdir).collective_ledger, self.rank,
                                                     socket.gethostname()))
        if par.engine_name == "fsdp2":
            from compass.model.training.fsdp2 import FSDP2Engine

            decay = recipe.optimizer.weight_decay, recipe.architecture.embedding_weight_decay
            return FSDP2Engine(lm, lambda hf: parameter_groups(hf, *decay), recipe.optimizer,  # built on the host:
                               self.accumulation, job.precision, par.shard_group, par.reshard_after_forward,
                               par.tensor_parallel, job.how.reduce_precision,  # sharding moves it block by block
                               device=self.device)  # groups of the sharded parameters
        if par.deepspeed:
            return DeepSpeedEngine(lm, groups, recipe.optimizer, self.accumulation, job.micro_batch_size,
                                   par.zero_stage, job.precision, backend, par.tensor_parallel,
                                   job.how.reduce_precision)
        return TorchEngine(lm.to(self.device), groups, recipe.optimizer, self.accumulation,
                           job.how.reduce_precision if job.precision != "fp32" else "fp32")

    @property
    def tokens_per_step(self) -> int:
        return self.stage.global_batch_size * self.stage.sequence_length

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
        self.events.append(event.as_record())
        log.warning(event.describe())

    # --- the loop -----------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        resumed = self.resumed = self._resume()
        self.data_state = self.packer.state_dict()
        batches = Prefetcher(self.packer, self.job.prefetch) if self.job.prefetch else None
        log.info("%s: attention %s, loss %s, compile %s, %s, engine %s, prefetch %d, %s checkpoints",
                 self.stage.name, self.attention, self.loss_kind, self.job.compile, self.job.precision,
                 self.engine.name, self.job.prefetch, "async" if self.job.checkpoints.asynchronous else "sync")
        self._dispatch("on_start")
        peak = (self.job.peak_tflops or cpu_peak_tflops()) * self.world
        flops_tok = flops_per_token(self.job.recipe.architecture, self.job.vocab_size, self.stage.sequence_length)
        rank_check = "single process"
        places = rank_places(self.rank, self.world, self.place)
        first = True
        self.engine.module.train()
        try:
            while self.step < self.stage_steps:
                self._announce_written()
                self._dispatch("pre_step")
                local, wait = self._next_batch(batches)
                if self.world > 1 and first:
                    rank_check = self._check_ranks(local)
                first = False
                t0 = time.perf_counter()
                loss_t, norm_t = self._accumulate(local), self.engine.grad_norm()
                if self.device.type == "cuda":  # the kernels' time is compute, not waiting on other ranks
                    torch.cuda.synchronize(self.device)
                ta = time.perf_counter()
                loss, grad_norm = self._read(loss_t, norm_t)  # the step's one host sync
                t1 = time.perf_counter()
                try:
                    self._dispatch("before_update", loss, grad_norm)
                except Rollback as rollback:
                    self.restore_newest_checkpoint(rollback.event)
                    continue  # the data keeps its position: the offending batches are skipped
                lr = self.job.recipe.optimizer.lr * self.shape.lr_factor(self.global_step)
                self.engine.step(lr, norm_t)
                t2 = time.perf_counter()
                self.step += 1
                self.last_loss = loss
                times = {"data_wait_s": wait, "forward_backward_s": ta - t0, "sync_s": t1 - ta, "optimizer_s": t2 - t1}
                self._dispatch("post_step", self._record(loss, grad_norm, lr, times, flops_tok, peak))
            self.checkpoint_blocked_s += self.settle_checkpoint_writes()
        except BaseException as exc:
            self._dispatch("on_error", exc)
            raise
        finally:
            if batches is not None:
                batches.close()
        self._dispatch("on_end")
        seq, gbs = self.stage.sequence_length, self.stage.global_batch_size
        masking = self.job.recipe.intra_document_masking
        sharded = self.tp > 1 or self.job.parallelism.sharding_stage == 3  # ZeRO-3 or FSDP2
        scored = self.rank == 0 or sharded  # every rank holding shards joins each forward (gathers, TP collectives)
        val = {}
        validation_start = time.perf_counter()
        if scored:
            with self._precision():
                val = heldout_losses(self.lm, self.job.sources, seq, masking, self.device)
        val = val if self.rank == 0 else {}
        goodput = self.ledger.finish(time.perf_counter() - validation_start)
        return TrainResult(steps=self.stage_steps, tokens=self.stage_steps * gbs * seq, final_loss=self.last_loss,
                           val_loss=val, resumed_from=CheckpointFolder(resumed).step if resumed else None,
                           rank_check=rank_check, events=self.events, setup=self.setup, ranks=places,
                           compiled=CompileReport.since(self.dynamo_start) if self.dynamo_start else None,
                           goodput=goodput)

    def _next_batch(self, batches: Prefetcher | None) -> tuple[PackedBatch, float]:
        if batches is None:
            start = time.perf_counter()
            batch = self.packer.next_batch()
            self.data_state = self.packer.state_dict()
            return batch, time.perf_counter() - start
        batch, self.data_state, wait = batches.next()
        return batch, wait

    def _accumulate(self, local: PackedBatch) -> torch.Tensor:
        """Forward and backward over the rank's micro-batches; the cross-entropy summed as a tensor (no host
        sync between micro-batches)."""
        micro = self.job.micro_batch_size
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for m in range(self.accumulation):
            part = local.slice(m * micro, (m + 1) * micro)
            loss, ce = self._forward(part)
            self.engine.backward(loss)
            total += ce.detach().double() / self.accumulation
            if m < self.accumulation - 1:
                self.engine.micro_step()
        return total

    def _forward(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = batch.inputs(self.device, sequence_lengths=self.sequence_lengths)
        with self._precision():
            return self.engine(**inputs)

    def _precision(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.job.precision, isinstance(self.engine, TorchEngine))

    def _read(self, loss: torch.Tensor, norm: torch.Tensor) -> tuple[float, float]:
        """The loss (averaged over ranks) and gradient norm as numbers: one transfer for both. A stop asked on
        any rank (`stop_asked_here`), and a monitor's stop decided on one rank from its own timings (`monitor_stop`),
        ride in the loss's all-reduce: every rank learns them at no extra collective, and they stop together."""
        flags = [float(self.stop_asked_here()), float(self.monitor_stop is not None)]
        mine = torch.tensor(flags, dtype=torch.float64, device=loss.device)
        if self.world > 1:
            summed = collectives.all_reduce(torch.cat([loss.double().reshape(1), mine]))
            loss, anywhere = summed[0] / self.world, summed[1:]
        else:
            anywhere = mine
        values = torch.cat([torch.stack([loss.double(), norm.to(loss.device).double()]), anywhere]).tolist()
        self.stop_asked = values[2] > 0
        self.monitor_stopped = values[3] > 0
        return values[0], values[1]

    def _record(self, loss: float, grad_norm: float, lr: float, times: dict[str, float], flops_tok: float,
                peak: float) -> MetricsRow:
        tokens = self.stage.global_batch_size * self.stage.sequence_length
        elapsed = sum(times.values())
        row = MetricsRow(step=self.global_step, stage=self.stage.name, stage_step=self.step,
                         stage_steps=self.stage_steps, loss=loss, grad_norm=grad_norm, lr=lr,
                         tokens=self.job.tokens_before + self.global_step * tokens, tokens_per_s=tokens / elapsed,
                         mfu=flops_tok * tokens / elapsed / (peak * 1e12),
                         **{k: round(v, 6) for k, v in times.items()},
                         checkpoint_s=round(self.checkpoint_blocked_s, 6),
                         rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                         gpu_mem_mb=torch.cuda.max_memory_allocated(self.device) / 2**20
                         if self.device.type == "cuda" else None)
        self.checkpoint_blocked_s = 0.0
        return row

    # --- checkpoints --------------------------------------------------------------------------------------
    def _resume(self) -> Path | None:
        """Continue from the newest complete checkpoint of this stage, else from the previous stage's state."""
        resumed = self._newest_valid()
        if resumed is not None:
            extra = self.engine.load(resumed)
            self.packer.load_state_dict(extra["packer"])
            ckpt.set_rng_state(extra["rng"])
            self.step = extra["stage_step"]
            # a stage whose last checkpoint is its last step (a failure after training: the export, the commit)
            # trains no step when resumed and still reports the loss it ended on
            self.last_loss = extra.get("last_loss", float("nan"))
            self._load_callback_states(extra.get("callbacks", {}))
            log.info("resuming %s from %s (step %d of %d)", self.stage.name, resumed.name, self.step,
                     self.stage_steps)
        elif self.job.init_from:
            self.engine.load(self.job.init_from, load_optimizer=not self.stage.reset_optimizer)
            log.info("continuing from the previous stage's final state %s", self.job.init_from)
        elif self.job.init_weights:
            log.info("starting from the checkpoint %s (fresh optimizer)", self.job.init_weights)
        return resumed

    def _newest_valid(self) -> Path | None:
        """The newest checkpoint every rank agrees is whole, each rank hashing its share of the files."""
        return ckpt.newest_valid(self.checkpoint_root, self.rank, self.world, collectives.any_rank)

    def save_checkpoint(self, export: bool = True) -> Path:
        """Snapshot model, optimizer, RNG and data position at this step to host memory; the writer thread
        writes, checksums and renames it into place (this returns as soon as the snapshot is taken). `export`:
        also a Hugging Face export of the whole model (gathered on rank 0)."""
        start = time.perf_counter()
        self.settle_checkpoint_writes()  # at most one write in flight
        self.checkpoint_root.mkdir(parents=True, exist_ok=True)
        final = ckpt.step_dir(self.checkpoint_root, self.step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self._barrier()
        extra = {"packer": self._all_data_states(), "rng": ckpt.rng_state(), "stage_step": self.step,
                 "global_step": self.global_step, "engine": self.engine.name, "callbacks": self._callback_states(),
                 "last_loss": self.last_loss}
        writes = self.engine.snapshot(tmp, extra)
        sharded = export and self.engine.write_hf_weights(CheckpointFolder(tmp).hf)  # FSDP2: from every rank's shards
        exported = self.engine.export_state_dict() if export and not sharded else {}  # ZeRO-3/TP: every rank joins
        trained = self._probe_loss() if export else 0.0  # a forward every rank joins (sharded weights)
        if self.rank == 0 and export:
            state = None if sharded else ckpt.to_host(exported)
            hf, tokenizer_dir, probe, precision = self.lm.hf, self.job.tokenizer_dir, self._probe, self.job.precision

            def write_export(out: Path) -> list[Path]:
                folder = CheckpointFolder(out).hf
                files = export_hf(hf, state, tokenizer_dir, folder)
                got = check_export(folder, probe, trained, precision)
                log.info("%s: the export scores %.6f on the fixed batch, the training model %.6f", out.name, got,
                         trained)
                return files

            writes.append(write_export)
        self.writer.submit(writes, tmp, ckpt.commit_when_all_written(tmp, final, self.rank, self.world))
        self.written = final
        self.checkpoint_blocked_s += time.perf_counter() - start
        return final

    def _probe_loss(self) -> float:
        """The training model's loss on the export check's fixed batch, through its engine."""
        return trained_loss(self.engine, self._probe.inputs(self.device, sequence_lengths=self.sequence_lengths),
                            self._precision())

    def _callback_states(self) -> dict[str, Any]:
        """Each stateful callback's state, by class name (rank 0's: the callbacks decide alike on every rank)."""
        states = {type(c).__name__: getattr(c, "state_dict", lambda: None)() for c in self.callbacks}
        return {name: state for name, state in states.items() if state is not None}

    def _load_callback_states(self, states: dict[str, Any]) -> None:
        for callback in self.callbacks:
            if type(callback).__name__ in states:
                callback.load_state_dict(states[type(callback).__name__])

    def settle_checkpoint_writes(self) -> float:
        """Wait for the checkpoint write in flight, then, every rank together, hand the written checkpoint to the
        callbacks (post_checkpoint; on rank 0 it is committed). What a callback calls before it ends the stage.
        Returns the seconds waited for the writer."""
        waited = self.writer.wait()
        self._barrier()
        self._announce_written()
        return waited

    def _announce_written(self) -> None:
        """Once the writer is done with a checkpoint, the callbacks hear of it (rank 0: it is committed)."""
        if self.written is not None and not self.writer.busy():
            self.writer.wait()  # raises what the write raised
            folder, self.written = self.written, None
            self._dispatch("post_checkpoint", folder)

    def _all_data_states(self) -> dict[str, Any]:
        """The data position of every row, gathered from every rank: resume works at any world size."""
        if self.world == 1:
            return self.data_state
        return merge_states(collectives.all_gather_object(self.data_state))

    def restore_newest_checkpoint(self, event: Event) -> None:
        """Roll back: the newest good checkpoint's weights, optimizer and RNG; the step count returns there."""
        self.settle_checkpoint_writes()
        self.engine.discard()
        good = self._newest_valid()
        if good is None:
            raise TrainingStopped(event, "(no checkpoint to roll back to yet)")
        extra = self.engine.load(good)
        ckpt.set_rng_state(extra["rng"])
        self.step = extra["stage_step"]
        log.warning("rolled back to %s; skipping the batches since then", good.name)
        self._dispatch("post_restore", self.step)

    def _check_ranks(self, local: PackedBatch) -> str:
        """Before the first step: every rank's weights and batch against the others' and, with tensor parallelism,
        the shards gathered against what the stage starts from (model/training/rank_checks.py)."""
        return ranks_agree(self.engine, local, dp_rank=self.dp_rank, tp_rank=self.tp_rank, tp=self.tp,
                           rank=self.rank, held=self.held,
                           reference=lambda: start_digests(self.resumed, self.job, self.initial, self.held))

    def _barrier(self) -> None:
        if self.world > 1:
            collectives.barrier()


def train_stage(job: TrainJob, callbacks: list[Callback] | None = None,
                started_at: float | None = None) -> TrainResult:
    # grad mode is per thread, and libraries run in the same process (lighteval) switch it off globally
    with torch.enable_grad():
        return Trainer(job, callbacks, started_at).fit()


def autocast(device: torch.device, precision: str, torch_engine: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast where the weights stay fp32 (the torch engine; DeepSpeed holds bf16 weights itself, FSDP2 casts
    by its policy): training and the stage-end validation alike, since flash-attn refuses fp32 inputs. On CUDA and
    on the CPU ranks of a rehearsal alike (validation refuses bf16 on a CPU spec): bf16 is rehearsed, not swapped
    for fp32."""
    if precision == "bf16" and torch_engine:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def held_dtype(deepspeed: bool, precision: str) -> torch.dtype:
    """The dtype an engine keeps the model's weights in: DeepSpeed converts them to bf16 or fp16 (its optimizer keeps
    fp32 masters); torch's engines keep fp32 weights and compute in bf16 under autocast."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32) if deepspeed else \
        torch.float32


def _stop_requested(signum: int, frame: Any) -> None:
    StopWhenAsked.signalled = True


def main(argv: list[str] | None = None) -> int:
    """Entry point for launchers: `python -m compass.model.training.trainer JOB.json` (torchrun / deepspeed run it per
    rank); rank 0 writes `result.json` beside the job."""

    # torchrun starts ranks in sessions of their own: a killed launcher must not leave them training
    die_with_parent(never_a_child_of_init=True)
    args = argv if argv is not None else sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    job_path = Path(args[0])
    signal.signal(signal.SIGUSR1, _stop_requested)
    rank, _, _ = rank_env()
    job = TrainJob.read(job_path)
    try:
        result = train_stage(job, started_at=process_start())  # the rank's start-up counts from its process's
    except StopRequested as stopped:
        log.warning("%s", stopped)
        collectives.leave()
        return 0  # no result.json: the job is requeued and resumes from the checkpoint
    except Exception as failed:  # a full disk named for the step that launched the ranks (infra/disk_full.py)
        if collectives.broke_a_collective(failed):  # a peer lost or a collective broken (NCCL, gloo): retriable
            return broken_collective(job.workdir, rank, failed)
        if (code := failed_device(job.workdir, rank, failed)) is not None:  # ECC, Xid, NVLink: retriable
            return code
        if (full := full_disk_met(failed, job.workdir)) is not None:
            note_full_disk(job.workdir, f"rank-{rank}", full)
        raise
    if rank == 0:
        result.write(WorkFolder(job.workdir).train_result)
    collectives.leave()
    return 0


if __name__ == "__main__":
    collectives.exit_process(main())
