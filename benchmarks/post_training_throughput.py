"""Post-training throughput: compass's SFT step (rows built from the dataset, TRL on the step's ranks with checkpoints
at the spec's cadence, export, metrics and manifest included) against TRL's SFTTrainer run directly on the same
model, conversations and arguments, one process each.

    python benchmarks/post_training_throughput.py [--samples 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from harness import child, interleave, peak_rss_mib, pin_threads, report, write_result

REPO = Path(__file__).resolve().parent.parent
POST = """  post_training:
    - {{method: sft, name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3, max_samples: {n}, max_length: 256,
       batch_size: 8}}
  pretraining:"""


def spec_text(samples: int) -> str:
    text = (REPO / "tests" / "specs" / "minimal.yaml").read_text().replace("../fixtures/", f"{REPO}/tests/fixtures/")
    return text.replace("  pretraining:", POST.format(n=samples))


def prepare(work: Path, samples: int) -> dict:
    """Pretrain the minimal spec's model; write the SFT step's conversations for the direct variant."""
    from compass.flows.runner import run_in_process
    from compass.flows.validation import load_checked_text
    from compass.infra.store import Store
    from compass.tasks.post_training.datasets import chat_examples, dataset_root
    from compass.tasks.steps.context import Runtime

    text = spec_text(samples)
    checked = load_checked_text(text, "minimal.yaml", base_dir=REPO / "tests" / "specs")
    plan = checked.plan.up_to(["pretrain"])
    store = Store(str(work / "store"))
    run_in_process(plan, store, checked.loaded.spec_hash, Runtime(how=checked.spec.how,
                                                                  base_dir=checked.loaded.base_dir),
                   logging.getLogger("bench"))
    section = checked.spec.what.post_training[0]
    root, _ = dataset_root(section.dataset, REPO / "tests" / "specs")
    from compass.tasks.kinds.post_train import MAX_CHARS_PER_TOKEN

    conversations = chat_examples(root, section.max_samples, 0, section.max_length * MAX_CHARS_PER_TOKEN, None)
    (work / "conversations.json").write_text(json.dumps(conversations))
    return {"spec": text, "store": str(work / "store"), "work": str(work), "samples": len(conversations),
            "model": str(Path(store.uri("pretrain", "stage2", plan.fingerprints["pretrain:stage2"])) / "final")}


def import_libraries() -> None:
    """Both variants start with the same modules imported (TRL's trainers load lazily; peft comes with them)."""
    import peft  # noqa: F401
    from trl import SFTConfig, SFTTrainer  # noqa: F401

    import compass.tasks.kinds.post_train  # noqa: F401
    import compass.tasks.post_training.trl_ranks  # noqa: F401


def run_compass(ctx: dict) -> float:
    import shutil

    from compass.flows.runner import RunContext, run_step
    from compass.flows.validation import load_checked_text
    from compass.infra.store import Store
    from compass.tasks.steps.context import Runtime

    checked = load_checked_text(ctx["spec"], "minimal.yaml", base_dir=REPO / "tests" / "specs")
    plan, store = checked.plan, Store(ctx["store"])
    step = plan.step("post_train:sft")
    shutil.rmtree(store.uri(step.kind, step.name, plan.fingerprints[step.id]), ignore_errors=True)  # not cached
    run_ctx = RunContext(plan, store, checked.loaded.spec_hash, Runtime(how=checked.spec.how,
                                                                        base_dir=checked.loaded.base_dir))
    import_libraries()
    start = time.perf_counter()
    run_step(run_ctx, step, logging.getLogger("bench"))
    return time.perf_counter() - start


def run_direct(ctx: dict) -> float:
    """What a team writes without compass: the chat model, the conversations, SFTTrainer, save."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from compass.tasks.post_training.chat import load_chat_model

    import_libraries()
    out = Path(tempfile.mkdtemp(prefix="compass-bench-", dir=ctx["work"]))
    conversations = json.loads((Path(ctx["work"]) / "conversations.json").read_text())
    start = time.perf_counter()
    model, tokenizer = load_chat_model(Path(ctx["model"]))
    args = SFTConfig(output_dir=str(out), learning_rate=1e-3, num_train_epochs=1, per_device_train_batch_size=8,
                     use_cpu=True, report_to="none", save_strategy="steps", save_steps=1000, logging_steps=1,
                     seed=0, disable_tqdm=True, lr_scheduler_type="linear", warmup_steps=0, max_length=256,
                     assistant_only_loss=True, dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"messages": c}
                                                                                  for c in conversations]),
                         processing_class=tokenizer)
    trainer.train()
    trainer.save_model(str(out / "final"))
    return time.perf_counter() - start


VARIANTS = {"TRL SFTTrainer directly": run_direct, "compass SFT step": run_compass}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        pin_threads()
        name, ctx_path, out = args.child
        ctx = json.loads(Path(ctx_path).read_text())
        write_result(out, ctx["samples"] / VARIANTS[name](ctx), peak_mib=peak_rss_mib())
        return
    from compass.infra.environment import prepare_environment

    prepare_environment()
    work = Path(tempfile.mkdtemp(prefix="compass-bench-"))
    ctx = prepare(work, args.samples)
    (work / "ctx.json").write_text(json.dumps(ctx))
    results = interleave({name: (lambda name=name: child(__file__, [name, str(work / "ctx.json")], cwd=REPO))
                          for name in VARIANTS}, args.rounds)
    report(f"post-training throughput: SFT on {ctx['samples']} conversations, minimal spec's 2-layer model, 1 process, "
           "CPU", results, "TRL SFTTrainer directly", "conversations/s")


if __name__ == "__main__":
    main()
