"""GPU training throughput and MFU of a SmolLM3-3B-shaped model (36 layers, 3.1B) at 4096 tokens per row, bf16,
with the best attention kernel installed (flash-attn varlen, else torch's varlen kernels), torch.compile and the
fused loss (Liger when installed, else compass's chunked loss): compass's trainer against a bare torch loop with
the same model code and against Hugging Face's Trainer (bf16, its own attention and loss, compiled). One GPU.

    pip install 'compass-lifecycle[gpu]'   # flash-attn, liger-kernel, nvidia-ml-py
    python benchmarks/gpu_throughput.py [--steps 30] [--warmup 10] [--rounds 3] [--micro 1]
    python benchmarks/gpu_throughput.py --tiny     # the same code on the CPU at a toy size (the suite runs it)

Without a CUDA device (and without --tiny) it prints "no CUDA device: skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from harness import Run, child, interleave, name_results, peak_rss_mib, pin_threads, report, write_result

SEQ = 4096
VOCAB = 128256
DOCUMENT_MEAN = 1500  # tokens: documents of a web mixture, several per 4096-token row


TINY_SEQ, TINY_VOCAB = 256, 512  # --tiny: the CPU path at a toy size


def architecture(tiny: bool = False):
    from compass.specs.architecture import Architecture

    if tiny:
        return Architecture(num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2,
                            positions={"kind": "rnope", "rope_theta": 50000, "nope_every": 4}, tied_embeddings=True,
                            vocab_size=TINY_VOCAB)
    return Architecture(num_layers=36, hidden_size=2048, ffn_size=11008, num_heads=16, num_kv_heads=4,
                        positions={"kind": "rnope", "rope_theta": 50000, "nope_every": 4}, tied_embeddings=True,
                        vocab_size=VOCAB)


def synthetic_source(folder: Path, documents: int = 4000, vocab: int = VOCAB, mean: int = DOCUMENT_MEAN) -> Path:
    """Random tokens in compass's token-file format, documents of random lengths (throughput only)."""
    import numpy as np

    from compass.model.training.token_files import token_dtype, write_meta, write_split

    rng = np.random.default_rng(0)
    dtype = token_dtype(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    lengths = rng.exponential(mean, documents).astype(int) + 32
    write_split(folder, "train", (rng.integers(2, vocab, n).tolist() for n in lengths), 0, dtype)
    write_split(folder, "heldout", (rng.integers(2, vocab, n).tolist() for n in lengths[:8]), 0, dtype)
    write_meta(folder, dtype, 0, vocab)
    return folder


def word_level_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A tokenizer of the model's vocabulary: the stage's final checkpoint exports a Hugging Face folder, which
    needs one (its words are never read: the source is synthetic tokens)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder.mkdir(parents=True, exist_ok=True)
    Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1")).save(str(folder / "tokenizer.json"))


def job(work: Path, steps: int, micro: int, attention: str = "auto", tiny: bool = False):
    """The stage every variant trains: bf16 on the GPU with compile; --tiny: fp32 on the CPU, uncompiled."""
    from compass.model.training.job import SpecialIds, StageRecipe, TrainJob
    from compass.specs.how import Checkpoints, Hardware, How, Parallelism
    from compass.specs.training import Monitors, Optimizer, PretrainStage, Schedule

    seq, vocab = (TINY_SEQ, TINY_VOCAB) if tiny else (SEQ, VOCAB)
    stage = PretrainStage(name="bench", tokens=steps * micro * seq, sequence_length=seq, global_batch_size=micro,
                          mixture={"web": 1.0})
    recipe = StageRecipe(architecture=architecture(tiny), optimizer=Optimizer(), schedule=Schedule(kind="constant"),
                         stages=[stage], stage="bench", seed=0, intra_document_masking=True,
                         monitors=Monitors(throughput=None, spike=None, slow_rise=None, plateau=None))
    word_level_tokenizer(work / "tokenizer", vocab)
    source = synthetic_source(work / "web", 400 if tiny else 4000, vocab, seq // 3 if tiny else DOCUMENT_MEAN)
    return TrainJob(recipe=recipe, workdir=work / "run", tokenizer_dir=work / "tokenizer", vocab_size=vocab,
                    special_ids=SpecialIds(eos=0, pad=0), sources={"web": source},
                    how=How(parallelism=Parallelism(deepspeed=False, micro_batch_size=micro),
                            precision="fp32" if tiny else "bf16", hardware=Hardware(accelerator="cpu" if tiny else
                                                                                    "h100"),
                            checkpoints=Checkpoints(every_steps=10**9, keep_last=1), attention=attention,
                            compile=not tiny, loss="auto"))


def on_gpu(job) -> bool:
    return job.hardware.accelerator != "cpu"


def synchronize(job) -> None:
    """Wait for the device's queued work before reading the clock (the CPU runs in order)."""
    import torch

    if on_gpu(job):
        torch.cuda.synchronize()


def device_of(job):
    import torch

    return torch.device("cuda" if on_gpu(job) else "cpu")


def seq_of(job) -> int:
    return job.recipe.current.sequence_length


DEVICE_PEAK = "device peak"  # the child that measures the device's dense bf16 matmul rate
MATMUL, MATMUL_ITERS = 8192, 50
NOMINAL_BF16 = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12}  # dense, vendor data sheets


def matmul_flops_per_s(cuda: bool = True) -> float:
    """The device's dense matmul rate (bf16 on the GPU, fp32 on the CPU), measured: what its kernels reach, the
    ceiling MFU is read against."""
    import torch

    if not cuda:
        from compass.model.training.trainer import cpu_peak_tflops

        return cpu_peak_tflops() * 1e12
    a, b = (torch.randn(MATMUL, MATMUL, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(10):  # warm-up: clocks up, cuBLAS's choice made
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(MATMUL_ITERS):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * MATMUL**3 * MATMUL_ITERS / (start.elapsed_time(end) / 1000)


def flops_per_step(job) -> float:
    from compass.specs.costs import flops_per_token

    return flops_per_token(job.recipe.architecture, job.vocab_size, seq_of(job)) * job.micro_batch_size * seq_of(job)


def run_compass(job, warmup: int, done=None) -> float:
    """compass's trainer on the stage; `done` receives the rate after the last timed step and may end the process
    there: the stage-end checkpoint of a 3B model (weights and AdamW state, ~37 GB) is not throughput, and on a
    GPU session's budget it took longer than the steps."""
    from compass.model.training.callbacks import Callback
    from compass.model.training.trainer import train_stage

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29551", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    steps = int(job.recipe.current.tokens // (job.micro_batch_size * seq_of(job)))
    stamps: list[float] = []

    def rate() -> float:  # the steps after the warm-up, the last step (its checkpoint) left out
        return (steps - 1 - warmup) / (stamps[steps - 2] - stamps[warmup - 1])

    class Clock(Callback):
        def post_step(self, trainer, record):
            synchronize(job)
            stamps.append(time.perf_counter())
            if len(stamps) == steps - 1 and done is not None:
                done(rate())

    train_stage(job, callbacks=[Clock()])
    return rate()


def batches(job, n: int):
    from compass.model.training.packing import RowPacker
    from compass.model.training.token_files import TokenizedSource

    packer = RowPacker({"web": TokenizedSource(job.sources["web"])}, {"web": 1.0}, seq_of(job), seed=0,
                       rows=job.micro_batch_size)
    return [packer.next_batch() for _ in range(n)]


def hf_model(job, attention: str):
    from compass.model.architecture import build_model, hf_config

    special = {"bos": 0, "eos": 0, "pad": 0}
    return build_model(hf_config(job.recipe.architecture, job.vocab_size, special, seq_of(job)), 0, attention)


def run_bare(job, warmup: int) -> float:
    import contextlib

    import torch

    from compass.model.attention import implementation, takes_sequence_lengths
    from compass.model.lm import CausalLMWithLoss
    from compass.model.loss import resolve

    gpu, device = on_gpu(job), device_of(job)
    attention = implementation(job.attention, cuda=gpu)
    lm = CausalLMWithLoss(hf_model(job, attention), loss=resolve("auto")).to(device)
    if job.compile:
        lm.compile()
    opt = torch.optim.AdamW(lm.parameters(), lr=2e-4, betas=(0.9, 0.95), fused=gpu)
    data = batches(job, int(job.recipe.current.tokens // (job.micro_batch_size * seq_of(job))))
    lengths = takes_sequence_lengths(attention)
    for i, b in enumerate(data):
        if i == warmup:
            synchronize(job)
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16) if gpu else contextlib.nullcontext():
            loss, _ = lm(**b.inputs(device, sequence_lengths=lengths))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    synchronize(job)
    return (len(data) - warmup) / (time.perf_counter() - start)


def run_hf_trainer(job, warmup: int) -> float:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from compass.model.attention import flash_kernel

    data = batches(job, int(job.recipe.current.tokens // (job.micro_batch_size * seq_of(job))))
    rows = [{"input_ids": b.input_ids[i], "position_ids": b.position_ids[i], "labels": b.labels[i]}
            for b in data for i in range(len(b))]

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                synchronize(job)
                self.start = time.perf_counter()

    clock = Clock()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=job.micro_batch_size, max_steps=len(data),
        learning_rate=2e-4, bf16=on_gpu(job), report_to="none", save_strategy="no", logging_strategy="no",
        max_grad_norm=1.0, lr_scheduler_type="constant", remove_unused_columns=False, torch_compile=job.compile,
        use_cpu=not on_gpu(job),
        use_liger_kernel=__import__("importlib.util").util.find_spec("liger_kernel") is not None)
    trainer = Trainer(model=hf_model(job, flash_kernel() or "sdpa"), args=args, train_dataset=rows, callbacks=[clock],
                      data_collator=lambda items: {k: torch.stack([it[k] for it in items]) for k in items[0]})
    trainer.train()
    synchronize(job)
    return (len(data) - warmup) / (time.perf_counter() - clock.start)


VARIANTS = {"bare torch loop": run_bare, "compass trainer": run_compass, "HF Trainer": run_hf_trainer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: "
                        + ", ".join(VARIANTS) + " (the bare torch loop is the baseline)")
    parser.add_argument("--attention", default="auto", choices=["auto", "flash", "varlen", "flex", "sdpa"],
                        help="how.attention for compass's trainer and the bare loop (HF's Trainer keeps its own)")
    parser.add_argument("--tiny", action="store_true", help="the same code on the CPU at a toy size (fp32, "
                        "uncompiled): what the suite runs where there is no GPU")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.tiny and not args.child:  # a child: its job says where
        print("no CUDA device: skipped")
        return
    if args.child and args.child[0] == DEVICE_PEAK:
        write_result(args.child[3], matmul_flops_per_s(cuda=args.child[1] == "cuda"), peak_mib=peak_rss_mib())
        return
    if args.child:
        from compass.model.training.job import TrainJob

        pin_threads()
        name, job_path, warmup, out = args.child

        def done(steps_per_s: float) -> None:  # the result written, the process ends (no teardown to wait for)
            gpu_mib = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
            write_result(out, steps_per_s, peak_mib=peak_rss_mib(), gpu_mib=gpu_mib)
            sys.stdout.flush()
            os._exit(0)

        job_read = TrainJob.read(Path(job_path))
        done(run_compass(job_read, int(warmup), done) if name == "compass trainer"
             else VARIANTS[name](job_read, int(warmup)))
    if args.tiny:
        name_results("gpu_throughput-tiny")  # never in place of a GPU's numbers
    work = Path(tempfile.mkdtemp(prefix="compass-gpu-bench-"))
    bench_job = job(work, args.steps, args.micro, args.attention, tiny=args.tiny)

    def variant(name: str):
        def go() -> Run:
            run_dir = Path(tempfile.mkdtemp(dir=work))
            bench_job.model_copy(update={"workdir": run_dir}).write(run_dir / "job.json")
            run = child(__file__, [name, str(run_dir / "job.json"), str(args.warmup)])
            print(f"  measured {name}: {run.value * tokens:,.0f} tokens/s, GPU {run.details['gpu_mib']:,.0f} MiB",
                  flush=True)  # a round's numbers survive a later variant's failure
            return run
        return go

    chosen = [name.strip() for name in args.variants.split(",")]
    if "bare torch loop" not in chosen or not set(chosen) <= set(VARIANTS):
        parser.error(f"--variants: a subset of {', '.join(VARIANTS)} that holds the baseline, bare torch loop")
    tokens = args.micro * seq_of(bench_job)
    results = interleave({name: variant(name) for name in chosen}, args.rounds)
    gpu = on_gpu(bench_job)
    device = torch.cuda.get_device_name() if gpu else "CPU"
    measured = child(__file__, [DEVICE_PEAK, "cuda" if gpu else "cpu", "0"]).value  # a process of its own
    nominal = next((flops for prefix, flops in NOMINAL_BF16.items() if prefix in device), None) if gpu else None
    peak = nominal or measured
    for runs in results.values():
        for r in runs:
            r.details["mfu"] = r.value * flops_per_step(bench_job) / peak
            r.details["mfu_measured"] = r.value * flops_per_step(bench_job) / measured
            r.value *= tokens
    n = sum(p.numel() for p in hf_model(bench_job, "sdpa").parameters())
    kind = "bf16, compile" if gpu else "fp32, uncompiled (--tiny)"
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    report(f"{'GPU' if gpu else 'CPU'} throughput: SmolLM3-shaped {size}, {tokens // args.micro} tokens/row, "
           f"micro-batch {args.micro}, {kind}, attention {args.attention}, {device}", results, "bare torch loop",
           "tokens/s",
           notes=[f"device peak: {device}'s dense {'bf16' if gpu else 'fp32'} matmul measured here at "
                  f"{measured / 1e12:,.2f} TFLOP/s; nominal "
                  + (f"{nominal / 1e12:,.0f} TFLOP/s" if nominal else "unknown for this device (MFU is against the "
                     "measured peak)"),
                  f"MFU = tokens/s x FLOPs per token / {peak / 1e12:,.2f} TFLOP/s; FLOPs per token = 6 N "
                  "(N: every matmul weight, the output head included) + 12 L H Q T for attention (PaLM's "
                  "convention: the full T x T product, twice what a causal kernel computes), specs/costs.py",
                  "MFU (median): " + ", ".join(f"{k} {sorted(r.details['mfu'] for r in v)[len(v) // 2]:.1%}"
                                                for k, v in results.items()),
                  "MFU against the measured matmul peak (median): " + ", ".join(
                      f"{k} {sorted(r.details['mfu_measured'] for r in v)[len(v) // 2]:.1%}"
                      for k, v in results.items()),
                  "GPU memory (median MiB): " + ", ".join(
                      f"{k} {sorted(r.details['gpu_mib'] for r in v)[len(v) // 2]:,.0f}" for k, v in results.items())])


if __name__ == "__main__":
    main()
