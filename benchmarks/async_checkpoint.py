"""What a checkpoint costs a training step: the wall time of steps that save a checkpoint against steps that do
not, with checkpoints written in the background (snapshot to host memory, then a writer thread) and written
synchronously. compass's trainer on the fixture corpus, with a model large enough that a checkpoint (weights,
AdamW state, Hugging Face export, checksums) takes longer than a step.

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


def run(job, asynchronous: bool) -> tuple[float, float, float]:
    """(mean seconds of a step that saves a checkpoint, of one that does not, their ratio)."""
    from compass.model.training.callbacks import Callback
    from compass.model.training.trainer import train_stage

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    stamps: list[float] = []

    class Clock(Callback):  # the last callback: a step's time includes its checkpoint's blocking time
        def post_step(self, trainer, record):
            stamps.append(time.perf_counter())

    job = job.model_copy(update={"checkpoints": job.checkpoints.model_copy(update={"asynchronous": asynchronous})})
    train_stage(job, callbacks=[Clock()])
    every = job.checkpoints.every_steps
    durations = {i + 1: stamps[i] - stamps[i - 1] for i in range(1, len(stamps))}
    saving = [d for step, d in durations.items() if step % every == 0 and step != len(stamps)]
    other = [d for step, d in durations.items() if step % every and step > every]  # after the first save
    return statistics.fmean(saving), statistics.fmean(other), statistics.fmean(saving) / statistics.fmean(other)


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
        saving, other, ratio = run(TrainJob.read(Path(job_path)), mode == "async")
        write_result(out, ratio, saving_s=saving, other_s=other, peak_mib=peak_rss_mib())
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

    results = interleave({"sync": variant("sync"), "async": variant("async")}, args.rounds)
    seconds = {mode: (statistics.median(r.details["saving_s"] for r in runs),
                      statistics.median(r.details["other_s"] for r in runs)) for mode, runs in results.items()}
    report(f"checkpoint cost per step: {args.layers} layers, hidden {args.hidden}, vocab 8192, a checkpoint every "
           f"{args.every} steps, {args.steps} steps; the value is the time of a step that checkpoints over that of "
           "the other steps", results, "sync", "x an ordinary step", higher_is_better=False,
           notes=[f"{mode}: a step that checkpoints {saving:.2f} s, other steps {other:.2f} s"
                  for mode, (saving, other) in seconds.items()] + ["goal: <= 1.1x an ordinary step with async "
                                                                   "checkpoints"])


if __name__ == "__main__":
    main()
