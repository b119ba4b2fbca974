"""What every training step shares (pretraining stages, long context, mid-training, ablation runs): binding a
recipe to files and to its phase's shape (a TrainJob), running it where the step's placement says, and turning
the trained checkpoints into the step's artifact.

One rank trains in-process; more ranks run the same module, `compass.model.training.trainer`: launched here with
torchrun or DeepSpeed's launcher (infra/launcher.py), or, inside the step's Slurm job, started with srun over the
job's nodes (infra/slurm.py).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from compass.infra.disk_full import clear_full_disk_notes, ended_on_a_full_disk
from compass.infra.errors import StopRequested
from compass.infra.exits import clear_retriable, raise_if_retriable
from compass.infra.launcher import TRAINER_MODULE
from compass.infra.layout import (
    CONTINUED_PARTS,
    CheckpointFolder,
    ModelArtifact,
    TokenizerArtifact,
    WorkFolder,
)
from compass.infra.net import free_port
from compass.model.training.job import SpecialIds, StageRecipe, Staging, Telemetry, TrainJob
from compass.model.training.records import MetricsRow, TrainResult, goodput_table, read_metrics, write_metrics
from compass.specs.how import Shape
from compass.tasks.common.inputs import TrainingInputs
from compass.tasks.common.plots import figure_png, use_token_axis
from compass.tasks.common.tracking import tracker_run_of
from compass.tasks.data.tokenizer_files import tokenizer_ids
from compass.tasks.steps.backends import Ranks, launcher_for
from compass.tasks.steps.context import Runtime, StepContext, StepResult
from compass.tasks.steps.placement import HERE, Placement


def build_job(ctx: StepContext, recipe: StageRecipe, *, whole_from: int | None = None, tokens_before: int = 0,
              micro_batch_size: int | None = None, exports_evaluated: bool = True) -> TrainJob:
    """The recipe bound to this step's inputs (tokenizer, tokenized sources, previous state) and `how`.
    `exports_evaluated`: the step's artifact is evaluated (its kind reads MODEL_TRAINER_HOW), so with
    how.evaluation.every_checkpoint no export is pruned before that."""
    how = ctx.runtime.how
    given = ctx.given(TrainingInputs)
    tok_dir = TokenizerArtifact(given.tokenizer.local()).chosen
    ids = tokenizer_ids(tok_dir)
    previous = given.previous
    state = weights = None  # a previous stage's full training state, or a starting checkpoint's weights
    if previous is not None:
        state, weights = ModelArtifact(previous.local(*CONTINUED_PARTS)).continues_from()
    if how.storage.local_cache and ctx.store is not None:  # each node copies them (model/training/staging.py) first
        cache = Path(how.storage.local_cache).expanduser()
        sources = {name: ctx.store.staged_path(art.uri, cache) for name, art in given.tokens.items()}
        capacity = how.storage.local_cache_gib
        staging = Staging(store_root=ctx.store.root, cache=cache, uris={n: a.uri for n, a in given.tokens.items()},
                          capacity_bytes=int(capacity * 1024**3) if capacity is not None else None)
    else:
        sources, staging = {name: art.local() for name, art in given.tokens.items()}, None
    hardware, parallelism = how.hardware, how.parallelism
    if micro_batch_size:  # the stage's own (long context)
        parallelism = parallelism.model_copy(update={"micro_batch_size": micro_batch_size})
    shape = ctx.runtime.placement.shape
    if shape is not None:  # the phase's nodes and devices; data parallel over what tensor parallelism leaves
        hardware = hardware.model_copy(update={"nodes": shape.nodes, "devices_per_node": shape.devices_per_node,
                                               "hosts": hardware.hosts[:shape.nodes]})  # the first ones, locally
        group = parallelism.tensor_parallel * parallelism.pipeline_parallel
        parallelism = parallelism.model_copy(update={"data_parallel": max(1, shape.ranks // group)})
    return TrainJob(
        recipe=recipe, workdir=ctx.workdir, tokenizer_dir=tok_dir,
        vocab_size=recipe.architecture.vocab_size or ids.vocab_size,
        special_ids=SpecialIds(eos=ids.eos, pad=ids.pad), sources=sources, staging=staging,
        init_from=state, init_weights=weights, whole_from=whole_from,
        tokens_before=tokens_before, how=how.model_copy(update={"hardware": hardware, "parallelism": parallelism}),
        keep_exports_until_evaluated=exports_evaluated and how.evaluation.every_checkpoint,
        telemetry=telemetry_of(ctx))


def telemetry_of(ctx: StepContext) -> Telemetry:
    mon = ctx.runtime.how.monitoring
    return Telemetry(run=ctx.runtime.run, step=f"{ctx.kind}:{ctx.name}",
                     folder=ctx.runtime.monitoring_dir(ctx.store, ctx.workdir), prometheus=mon.prometheus,
                     listen=mon.listen, port=mon.port, tensorboard="tensorboard" in mon.trackers,
                     trackers=tracker_run_of(ctx))


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
_PORT: list[int] = []  # the port of this process's single-rank group, once initialised


@contextmanager
def _single_rank_env(fresh_port: bool) -> Iterator[None]:
    """A private rendezvous for one in-process rank while it trains (DeepSpeed reads it at every
    initialisation), removed afterwards so that processes started later (torchrun, lighteval) do not inherit
    it and try to bind the same port."""
    if fresh_port or not _PORT:
        _PORT[:] = [free_port()]
    saved = {k: os.environ.get(k) for k in RENDEZVOUS}
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_PORT[0]), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class NoTrainResult(FileNotFoundError):
    """The ranks ended without `result.json`: they were asked to stop (they checkpointed and left; under Slurm the
    job requeues itself) or died before the stage's end without a retriable reason."""


def run_training(job: TrainJob, log, placement: Placement = HERE) -> TrainResult:
    """Run the trainer on the job where the step's placement says: one rank in this process; several started by
    the placement's backend (tasks/steps/backends/: torchrun here or over ssh to how.hardware.hosts; srun over
    the step's Slurm job's nodes as how.orchestration.cluster.launch says). A stop asked before the time limit (the
    ranks checkpointed and left) ends the step without a result: the Slurm job's batch shell requeues it."""

    work = WorkFolder(job.workdir)
    job.workdir.mkdir(parents=True, exist_ok=True)
    job.write(work.train_job)
    if job.world_size == 1:
        from compass.model.training import collectives
        from compass.model.training.trainer import train_stage

        with _single_rank_env(fresh_port=not collectives.active()):
            result = train_stage(job)
        result.write(work.train_result)
        return result

    work.train_result.unlink(missing_ok=True)
    clear_retriable(job.workdir)
    clear_full_disk_notes(job.workdir)
    code = launcher_for(placement).start_ranks(
        Ranks(TRAINER_MODULE, work.train_job, job.world_size, job.hardware, job.hardware.launcher), job.how, log)
    if work.train_result.exists():
        return TrainResult.read(work.train_result)
    checkpoints = work.complete_checkpoints()
    if work.stop_file.exists() and checkpoints:

        raise StopRequested(checkpoints[-1].step)
    ended_on_a_full_disk(job.workdir)
    raise_if_retriable(job.workdir)  # the batch shell requeues the job under its budget
    raise NoTrainResult(errno.ENOENT, f"the training ranks ended ({code}) without writing their result (a stop "
                        f"asked of the run makes them checkpoint and leave); their output: {work.slurm_log} under "
                        "Slurm, the launcher logs in the work folder here", str(work.train_result))


def run_module_ranks(module: str, job_path: Path, world: int, shape: Shape, runtime: Runtime, log) -> None:
    """Start `world` ranks of `python -m module job_path` (a TRL step's ranks, lighteval's) with the step's launcher:
    srun over its Slurm job's nodes, or torchrun here (over ssh to how.hardware.hosts for several nodes). The job
    file's folder is the ranks' working folder."""
    how = runtime.how
    hardware = how.hardware.model_copy(update={"nodes": shape.nodes,
                                               "hosts": how.hardware.hosts if shape.nodes > 1 else []})
    clear_full_disk_notes(job_path.parent)
    clear_retriable(job_path.parent)
    code = launcher_for(runtime.placement).start_ranks(Ranks(module, job_path, world, hardware), how, log)
    if code:
        ended_on_a_full_disk(job_path.parent)
        raise_if_retriable(job_path.parent)  # the batch shell requeues the job under its budget
        raise RuntimeError(f"the ranks of {module} ended with {code}; their output is in the job's log")


def plot_loss(metrics: Path, out: Path, title: str) -> None:
    out.write_bytes(loss_png(read_metrics(metrics), title))


SMOOTH_FROM = 30  # points of a stage from which its loss is drawn smoothed over the faint raw series


def smoothed(values: list[float], weight: float = 0.9) -> list[float]:
    """An exponential moving average, debiased at the start (TensorBoard's smoothing)."""
    out, average = [], 0.0
    for i, value in enumerate(values, 1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**i))
    return out


def loss_png(rows: list[MetricsRow], title: str, dpi: int = 100) -> bytes:
    """Training loss against tokens seen, one line per stage: points marked while there are few; from SMOOTH_FROM
    on, the raw series faint and its moving average over it (a per-step loss is mostly noise at a glance)."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, ax = plt.subplots(figsize=(7, 4))
    for i, stage in enumerate(dict.fromkeys(r.stage for r in rows)):
        tokens, losses = [r.tokens for r in rows if r.stage == stage], [r.loss for r in rows if r.stage == stage]
        colour = f"C{i % 10}"
        many = len(tokens) >= SMOOTH_FROM
        ax.plot(tokens, losses, label=stage, color=colour, alpha=0.3 if many else 1.0,
                marker=None if many else "o", markersize=3, linewidth=0.8 if many else 1.5)
        if many:
            ax.plot(tokens, smoothed(losses), label=f"{stage} (smoothed)", color=colour, linewidth=1.8)
    use_token_axis(ax)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return figure_png(fig, dpi)


def train_and_export(ctx: StepContext, job: TrainJob, label: str,
                     export: Callable[[Path], None] | None = None) -> StepResult:
    """Train one stage (resuming from the work folder or the store's mirror), then write the artifact: the
    final HF model, the training state the next stage continues from, every kept checkpoint, metrics and
    the loss curve. `export` adjusts each exported HF folder (e.g. the long-context inference scaling)."""
    work = WorkFolder(ctx.workdir)
    mirrors = []
    if ctx.store is not None and ctx.store.is_remote:
        from compass.infra.checkpoint_mirror import CheckpointMirror

        mirror = CheckpointMirror(ctx.store, ctx.work_key, work.checkpoints)
        restored = mirror.restore()
        if restored:
            ctx.log.info("resuming from %s, recovered from the store", restored)
        mirrors.append(mirror)
        if job.keep_exports_until_evaluated:  # the pruned checkpoints' exports, for the artifact's evaluation
            pending = CheckpointMirror(ctx.store, ctx.work_key, work.evaluation_pending)
            if recovered := pending.restore_every():
                ctx.log.info("recovered %d exports waiting for evaluation from the store", len(recovered))
            mirrors.append(pending)
        for mirror in mirrors:
            mirror.start()
    try:
        result = run_training(job, ctx.log, ctx.runtime.placement)
    finally:
        for mirror in mirrors:
            mirror.stop()
    from compass.model.training import checkpoints as ckpt

    out = ModelArtifact(ctx.out)
    kept = [CheckpointFolder(p) for p in ckpt.complete_checkpoints(work.checkpoints)]
    final = kept[-1]
    shutil.copytree(final.hf, out.final)
    shutil.copytree(final.root, out.state, ignore=shutil.ignore_patterns(final.hf.name))
    # the exports (the others hold training state only: how.checkpoints.hf_export_every), with those pruned before
    # every-checkpoint evaluation scored them
    exports = work.everything_to_evaluate()
    for folder in exports:
        shutil.copytree(folder.hf, out.checkpoints / folder.root.name)
    if export:
        for folder in [out.final, *out.kept_checkpoints()]:
            export(folder)
    continued = ctx.given(TrainingInputs).previous
    history = read_metrics(ModelArtifact(continued.local(*CONTINUED_PARTS)).metrics) if continued else []
    rows = read_metrics(work.metrics)
    write_metrics(out.metrics, history + rows)
    plot_loss(out.metrics, out.loss_plot, f"{ctx.name}: loss over all stages so far")
    first, last = rows[0].loss, result.final_loss
    mean_tps = sum(r.tokens_per_s or 0.0 for r in rows) / len(rows)
    metrics = {"steps": result.steps, "tokens": result.tokens, "first_loss": first, "final_loss": last,
               "val_loss": result.val_loss, "tokens_per_s": mean_tps,
               "mfu": sum(r.mfu or 0.0 for r in rows) / len(rows), "resumed_from": result.resumed_from,
               "checkpoints": [p.root.name for p in kept],
               "exports": [p.root.name for p in exports],
               "goodput": result.goodput.model_dump(mode="json") if result.goodput else None,
               "monitor_events": [e.model_dump(mode="json", exclude_none=True) for e in result.events],
               "parallel": result.rank_check, "setup": result.setup.model_dump(mode="json"),
               "ranks": [r.model_dump(mode="json") for r in result.ranks]}
    val = ", ".join(f"{k} {v:.3f}" for k, v in result.val_loss.items())
    summary = (f"### {label} `{ctx.name}`\n\n{result.steps} steps, {result.tokens:,} tokens; "
               f"loss {first:.3f} -> {last:.3f}; validation loss: {val}; {mean_tps:,.0f} tokens/s"
               + (f"; {result.goodput.line()}" if result.goodput else ""))
    for event in result.events:
        summary += (f"\n\n**{event.kind}** at step {event.step} ({event.detail}), action {event.action}: "
                    f"{event.cause}. {event.remedy}.")
    table = [{"step": r.step, "loss": round(r.loss, 4), "lr": r.lr, "grad_norm": round(r.grad_norm or 0.0, 3)}
             for r in rows[:: max(1, len(rows) // 20)]]
    return StepResult(metrics=metrics, summary=summary, tables={"loss": table, **goodput_table(result.goodput)})
