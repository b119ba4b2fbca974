"""The training loop for one stage: the same code in-process on CPU and under torchrun/deepspeed on GPUs.

A TrainJob (JSON) says everything: architecture, optimizer, the schedule over all stages, which stage to
train, where the tokenized sources are, what to continue from, and where to keep checkpoints. Running the
same job again resumes from its newest complete checkpoint and produces bitwise the same weights on CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from compass.model import checkpoint as ckpt
from compass.model.architecture import build_model, hf_config, parameter_groups
from compass.model.engine import DeepSpeedEngine, TorchEngine, dist_env, init_distributed
from compass.model.monitors import Event, TrainingMonitor, TrainingStopped
from compass.model.packing import PackedBatch, Packer
from compass.model.schedules import shape_from_config
from compass.specs.architecture import Architecture
from compass.specs.costs import flops_per_token
from compass.tasks.tokenize import TokenizedSource
from tqdm import tqdm

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


def load_job(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def cpu_peak_tflops() -> float:
    """A measured fp32 matmul peak for MFU on CPU (there is no data-sheet number to use)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    start = time.perf_counter()
    for _ in range(8):
        a @ b
    return 8 * 2 * 1024**3 / (time.perf_counter() - start) / 1e12


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy on next tokens (labels already -100 across document boundaries), plus z-loss."""
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    if z_loss > 0:
        valid = target != -100
        lse = torch.logsumexp(logits, dim=-1)[valid]
        return ce + z_loss * (lse**2).mean(), ce
    return ce, ce


def training_device(accelerator: str) -> torch.device:
    """The local GPU of this rank when `how` names one and CUDA is present, else the CPU."""
    _, _, local_rank = dist_env()
    if accelerator != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def model_inputs(batch: PackedBatch, masking: bool, device: torch.device) -> dict[str, Any]:
    inputs = {"input_ids": batch.input_ids.to(device), "position_ids": batch.position_ids.to(device),
              "use_cache": False}
    if masking:
        inputs["attention_mask"] = batch.attention_mask().to(device)
    return inputs


def forward(engine, batch: PackedBatch, masking: bool, device: torch.device, precision: str) -> Any:
    if device.type == "cuda" and precision == "bf16" and isinstance(engine, TorchEngine):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return engine(**model_inputs(batch, masking, device))
    return engine(**model_inputs(batch, masking, device))


def train_stage(job: dict[str, Any]) -> StageResult:
    # grad mode is per thread, and libraries run in the same process (lighteval) switch it off globally
    with torch.enable_grad():
        return _train_stage(job)


def _train_stage(job: dict[str, Any]) -> StageResult:
    rank, world, _ = dist_env()
    workdir = Path(job["workdir"])
    ckpt_root = workdir / "checkpoints"
    arch = Architecture.model_validate(job["architecture"])
    opt = job["optimizer"]
    par = job["parallelism"]
    stage = next(s for s in job["stages"] if s["name"] == job["stage"])
    shape = shape_from_config(job["schedule"], job["stages"])
    offset = sum(s.steps for s in shape.stages[: [s.name for s in shape.stages].index(stage["name"])])
    stage_steps = next(s.steps for s in shape.stages if s.name == stage["name"])
    micro = job.get("micro_batch_size") or par["micro_batch_size"]
    gbs, seq = stage["global_batch_size"], stage["sequence_length"]
    if gbs % (micro * world):
        raise ValueError(f"global batch {gbs} is not a multiple of micro-batch {micro} x world {world}")
    accumulation = gbs // (micro * world)

    sources = {name: TokenizedSource(Path(path)) for name, path in job["sources"].items()}
    vocab = job["vocab_size"]
    special = {"bos": job["special_ids"]["eos"], "eos": job["special_ids"]["eos"], "pad": job["special_ids"]["pad"]}
    config = hf_config(arch, vocab, special, max_positions=job["max_positions"])
    model = build_model(config, job["seed"])
    device = training_device(job["accelerator"])
    groups = parameter_groups(model, opt["weight_decay"], job["embedding_weight_decay"])
    if par["deepspeed"]:
        if device.type == "cpu":
            init_distributed("gloo")  # on GPUs DeepSpeed initialises NCCL itself
        engine: TorchEngine | DeepSpeedEngine = DeepSpeedEngine(model, groups, opt, accumulation, micro,
                                                                par["zero_stage"], job["precision"])
    else:
        init_distributed("gloo" if device.type == "cpu" else "nccl")
        engine = TorchEngine(model.to(device), groups, opt, accumulation)
    packer = Packer(sources, stage["mixture"], seq, seed=job["seed"] + 7919 * (offset + 1),
                    whole_from=job.get("whole_from"), pad_id=special["pad"])

    resumed = ckpt.newest_valid(ckpt_root)
    start = 0
    if resumed is not None:
        extra = engine.load(resumed)
        packer.load_state_dict(extra["packer"])
        ckpt.set_rng_state(extra["rng"])
        start = extra["stage_step"]
        log.info("resuming %s from %s (step %d of %d)", stage["name"], resumed.name, start, stage_steps)
    elif job.get("init_from"):
        engine.load(Path(job["init_from"]), load_optimizer=not stage.get("reset_optimizer", False))
        log.info("continuing from the previous stage's final state %s", job["init_from"])

    metrics_path = workdir / "metrics.jsonl"
    _truncate_metrics(metrics_path, offset + start)
    peak = (job.get("peak_tflops") or cpu_peak_tflops()) * world
    flops_tok = flops_per_token(arch, vocab, seq)
    every, keep_last = job["checkpoint_every"], job["keep_last"]
    masking = job["intra_document_masking"]
    monitor = TrainingMonitor(job["monitors"])
    events: list[dict[str, Any]] = []
    rollbacks = 0
    last_loss = float("nan")
    engine_model = engine.module
    engine_model.train()
    rank_check = "single process"
    bar = tqdm(total=stage_steps, initial=start, desc=stage["name"], unit="step",
               disable=rank != 0 or not sys.stderr.isatty())
    step = start
    while step < stage_steps:
        t0 = time.perf_counter()
        batch = packer.next_batch(gbs)
        local = batch.slice(rank * gbs // world, (rank + 1) * gbs // world)
        if world > 1 and step == start:
            rank_check = check_ranks(engine_model, local)
        total_loss = 0.0
        for m in range(accumulation):
            part = local.slice(m * micro, (m + 1) * micro)
            out = forward(engine, part, masking, device, job["precision"])
            loss, ce = lm_loss(out.logits, part.labels.to(device), arch.z_loss)
            if getattr(out, "aux_loss", None) is not None and arch.moe:
                loss = loss + arch.moe.load_balancing_coef * out.aux_loss
            engine.backward(loss)
            total_loss += float(ce.detach()) / accumulation
            if m < accumulation - 1:
                engine.micro_step()
        last_loss = _mean_across_ranks(total_loss, world)
        grad_norm = engine.grad_norm()
        event = monitor.check_before_step(offset + step + 1, last_loss, grad_norm)
        if event is not None:
            events.append(event.as_dict())
            log.warning(event.describe())
            if event.action == "stop":
                raise TrainingStopped(event)
            if event.action == "rollback":
                rollbacks += 1
                if rollbacks > job["monitors"]["max_rollbacks"]:
                    raise TrainingStopped(event, f"(more than {job['monitors']['max_rollbacks']} rollbacks)")
                step = _rollback(engine, ckpt_root, event, metrics_path, offset)
                monitor.forget_since_rollback()
                bar.n = step
                continue  # the packer keeps its position: the offending batches are skipped
        lr = opt["lr"] * shape.lr_factor(offset + step)
        engine.step(lr, grad_norm)
        elapsed = time.perf_counter() - t0
        tokens = gbs * seq
        for later in monitor.record(offset + step + 1, last_loss, tokens / elapsed):
            events.append(later.as_dict())
            log.warning(later.describe())
            if later.action == "stop":
                raise TrainingStopped(later)
        if rank == 0:
            record = {"step": offset + step + 1, "stage": stage["name"], "stage_step": step + 1, "loss": last_loss,
                      "grad_norm": grad_norm, "lr": lr,
                      "tokens": job.get("tokens_before", 0) + (offset + step + 1) * tokens,
                      "tokens_per_s": tokens / elapsed, "mfu": flops_tok * tokens / elapsed / (peak * 1e12),
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            if device.type == "cuda":
                record["gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.3f}", lr=f"{lr:.1e}")
            if (step + 1) % max(1, stage_steps // 20) == 0 or step + 1 == stage_steps:
                log.info("%s step %d/%d loss %.4f lr %.2e grad %.2f %.0f tok/s", stage["name"], step + 1,
                         stage_steps, last_loss, lr, grad_norm, record["tokens_per_s"])
        step += 1
        if step % every == 0 or step == stage_steps:
            _save(engine, ckpt_root, step, packer, job, offset)
            if rank == 0:
                ckpt.prune(ckpt_root, keep_last, keep={stage_steps})
    bar.close()
    if rank == 0 and events:
        with open(workdir / "events.jsonl", "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)
    val = evaluate(engine, job, masking, device) if rank == 0 else {}
    return StageResult(stage_steps, stage_steps * gbs * seq, last_loss, val,
                       int(resumed.name.split("-")[1]) if resumed else None, rank_check, events)


def _rollback(engine, root: Path, event: Event, metrics_path: Path, offset: int) -> int:
    """Restore the newest good checkpoint's weights, optimizer and RNG; return its stage step."""
    engine.discard()
    good = ckpt.newest_valid(root)
    if good is None:
        raise TrainingStopped(event, "(no checkpoint to roll back to yet)")
    extra = engine.load(good)
    ckpt.set_rng_state(extra["rng"])
    _truncate_metrics(metrics_path, offset + extra["stage_step"])
    log.warning("rolled back to %s; skipping the batches since then", good.name)
    return extra["stage_step"]


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


def _truncate_metrics(path: Path, keep_through_step: int) -> None:
    """On resume, drop metric lines written after the checkpoint (they will be written again)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= keep_through_step]
    path.write_text("".join(ln + "\n" for ln in lines))


def _save(engine, root: Path, stage_step: int, packer: Packer, job: dict, offset: int) -> None:
    rank, world, _ = dist_env()
    root.mkdir(parents=True, exist_ok=True)
    final = ckpt.step_dir(root, stage_step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if world > 1:
        torch.distributed.barrier()
    extra = {"packer": packer.state_dict(), "rng": ckpt.rng_state(), "stage_step": stage_step,
             "global_step": offset + stage_step, "engine": engine.name}
    engine.save(tmp, extra)
    state = engine.export_state_dict()
    if rank == 0:
        export_hf(engine.module, state, Path(job["tokenizer_dir"]), tmp / "hf")
    if world > 1:
        torch.distributed.barrier()
    if rank == 0:
        ckpt.finalize(tmp, final)
    if world > 1:
        torch.distributed.barrier()


def export_hf(model: torch.nn.Module, state: dict[str, torch.Tensor], tokenizer_dir: Path, out: Path) -> None:
    """A Hugging Face folder (config, safetensors, tokenizer) that transformers loads as is."""
    model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


def evaluate(engine, job: dict[str, Any], masking: bool, device: torch.device) -> dict[str, float]:
    """Validation loss per mixture source at the end of the stage."""
    seq = next(s for s in job["stages"] if s["name"] == job["stage"])["sequence_length"]
    sources = {name: Path(path) for name, path in job["sources"].items()}
    return heldout_losses(engine.module, sources, seq, masking, device)


@torch.no_grad()
def heldout_losses(model: torch.nn.Module, sources: dict[str, Path], seq_len: int, masking: bool,
                   device: torch.device, max_sequences: int = 16) -> dict[str, float]:
    """Mean next-token loss per source on its held-out documents, packed without mixing sources."""
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    for name, path in sorted(sources.items()):
        held = TokenizedSource(path, "heldout")
        if held.n_documents == 0:
            continue
        packer = Packer({name: held}, {name: 1.0}, seq_len, seed=0)
        n = min(max_sequences, max(1, len(held.tokens) // seq_len))
        losses = []
        for _ in range(n):
            batch = packer.next_batch(1)
            logits = model(**model_inputs(batch, masking, device)).logits
            losses.append(float(lm_loss(logits, batch.labels.to(device), 0.0)[1]))
        out[name] = sum(losses) / len(losses)
    model.train(was_training)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point for launchers: `python -m model.trainer JOB.json` (torchrun / deepspeed run it per rank)."""
    args = argv if argv is not None else sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    job_path = Path(args[0])
    result = train_stage(load_job(job_path))
    rank, _, _ = dist_env()
    if rank == 0:
        (job_path.parent / "result.json").write_text(json.dumps(result.__dict__))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
