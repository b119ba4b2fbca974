"""Training engines on the same spec and ranks: DDP (the baseline) against DeepSpeed ZeRO-1/2/3 and FSDP2. Every
variant trains the demo architecture on the fixture corpus on 2 ranks (torchrun; gloo here, NCCL as is on one GPU
node with --accelerator h100), the same global batch and steps; tokens/s is the median of the steps after warm-up
from the trainer's own metrics (rank 0), peak memory the largest rank's max RSS (GPU memory on a GPU).

    python benchmarks/engines.py [--steps 30] [--rounds 3] [--seq 256] [--ranks 2] [--accelerator h100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("COMPASS_BENCH_THREADS", "1")  # each rank one thread (2 ranks on 2 cores); read at import
from harness import child, fixture_job, interleave, report, write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WARMUP = 3
ENGINES = {
    "DDP": {"engine": "ddp"},
    "DeepSpeed ZeRO-1": {"engine": "deepspeed", "zero_stage": 1},
    "DeepSpeed ZeRO-2": {"engine": "deepspeed", "zero_stage": 2},
    "DeepSpeed ZeRO-3": {"engine": "deepspeed", "zero_stage": 3},
    "FSDP2": {"engine": "fsdp2"},
    "FSDP2 + TP 2": {"engine": "fsdp2", "tensor_parallel": 2},
}


def train(name: str, ctx: dict) -> tuple[float, float]:
    """(tokens/s, peak MiB of the largest rank) of one run of `name` on the context's ranks."""
    from compass.infra.net import free_port
    from compass.specs import load_spec

    work = Path(tempfile.mkdtemp(prefix="compass-engines-", dir=ctx["work"]))
    demo = load_spec(REPO / "specs" / "examples" / "tiny.yaml").spec.what.architecture
    tp = ENGINES[name].get("tensor_parallel", 1)
    parallelism = {"deepspeed": ENGINES[name]["engine"] == "deepspeed", "zero_stage": 0,
                   "data_parallel": ctx["ranks"] // tp, **ENGINES[name]}
    job = fixture_job(Path(ctx["work"]), steps=ctx["steps"], seq=ctx["seq"], batch=2 * ctx["ranks"], micro=2,
                      architecture=demo.model_dump(), parallelism=parallelism, checkpoints={"every_steps": 10**9})
    job = job.model_copy(update={"workdir": work})
    if ctx["accelerator"] != "cpu":  # NCCL, one rank per GPU, bf16
        job = job.with_how(hardware=job.hardware.model_copy(update={"accelerator": ctx["accelerator"]}),
                           precision="bf16")
    job.write(work / "job.json")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ctx["ranks"]),
                           "--master-port", str(free_port()), "-m", "compass.model.training.trainer",
                           str(work / "job.json")], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows[WARMUP:-1] if r.get("tokens_per_s")]
    peak = max((r.get("gpu_mem_mb") or r.get("rss_mb") or 0.0) for r in rows)
    return statistics.median(speeds), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu", help="h100 on a GPU node: NCCL, one rank per GPU, bf16")
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES),
                        help="the engines to compare (DDP, the baseline, always runs)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, ctx_path, out = args.child
        speed, peak = train(name, json.loads(Path(ctx_path).read_text()))
        write_result(out, speed, peak_mib=peak)
        return
    work = Path(tempfile.mkdtemp(prefix="compass-engines-"))
    ctx = {"work": str(work), "steps": args.steps, "seq": args.seq, "ranks": args.ranks,
           "accelerator": args.accelerator}
    (work / "ctx.json").write_text(json.dumps(ctx))
    results = interleave({name: (lambda name=name: child(__file__, [name, str(work / "ctx.json")], cwd=REPO))
                          for name in ENGINES if args.ranks % ENGINES[name].get("tensor_parallel", 1) == 0
                          and (name == "DDP" or name in args.engines)},
                         args.rounds)
    where = ("CPU, gloo: sharding's collectives cost what they cost here; rerun on a GPU node"
             if args.accelerator == "cpu" else f"{args.accelerator}, NCCL, bf16")
    report(f"engines: the demo architecture, {args.ranks} ranks, seq {args.seq}, {args.steps} steps ({where})",
           results, "DDP", "tokens/s")


if __name__ == "__main__":
    main()
