"""Evaluation throughput: compass's evaluate step (lighteval through compass's custom offline tasks, store
commit and manifest included) against lighteval's Pipeline run directly on the same checkpoint and task.

    python benchmarks/evaluation_throughput.py [--samples 500]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from harness import child, interleave, minimal_spec, peak_rss_mib, pin_threads, report, seeded, write_result

REPO = Path(__file__).resolve().parent.parent
SUITE = "  evaluation:\n    benchmarks:\n      - {{name: arc_easy, formulation: cf, limit: {n}}}\n  pretraining:"
CRITERION = ('{metric: val_ppl:notes, op: "<=", threshold: 1000, checkpoint: final}',
             '{metric: "arc_easy:cf/acc", op: ">=", threshold: 0.0, checkpoint: final}')


def spec_text(samples: int) -> str:
    """The minimal spec evaluating arc_easy only (its criterion names that benchmark's metric)."""
    return minimal_spec().replace("  pretraining:", SUITE.format(n=samples)).replace(*CRITERION)


def prepare(work: Path, samples: int) -> dict:
    """Train the minimal spec's model on the fixture corpus; return what both variants need."""
    from compass.flows.runner import run_in_process
    from compass.flows.validation import load_checked_text
    from compass.infra.store import Store
    from compass.tasks.steps.context import Runtime

    text = spec_text(samples)
    checked = load_checked_text(text, "minimal.yaml", base_dir=REPO / "tests" / "specs")
    plan = checked.plan.up_to(["pretrain"])
    store = Store(str(seeded(work / "store")))
    run_in_process(plan, store, checked.loaded.spec_hash, Runtime(how=checked.spec.how,
                                                                  base_dir=checked.loaded.base_dir),
                   logging.getLogger("bench"))
    return {"spec": text, "base_dir": str(REPO / "tests" / "specs"), "store": str(work / "store"),
            "model": str(Path(store.uri("pretrain", "stage2", plan.fingerprints["pretrain:stage2"])) / "final"),
            "samples": samples}


def run_compass(ctx: dict) -> float:
    import shutil

    from compass.flows.runner import RunContext, run_step
    from compass.flows.validation import load_checked_text
    from compass.infra.store import Store
    from compass.tasks.steps.context import Runtime

    checked = load_checked_text(ctx["spec"], "minimal.yaml", base_dir=Path(ctx["base_dir"]))
    plan, store = checked.plan, Store(ctx["store"])
    step = plan.step("evaluate:pretrain-stage2")
    shutil.rmtree(store.uri(step.kind, step.name, plan.fingerprints[step.id]), ignore_errors=True)  # not cached
    run_ctx = RunContext(plan, store, checked.loaded.spec_hash, Runtime(how=checked.spec.how))
    import compass.tasks.evaluation.lighteval_run  # noqa: F401  same footing as the direct variant: libraries
    import compass.tasks.kinds.evaluate  # noqa: F401  imported before the clock
    from compass.infra.lighteval_compat import install

    install()
    import lighteval.logging.evaluation_tracker  # noqa: F401  the modules the direct variant imports before its clock
    import lighteval.models.transformers.transformers_model  # noqa: F401  (they pull in transformers' generation code)
    import lighteval.pipeline  # noqa: F401
    start = time.perf_counter()
    run_step(run_ctx, step, logging.getLogger("bench"))
    return time.perf_counter() - start


def run_direct(ctx: dict) -> float:
    from compass.infra.lighteval_compat import install

    install()
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.models.transformers.transformers_model import TransformersModelConfig
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters

    from compass.tasks.evaluation.offline_benchmarks import prepare

    folder, _ = prepare("arc_easy")
    scratch = Path(tempfile.mkdtemp(prefix="compass-bench-"))
    custom = scratch / "direct_tasks.py"
    custom.write_text(
        "from lighteval.metrics.metrics import Metrics\n"
        "from lighteval.tasks.lighteval_task import LightevalTaskConfig\n"
        "from compass.tasks.evaluation.offline_benchmarks import cf_prompt\n"
        f"TASKS_TABLE = [LightevalTaskConfig(name='arc_direct', prompt_function=cf_prompt, hf_repo={str(folder)!r},\n"
        "    hf_subset='default', hf_avail_splits=['validation'], evaluation_splits=['validation'],\n"
        "    metrics=[Metrics.loglikelihood_acc])]\n")
    start = time.perf_counter()
    pipeline = Pipeline(tasks="arc_direct|0", pipeline_parameters=PipelineParameters(
        launcher_type=ParallelismManager.NONE, custom_tasks_directory=str(custom), max_samples=ctx["samples"]),
        evaluation_tracker=EvaluationTracker(output_dir=str(scratch / "lighteval"), save_details=False),
        model_config=TransformersModelConfig(model_name=ctx["model"], batch_size=8, dtype="float32", device="cpu",
                                             cache_dir=str(scratch / "lighteval-cache")))  # fresh, as compass's:
    # lighteval's default cache would hand later rounds the first round's predictions
    pipeline.evaluate()
    return time.perf_counter() - start


VARIANTS = {"lighteval directly": run_direct, "compass evaluate step": run_compass}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=500)
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
    report(f"evaluation throughput: arc_easy (cloze), {args.samples} samples, minimal spec's 2-layer model, CPU",
           results, "lighteval directly", "samples/s")


if __name__ == "__main__":
    main()
