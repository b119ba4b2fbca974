"""Evaluation throughput: compass's evaluate step (lighteval through compass's custom offline tasks, store
commit and manifest included) against lighteval's Pipeline run directly on the same checkpoint and task.

    python benchmarks/evaluation_throughput.py [--samples 200]
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

REPO = Path(__file__).resolve().parent.parent
SUITE = "  evaluation:\n    tasks:\n      - {{name: arc_easy, formulation: cf, limit: {n}}}\n  pretraining:"


def prepare(work: Path, samples: int) -> dict:
    """Train the minimal spec's model on the fixture corpus; return what both variants need."""
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec_text
    from compass.tasks.base import Runtime

    text = (REPO / "tests" / "specs" / "minimal.yaml").read_text().replace("  pretraining:", SUITE.format(n=samples))
    loaded = load_spec_text(text, "minimal.yaml", base_dir=REPO / "tests" / "specs")
    plan = compile_spec(loaded.spec).restricted_to({"ingest", "curate", "tokenizer", "tokenize", "pretrain"})
    store = Store(str(work / "store"))
    ctx = RunContext(plan, store, loaded.spec_hash,
                     Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    for step in plan.steps:
        run_step(ctx, step, logging.getLogger("bench"))
    return {"spec": text, "base_dir": str(REPO / "tests" / "specs"), "store": str(work / "store"),
            "model": str(Path(store.uri("pretrain", "stage2", plan.fingerprints["pretrain:stage2"])) / "final"),
            "samples": samples}


def run_compass(ctx: dict, out: Path) -> None:
    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.store import Store
    from compass.specs import load_spec_text
    from compass.tasks.base import Runtime

    loaded = load_spec_text(ctx["spec"], "minimal.yaml", base_dir=Path(ctx["base_dir"]))
    plan = compile_spec(loaded.spec).restricted_to({"ingest", "curate", "tokenizer", "tokenize", "pretrain",
                                                    "evaluate"})
    run_ctx = RunContext(plan, Store(ctx["store"]), loaded.spec_hash, Runtime(how=loaded.spec.how))
    import compass.tasks.evaluate  # noqa: F401  same footing as the direct variant: libraries imported before the clock
    from compass.infra.lighteval_compat import install

    install()
    import lighteval.pipeline  # noqa: F401
    start = time.perf_counter()
    run_step(run_ctx, plan.step("evaluate:pretrain-stage2"), logging.getLogger("bench"))
    out.write_text(json.dumps({"seconds": time.perf_counter() - start}))


def run_direct(ctx: dict, out: Path) -> None:
    from compass.infra.lighteval_compat import install

    install()
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.models.transformers.transformers_model import TransformersModelConfig
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters

    from compass.tasks.offline_benchmarks import prepare

    folder, _ = prepare("arc_easy")
    custom = out.parent / "direct_tasks.py"
    custom.write_text(
        "from lighteval.metrics.metrics import Metrics\n"
        "from lighteval.tasks.lighteval_task import LightevalTaskConfig\n"
        "from tasks.benchmarks import cf_prompt\n"
        f"TASKS_TABLE = [LightevalTaskConfig(name='arc_direct', prompt_function=cf_prompt, hf_repo={str(folder)!r},\n"
        "    hf_subset='default', hf_avail_splits=['validation'], evaluation_splits=['validation'],\n"
        "    metrics=[Metrics.loglikelihood_acc])]\n")
    start = time.perf_counter()
    pipeline = Pipeline(tasks="arc_direct|0", pipeline_parameters=PipelineParameters(
        launcher_type=ParallelismManager.NONE, custom_tasks_directory=str(custom), max_samples=ctx["samples"]),
        evaluation_tracker=EvaluationTracker(output_dir=str(out.parent / "lighteval"), save_details=False),
        model_config=TransformersModelConfig(model_name=ctx["model"], batch_size=8, dtype="float32", device="cpu"))
    pipeline.evaluate()
    out.write_text(json.dumps({"seconds": time.perf_counter() - start}))


VARIANTS = {"lighteval directly": run_direct, "compass evaluate step": run_compass}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        VARIANTS[args.child[0]](json.loads(Path(args.child[1]).read_text()), Path(args.child[2]))
        return
    from compass.infra.environment import prepare_environment

    prepare_environment()
    work = Path(tempfile.mkdtemp(prefix="compass-bench-"))
    ctx = prepare(work, args.samples)
    (work / "ctx.json").write_text(json.dumps(ctx))
    results = {}
    for name in VARIANTS:
        out = work / f"{name.replace(' ', '-')}.json"
        with open(out.with_suffix(".log"), "w") as log:
            proc = subprocess.Popen([sys.executable, __file__, "--child", name, str(work / "ctx.json"), str(out)],
                                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
        if status:
            raise SystemExit(f"{name} failed: see {out.with_suffix('.log')}")
        results[name] = (args.samples / json.loads(out.read_text())["seconds"], usage.ru_maxrss / 1024)
    base, base_mem = results["lighteval directly"]
    print(f"evaluation throughput: arc_easy (cloze), {args.samples} samples, minimal spec's 2-layer model, CPU")
    for name, (rate, mem) in results.items():
        print(f"  {name:22s} {rate:7.1f} samples/s  peak RSS {mem:6.0f} MiB  speed ratio vs lighteval "
              f"{rate / base:.3f}  memory ratio {mem / base_mem:.3f}")


if __name__ == "__main__":
    main()
