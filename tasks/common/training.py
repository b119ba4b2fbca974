"""What every training step shares (pretraining stages, long context, mid-training, ablation runs): binding a
recipe to files and hardware (a TrainJob), running it in-process or launched over several ranks, and turning
the trained checkpoints into the step's artifact.

World size 1 trains in-process; more ranks (data parallel, or several nodes) launch the same module,
`compass.model.training.trainer`, with torchrun or DeepSpeed's launcher (infra/launcher.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from compass.infra.launcher import LaunchPlan, plan_launch
from compass.infra.net import free_port
from compass.model.training.job import SpecialIds, StageRecipe, Staging, Telemetry, TrainJob
from compass.specs.how import SlurmCluster
from compass.tasks.data.tokenizer_files import tokenizer_ids
from compass.tasks.steps.context import StepContext, StepResult


def build_job(ctx: StepContext, recipe: StageRecipe, *, whole_from: int | None = None, tokens_before: int = 0,
              micro_batch_size: int | None = None) -> TrainJob:
    """The recipe bound to this step's inputs (tokenizer, tokenized sources, previous state) and `how`."""
    how = ctx.runtime.how
    tok_dir = ctx.inputs["tokenizer"].local() / "chosen"
    ids = tokenizer_ids(tok_dir)
    previous = ctx.inputs.get("previous")
    state = weights = None  # a previous stage's full training state, or a starting checkpoint's weights
    if previous is not None:
        folder = previous.local()
        state, weights = ((folder / "state", None) if (folder / "state").exists() else (None, folder / "final"))
    if how.storage.local_cache and ctx.store is not None:  # each node copies them (model/staging.py) first
        cache = Path(how.storage.local_cache).expanduser()
        tokens = ctx.inputs_with_prefix("tokens:")
        sources = {name: ctx.store.staged_path(art.uri, cache) for name, art in tokens.items()}
        staging = Staging(store_root=ctx.store.root, cache=cache, uris={n: a.uri for n, a in tokens.items()})
    else:
        sources, staging = ctx.local_inputs("tokens:"), None
    return TrainJob(
        recipe=recipe, workdir=ctx.workdir, tokenizer_dir=tok_dir,
        vocab_size=recipe.architecture.vocab_size or ids.vocab_size,
        special_ids=SpecialIds(eos=ids.eos, pad=ids.pad), sources=sources, staging=staging,
        init_from=state, init_weights=weights, whole_from=whole_from,
        tokens_before=tokens_before, micro_batch_size=micro_batch_size or how.parallelism.micro_batch_size,
        parallelism=how.parallelism, precision=how.precision, hardware=how.hardware, checkpoints=how.checkpoints,
        attention=how.attention, compile=how.compile, loss=how.loss, telemetry=telemetry_of(ctx))


def telemetry_of(ctx: StepContext) -> Telemetry:
    mon = ctx.runtime.how.monitoring
    return Telemetry(run=ctx.runtime.run, step=f"{ctx.kind}:{ctx.name}",
                     folder=ctx.runtime.monitoring_dir(ctx.store, ctx.workdir), prometheus=mon.prometheus,
                     listen=mon.listen, port=mon.port, tensorboard=mon.tensorboard)


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


def run_training(job: TrainJob, log, cluster: SlurmCluster | None = None) -> dict[str, Any]:
    """Run the trainer on the job: as a Slurm job when `how.orchestration.cluster` says so, else in-process for
    one rank, launched (torchrun or DeepSpeed) for several."""
    workdir = job.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    job_path = workdir / "job.json"
    job.write(job_path)
    nodes = job.hardware.nodes
    if cluster is not None:
        from compass.infra.slurm import run_on_slurm

        return run_on_slurm(slurm_shape(job, job_path), cluster, sys.executable,
                            label=f"{workdir.parent.name}-{workdir.name[:24]}",
                            port=job.hardware.rendezvous_port if job.world_size > 1 else free_port(), log=log)
    if job.world_size == 1:
        import torch.distributed as dist

        from compass.model.training.trainer import train_stage

        with _single_rank_env(fresh_port=not dist.is_initialized()):
            result = train_stage(job).__dict__
        (workdir / "result.json").write_text(json.dumps(result))
        return result
    hosts = job.hardware.hosts
    if nodes > 1 and not hosts:  # a spec may be planned and costed without them, not launched
        raise ValueError(f"how.hardware.nodes is {nodes} but how.hardware.hosts is empty: list the nodes' "
                         "addresses, the rendezvous host first")
    plan = plan_launch(job_path, world=job.world_size, nodes=nodes, hosts=hosts, launcher=job.hardware.launcher,
                       port=job.hardware.rendezvous_port if nodes > 1 else free_port(), python=sys.executable,
                       cwd=workdir)
    if plan.hostfile:
        (workdir / "hostfile").write_text(plan.hostfile)
    for command in plan.commands:
        log.info("launching on %s: %s", command.host, command)
    _run_all(plan, workdir)
    return json.loads((workdir / "result.json").read_text())


def slurm_shape(job: TrainJob, job_path: Path):
    """The job as the Slurm executor sees it (ranks over nodes, GPUs per node)."""
    from compass.infra.slurm import JobShape

    hw = job.hardware
    return JobShape(job.workdir, job_path, hw.nodes, job.world_size // hw.nodes,
                    hw.devices_per_node if hw.accelerator != "cpu" else None)


def _run_all(plan: LaunchPlan, workdir: Path) -> None:
    """Start every node's launcher, wait for all; one failing stops the others (they would wait forever)."""
    logs = [open(workdir / f"launcher-{i}.log", "w") for i in range(len(plan.commands))]  # noqa: SIM115
    procs = [subprocess.Popen(c.argv, cwd=workdir, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **plan.env})
             for c, f in zip(plan.commands, logs, strict=True)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None or all(code == 0 for code in codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    if failed is not None:
        tail = (workdir / f"launcher-{failed}.log").read_text()[-3000:]
        raise RuntimeError(f"training failed on {plan.commands[failed].host} "
                           f"({procs[failed].returncode}); last output:\n{tail}")


def plot_loss(metrics: Path, out: Path, title: str) -> None:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    out.write_bytes(loss_png(rows, title))


def loss_png(rows: list[dict[str, Any]], title: str, dpi: int = 100) -> bytes:
    """Training loss against tokens seen, one line per stage (points marked while there are few)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from compass.tasks.common.plots import use_token_axis

    fig, ax = plt.subplots(figsize=(7, 4))
    for stage in dict.fromkeys(r["stage"] for r in rows):
        ax.plot([r["tokens"] for r in rows if r["stage"] == stage], [r["loss"] for r in rows if r["stage"] == stage],
                label=stage, marker="o" if len(rows) < 30 else None, markersize=3)
    use_token_axis(ax)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


def train_and_export(ctx: StepContext, job: TrainJob, label: str,
                     export: Callable[[Path], None] | None = None) -> StepResult:
    """Train one stage (resuming from the work folder or the store's mirror), then write the artifact: the
    final HF model, the training state the next stage continues from, every kept checkpoint, metrics and
    the loss curve. `export` adjusts each exported HF folder (e.g. the long-context inference scaling)."""
    mirror = None
    if ctx.store is not None and ctx.store.is_remote:
        from compass.infra.checkpoint_mirror import CheckpointMirror

        mirror = CheckpointMirror(ctx.store, ctx.work_key, ctx.workdir / "checkpoints")
        restored = mirror.restore()
        if restored:
            ctx.log.info("resuming from %s, recovered from the store", restored)
        mirror.start()
    try:
        result = run_training(job, ctx.log, ctx.runtime.how.orchestration.cluster)
    finally:
        if mirror:
            mirror.stop()
    from compass.model.training import checkpoints as ckpt

    kept = ckpt.complete_checkpoints(ctx.workdir / "checkpoints")
    final = kept[-1]
    shutil.copytree(final / "hf", ctx.out / "final")
    shutil.copytree(final, ctx.out / "state", ignore=shutil.ignore_patterns("hf"))
    for folder in kept:
        shutil.copytree(folder / "hf", ctx.out / "checkpoints" / folder.name)
    if export:
        for folder in [ctx.out / "final", *sorted((ctx.out / "checkpoints").iterdir())]:
            export(folder)
    previous_metrics = ctx.inputs["previous"].local() / "metrics.jsonl" if "previous" in ctx.inputs else None
    history = previous_metrics.read_text() if previous_metrics and previous_metrics.exists() else ""
    (ctx.out / "metrics.jsonl").write_text(history + (ctx.workdir / "metrics.jsonl").read_text())
    plot_loss(ctx.out / "metrics.jsonl", ctx.out / "loss.png", f"{ctx.name}: loss over all stages so far")
    rows = [json.loads(line) for line in (ctx.workdir / "metrics.jsonl").read_text().splitlines() if line]
    first, last = rows[0]["loss"], result["final_loss"]
    mean_tps = sum(r["tokens_per_s"] for r in rows) / len(rows)
    metrics = {"steps": result["steps"], "tokens": result["tokens"], "first_loss": first, "final_loss": last,
               "val_loss": result["val_loss"], "tokens_per_s": mean_tps,
               "mfu": sum(r["mfu"] for r in rows) / len(rows), "resumed_from": result["resumed_from"],
               "checkpoints": [p.name for p in kept], "monitor_events": result.get("events", []),
               "parallel": result.get("rank_check", ""), "setup": result.get("setup", {})}
    val = ", ".join(f"{k} {v:.3f}" for k, v in result["val_loss"].items())
    summary = (f"### {label} `{ctx.name}`\n\n{result['steps']} steps, {result['tokens']:,} tokens; "
               f"loss {first:.3f} -> {last:.3f}; validation loss: {val}; {mean_tps:,.0f} tokens/s")
    for event in result.get("events", []):
        summary += (f"\n\n**{event['kind']}** at step {event['step']} ({event['detail']}), action {event['action']}: "
                    f"{event['cause']}. {event['remedy']}.")
    table = [{"step": r["step"], "loss": round(r["loss"], 4), "lr": r["lr"], "grad_norm": round(r["grad_norm"], 3)}
             for r in rows[:: max(1, len(rows) // 20)]]
    return StepResult(metrics=metrics, summary=summary, tables={"loss": table})
