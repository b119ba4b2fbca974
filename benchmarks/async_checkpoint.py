"""What checkpoints cost training: the mean time of a step over a run that checkpoints, written in the background
(snapshot to host memory, then a writer thread) or synchronously, against the same run without checkpoints (the
peer: a writer thread's cost shows in the neighbouring steps too). compass's trainer on the fixture corpus, with a
model large enough that a checkpoint (weights, AdamW state, Hugging Face export, checksums) takes longer than a step.

    python benchmarks/async_checkpoint.py [--steps 30] [--every 5] [--rounds 3] [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from harness import Run, child, fixture_job, interleave, peak_rss_mib, pin_threads, report, write_result

REPO = Path(__file__).resolve().parent.parent


def prepare(work: Path, steps: int, every: int, hidden: int, layers: int):
    """A model wide enough that a checkpoint outlasts a step, on the fixture corpus."""
    architecture = {"num_layers": layers, "hidden_size": hidden, "ffn_size": 3 * hidden, "num_heads": 8,
                    "num_kv_heads": 2, "vocab_size": 8192}
    return fixture_job(work, steps=steps, seq=128, batch=2, micro=2, architecture=architecture,
                       parallelism={"deepspeed": False}, checkpoints={"every_steps": every, "keep_last": 2})


def run(job, mode: str) -> tuple[float, float, float]:
    """(mean seconds of a step after the first checkpoint's step, of a step that saves one, of one that does not);
    mode: async, sync or none (no checkpoint: the same steps, the peer)."""
    from compass.model.training.callbacks import Callback
    from compass.model.training.trainer import train_stage

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    stamps: list[float] = []

    class Clock(Callback):  # the last callback: a step's time includes its checkpoint's blocking time
        def post_step(self, trainer, record):
            stamps.append(time.perf_counter())

    every = job.checkpoints.every_steps
    saves = {"asynchronous": mode == "async"} | ({} if mode != "none" else {"every_steps": 10**9})
    job = job.with_how(checkpoints=job.checkpoints.model_copy(update=saves))
    train_stage(job, callbacks=[Clock()])
    durations = {i + 1: stamps[i] - stamps[i - 1] for i in range(1, len(stamps))}
    measured = {step: d for step, d in durations.items() if step > every and step != len(stamps)}  # not the export
    saving = [d for step, d in durations.items() if step % every == 0 and step != len(stamps)] or [0.0]
    other = [d for step, d in measured.items() if step % every]
    return statistics.fmean(measured.values()), statistics.fmean(saving), statistics.fmean(other)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        from compass.model.training.job import TrainJob

        pin_threads()
        mode, job_path, out = args.child
        step, saving, other = run(TrainJob.read(Path(job_path)), mode)
        write_result(out, step, saving_s=saving, other_s=other, peak_mib=peak_rss_mib())
        return
    from compass.infra.environment import prepare_environment

    prepare_environment()
    work = Path(tempfile.mkdtemp(prefix="compass-bench-"))
    job = prepare(work, args.steps, args.every, args.hidden, args.layers)

    def variant(mode: str):
        def go() -> Run:
            run_dir = Path(tempfile.mkdtemp(dir=work))
            job.model_copy(update={"workdir": run_dir}).write(run_dir / "job.json")
            return child(__file__, [mode, str(run_dir / "job.json")], cwd=REPO)
        return go

    modes = {"no checkpoints": "none", "async checkpoints": "async", "sync checkpoints": "sync"}
    results = interleave({name: variant(mode) for name, mode in modes.items()}, args.rounds)
    seconds = {name: (statistics.median(r.details["saving_s"] for r in runs),
                      statistics.median(r.details["other_s"] for r in runs)) for name, runs in results.items()
               if modes[name] != "none"}
    report(f"checkpoint cost: {args.layers} layers, hidden {args.hidden}, vocab 8192, {args.steps} steps, a checkpoint "
           f"every {args.every} steps; mean seconds per step after the first checkpoint", results, "no checkpoints",
           "s/step", higher_is_better=False,
           notes=[f"{name}: a step that checkpoints {saving:.2f} s, the other steps {other:.2f} s"
                  for name, (saving, other) in seconds.items()] + ["goal: async checkpoints <= 1.1x the run "
                                                                   "without checkpoints"])


if __name__ == "__main__":
    main()
