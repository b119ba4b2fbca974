"""Pretraining throughput: compass's trainer against a bare torch loop with the same settings (the same model,
attention backend, chunked loss, AdamW and clipping: what compass adds is its loop, callbacks, metrics,
prefetching and checkpoints), with torch.compile off and on, and against Hugging Face's Trainer on the same model
and packed data, with transformers' own attention and loss and with compass's (then only the loops differ).
Tokens/s over the timed steps after warm-up.

    python benchmarks/pretrain_throughput.py [--steps 40] [--engine torch|deepspeed] [--rounds 3] [--seq 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from harness import (
    Run,
    child,
    fixture_job,
    interleave,
    name_results,
    note,
    peak_rss_mib,
    pin_threads,
    report,
    write_result,
)

REPO = Path(__file__).resolve().parent.parent
VOCAB = 8192  # the demo's largest tokenizer candidate: the loss costs what it costs at that size


def prepare(work: Path, steps: int, engine: str, seq: int, batch: int):
    """The minimal spec's data (fixture corpus) and the demo's architecture at a vocabulary of VOCAB."""
    from compass.specs import load_spec

    demo = load_spec(REPO / "specs" / "examples" / "tiny.yaml").spec.what.architecture
    return fixture_job(work, steps=steps, seq=seq, batch=batch, micro=batch,
                       architecture={**demo.model_dump(), "vocab_size": VOCAB},
                       parallelism={"deepspeed": engine == "deepspeed"}, checkpoints={"every_steps": 10**9})


def packed_batches(job, n: int):
    from compass.model.training.packing import RowPacker
    from compass.model.training.token_files import TokenizedSource

    stage = job.recipe.current
    sources = {k: TokenizedSource(v) for k, v in job.sources.items()}
    packer = RowPacker(sources, stage.mixture, stage.sequence_length, seed=job.recipe.seed,
                       rows=stage.global_batch_size)
    return [packer.next_batch() for _ in range(n)]


def hf_model(job, attention: str | None = None):
    from compass.model.architecture import build_model, hf_config
    from compass.model.attention import DOCUMENT_SDPA

    special = {"bos": job.special_ids.eos, "eos": job.special_ids.eos, "pad": job.special_ids.pad}
    return build_model(hf_config(job.recipe.architecture, job.vocab_size, special, job.recipe.max_positions),
                       job.recipe.seed, attention or DOCUMENT_SDPA)


def steps_of(job) -> int:
    s = job.recipe.current
    return int(s.tokens // (s.global_batch_size * s.sequence_length))


def tokens_per_step(job) -> int:
    return job.recipe.current.global_batch_size * job.recipe.current.sequence_length


def run_compass(job, warmup: int, compile_: bool) -> float:
    from compass.model.training.callbacks import Callback
    from compass.model.training.trainer import train_stage

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    stamps: list[float] = []

    class Clock(Callback):
        def post_step(self, trainer, record):
            stamps.append(time.perf_counter())

    train_stage(job.with_how(compile=compile_), callbacks=[Clock()])
    timed = len(stamps) - 1 - warmup  # from the end of step `warmup` to the end of the last step but one
    return timed * tokens_per_step(job) / (stamps[-2] - stamps[warmup - 1])


def run_bare(job, warmup: int, compile_: bool) -> float:
    """What one writes by hand with compass's model code: the same batches, AdamW, clip, step."""
    import torch

    from compass.model.lm import CausalLMWithLoss

    lm = CausalLMWithLoss(hf_model(job))
    if compile_:
        lm.compile()
    opt = torch.optim.AdamW(lm.parameters(), lr=job.recipe.optimizer.lr, betas=job.recipe.optimizer.betas)
    batches = packed_batches(job, steps_of(job))
    start = None
    for i, b in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        loss, _ = lm(**b.inputs(torch.device("cpu")))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (len(batches) - warmup) * tokens_per_step(job) / (time.perf_counter() - start)


def run_hf_trainer(job, warmup: int, compile_: bool, same_core: bool = False) -> float:
    """Hugging Face's Trainer on the same model and packed rows: transformers' sdpa attention (documents told
    apart by the position ids, a mask built per batch) and its cross-entropy on full logits; with `same_core`,
    compass's attention and chunked loss instead (the Trainer's loop alone differs from compass's)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    batches = packed_batches(job, steps_of(job))
    rows = [{"input_ids": b.input_ids[i], "position_ids": b.position_ids[i], "labels": b.labels[i]}
            for b in batches for i in range(len(b))]

    def collate(items: list[dict]) -> dict:
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                self.start = time.perf_counter()

    clock = Clock()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=len(batches[0]),
        max_steps=len(batches), learning_rate=job.recipe.optimizer.lr, report_to="none", save_strategy="no",
        logging_strategy="no", dataloader_drop_last=True, max_grad_norm=1.0, dataloader_num_workers=0,
        lr_scheduler_type="constant", remove_unused_columns=False, seed=job.recipe.seed, torch_compile=compile_)
    model = hf_model(job, None if same_core else "sdpa")
    if same_core:
        from compass.model.lm import CausalLMWithLoss

        class WithLoss(torch.nn.Module):  # what the Trainer calls: a module whose output holds the loss
            def __init__(self, hf: torch.nn.Module):
                super().__init__()
                self.lm = CausalLMWithLoss(hf)

            def forward(self, input_ids, position_ids, labels):  # noqa: ANN001 - the Trainer's batch
                return {"loss": self.lm(input_ids=input_ids, position_ids=position_ids, labels=labels)[0]}

        model = WithLoss(model)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[clock], data_collator=collate).train()
    return (len(batches) - warmup) * tokens_per_step(job) / (time.perf_counter() - clock.start)


VARIANTS = {"bare torch loop": (run_bare, False), "compass trainer": (run_compass, False),
            "bare torch loop + compile": (run_bare, True), "compass trainer + compile": (run_compass, True),
            "HF Trainer": (run_hf_trainer, False), "HF Trainer + compile": (run_hf_trainer, True),
            "HF Trainer with compass attention and loss": (partial(run_hf_trainer, same_core=True), False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", choices=["deepspeed", "torch"], default="torch")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        from compass.model.training.job import TrainJob

        pin_threads()
        name, job_path, warmup, out = args.child
        fn, compile_ = VARIANTS[name]
        write_result(out, fn(TrainJob.read(Path(job_path)), int(warmup), compile_), peak_mib=peak_rss_mib())
        return
    from compass.infra.environment import prepare_environment

    prepare_environment()
    work = Path(tempfile.mkdtemp(prefix="compass-bench-"))
    name_results(f"pretrain_throughput-{args.engine}")
    job = prepare(work, args.steps, args.engine, args.seq, args.batch)
    chosen = [v for v in args.variants.split(",") if v]

    def variant(name: str):
        def run() -> Run:
            run_dir = Path(tempfile.mkdtemp(dir=work))
            job.model_copy(update={"workdir": run_dir}).write(run_dir / "job.json")
            return child(__file__, [name, str(run_dir / "job.json"), str(args.warmup)], cwd=REPO)
        return run

    results = interleave({name: variant(name) for name in chosen}, args.rounds)
    title = (f"pretraining throughput: demo architecture (vocab {VOCAB}), seq {args.seq}, batch {args.batch}, "
             f"{args.steps} steps ({args.warmup} warm-up), compass engine {args.engine}, fp32 CPU")
    ratios = report(title, results, chosen[0], "tokens/s")
    for ours, theirs in (("compass trainer", "HF Trainer"), ("compass trainer + compile", "HF Trainer + compile"),
                         ("compass trainer + compile", "HF Trainer"),
                         ("compass trainer", "HF Trainer with compass attention and loss")):
        if {ours, theirs} <= set(chosen):
            note(f"{ours} vs {theirs}: {ratios[ours] / ratios[theirs]:.3f}")
    if {"compass trainer + compile", "bare torch loop + compile"} <= set(chosen):
        compiled = ratios["compass trainer + compile"] / ratios["bare torch loop + compile"]
        note(f"compiled: compass vs bare loop {compiled:.3f} (goal >= 0.95)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
