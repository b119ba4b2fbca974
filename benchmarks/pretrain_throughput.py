"""Pretraining throughput: compass's trainer against a minimal hand-written torch loop and against Hugging
Face's Trainer, on the same model (the demo architecture), the same packed batches (intra-document masks)
and the same sequence length. Each variant runs in its own process; tokens/s are over the timed steps
(after warm-up), peak memory is the process's max RSS.

    python benchmarks/pretrain_throughput.py [--steps 40] [--engine deepspeed|torch]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compass.model.job import TrainJob

REPO = Path(__file__).resolve().parent.parent
WARMUP = 5


def prepare(store: Path, steps: int, engine: str) -> TrainJob:
    """Data steps of the minimal spec (fixtures), then a pretraining job with the demo's architecture."""
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.infra.store import Store
    from compass.specs import load_spec
    from compass.tasks.base import InputArtifact, Runtime, StepContext
    from compass.tasks.training import build_job

    loaded = load_spec(REPO / "tests" / "specs" / "minimal.yaml")
    demo = load_spec(REPO / "specs" / "examples" / "tiny.yaml").spec
    plan = compile_spec(loaded.spec)
    st = Store(str(store))
    run_in_process(plan.restricted_to({"ingest", "curate", "tokenizer", "tokenize"}), st, loaded.spec_hash,
                   Runtime(how=loaded.spec.how, base_dir=loaded.base_dir), logging.getLogger("bench"))
    step = plan.step("pretrain:stage1")
    inputs = {}
    for role, dep in step.inputs.items():
        uri = st.uri(*dep.split(":"), plan.fingerprints[dep])
        inputs[role] = InputArtifact(role, dep, uri, st.read_manifest(uri), st)
    how = loaded.spec.how
    how = how.model_copy(update={
        "parallelism": how.parallelism.model_copy(update={"deepspeed": engine == "deepspeed", "micro_batch_size": 8}),
        "checkpoints": how.checkpoints.model_copy(update={"every_steps": 10**9})})  # one final save, like the others
    seq, batch = 256, 8
    config = step.config
    stage = config.stages[0].model_copy(update={"tokens": steps * seq * batch, "sequence_length": seq,
                                                "global_batch_size": batch})
    recipe = config.model_copy(update={"architecture": demo.what.architecture, "stages": [stage],
                                       "monitors": config.monitors.model_copy(update={"throughput": None})})
    return build_job(StepContext("pretrain", "stage1", recipe, inputs, store, store, store / "work",
                                 Runtime(how=how), logging.getLogger("bench")), recipe)


def packed_batches(job: TrainJob, n: int):
    from compass.model.packing import Packer
    from compass.model.token_files import TokenizedSource

    stage = job.recipe.current
    sources = {k: TokenizedSource(v) for k, v in job.sources.items()}
    packer = Packer(sources, stage.mixture, stage.sequence_length, seed=job.recipe.seed)
    return [packer.next_batch(stage.global_batch_size) for _ in range(n)]


def model_for(job: TrainJob):
    from compass.model.architecture import build_model, hf_config

    special = {"bos": job.special_ids.eos, "eos": job.special_ids.eos, "pad": job.special_ids.pad}
    return build_model(hf_config(job.recipe.architecture, job.vocab_size, special, job.recipe.max_positions),
                       job.recipe.seed)


def run_compass(job: TrainJob, timing: Path) -> None:
    from compass.model.trainer import train_stage

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    train_stage(job)
    rows = [json.loads(line) for line in (job.workdir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[WARMUP:]
    tokens = job.recipe.current.global_batch_size * job.recipe.current.sequence_length
    seconds = sum(tokens / r["tokens_per_s"] for r in timed)
    timing.write_text(json.dumps({"seconds": seconds, "steps": len(timed)}))


def run_minimal(job: TrainJob, timing: Path) -> None:
    """What one writes by hand: AdamW, packed batches with the block-diagonal mask, clip, step."""
    import torch
    import torch.nn.functional as F

    model = model_for(job)
    opt = torch.optim.AdamW(model.parameters(), lr=job.recipe.optimizer.lr, betas=job.recipe.optimizer.betas)
    batches = packed_batches(job, len(job_steps(job)))
    start = None
    for i, b in enumerate(batches):
        if i == WARMUP:
            start = time.perf_counter()
        logits = model(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=b.attention_mask(),
                       use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), b.labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    timing.write_text(json.dumps({"seconds": time.perf_counter() - start, "steps": len(batches) - WARMUP}))


def run_hf_trainer(job: TrainJob, timing: Path) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from compass.model.packing import PackedBatch

    batches = packed_batches(job, len(job_steps(job)))
    rows = [{"input_ids": b.input_ids[i], "position_ids": b.position_ids[i], "labels": b.labels[i],
             "segment_ids": b.segment_ids[i]} for b in batches for i in range(len(b))]

    def collate(items: list[dict]) -> dict:
        """Like the other two variants, the block-diagonal mask is built per batch, in the loop."""
        stacked = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        packed = PackedBatch(stacked["input_ids"], stacked["position_ids"], stacked.pop("segment_ids"),
                             stacked["labels"])
        return {**stacked, "attention_mask": packed.attention_mask()}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == WARMUP:
                self.start = time.perf_counter()

    clock = Clock()
    args = TrainingArguments(output_dir=str(timing.parent / "hf"), use_cpu=True, per_device_train_batch_size=len(
        batches[0]), max_steps=len(batches), learning_rate=job.recipe.optimizer.lr, report_to="none",
        save_strategy="no", logging_strategy="no", dataloader_drop_last=True, max_grad_norm=1.0,
        dataloader_num_workers=0,
        lr_scheduler_type="constant", remove_unused_columns=False, seed=job.recipe.seed)
    trainer = Trainer(model=model_for(job), args=args, train_dataset=rows, callbacks=[clock],
                      data_collator=collate)
    trainer.train()
    timing.write_text(json.dumps({"seconds": time.perf_counter() - clock.start, "steps": len(batches) - WARMUP}))


def job_steps(job: TrainJob) -> range:
    s = job.recipe.current
    return range(int(s.tokens // (s.global_batch_size * s.sequence_length)))


VARIANTS = {"minimal torch loop": run_minimal, "compass trainer": run_compass, "HF Trainer": run_hf_trainer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--engine", choices=["deepspeed", "torch"], default="deepspeed")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, job_path, timing = args.child
        VARIANTS[name](TrainJob.read(Path(job_path)), Path(timing))
        return
    from compass.infra.environment import prepare_environment

    prepare_environment()
    work = Path(tempfile.mkdtemp(prefix="compass-bench-"))
    job = prepare(work / "store", args.steps, args.engine)
    tokens = job.recipe.current.global_batch_size * job.recipe.current.sequence_length
    results = {}
    for name in VARIANTS:
        run_dir = work / name.replace(" ", "-")
        run_dir.mkdir()
        job_path = run_dir / "job.json"
        job.model_copy(update={"workdir": run_dir}).write(job_path)
        proc = subprocess.Popen([sys.executable, __file__, "--child", name, str(job_path), str(run_dir / "t.json")],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        if status:
            raise SystemExit(f"{name} failed; rerun its child command to see why")
        t = json.loads((run_dir / "t.json").read_text())
        results[name] = (t["steps"] * tokens / t["seconds"], usage.ru_maxrss / 1024)
    base_tps, base_mem = results["minimal torch loop"]
    print(f"pretraining throughput: demo architecture, seq 256, batch 8, {args.steps} steps ({WARMUP} warm-up), "
          f"compass engine {args.engine}, fp32 CPU")
    for name, (tps, mem) in results.items():
        print(f"  {name:20s} {tps:9,.0f} tokens/s  peak RSS {mem:6.0f} MiB  speed ratio vs minimal loop "
              f"{tps / base_tps:.3f}  memory ratio {mem / base_mem:.3f}")


if __name__ == "__main__":
    main()
