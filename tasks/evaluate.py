"""Evaluation of one checkpoint: lighteval on the offline benchmarks the spec names (CF or MCF), plus the
validation loss and perplexity of each curated source the spec lists."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tasks.base import StepContext, StepResult


def run_lighteval(model_dir: Path, tasks: list[dict[str, Any]], scratch: Path) -> tuple[dict, list[dict]]:
    """Run lighteval's Pipeline with compass's offline custom tasks; returns (results, provenance)."""
    from infra.lighteval_compat import install

    install()
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.models.transformers.transformers_model import TransformersModelConfig
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters

    from tasks.benchmarks import prepare

    prepared, provenance, formulations = {}, [], {}
    for t in tasks:
        if t["name"] not in prepared:
            folder, prov = prepare(t["name"])
            prepared[t["name"]] = str(folder)
            provenance.append(prov)
        formulations.setdefault(t["name"], []).append(t["formulation"])
    module = scratch / "compass_custom_tasks.py"
    module.write_text("from tasks.benchmarks import task_table\n"
                      f"TASKS_TABLE = list(task_table({json.dumps(prepared)}, {json.dumps(formulations)}))\n")
    results = {}
    for t in tasks:  # one pipeline per task: each has its own sample limit
        params = PipelineParameters(launcher_type=ParallelismManager.NONE, custom_tasks_directory=str(module),
                                    max_samples=t.get("limit"))
        tracker = EvaluationTracker(output_dir=str(scratch / "lighteval"), save_details=False)
        config = TransformersModelConfig(model_name=str(model_dir), batch_size=8, dtype="float32", device="cpu")
        pipeline = Pipeline(tasks=f"{t['name']}_{t['formulation']}|{t['fewshot']}", pipeline_parameters=params,
                            evaluation_tracker=tracker, model_config=config)
        pipeline.evaluate()
        for key, metrics in pipeline.get_results()["results"].items():
            if key != "all":
                results[f"{t['name']}:{t['formulation']}"] = metrics
    return results, provenance


def tokens_seen(model_folder: Path) -> int | None:
    metrics = model_folder / "metrics.jsonl"
    if not metrics.exists():
        return None
    last = metrics.read_text().strip().splitlines()[-1]
    return int(json.loads(last)["tokens"])


def run_evaluate(ctx: StepContext) -> StepResult:
    import torch
    from transformers import AutoModelForCausalLM

    from model.trainer import heldout_losses

    suite = ctx.config["suite"]
    model_folder = ctx.inputs["model"].local()
    model_dir = model_folder / "final"
    metrics: dict[str, Any] = {"checkpoint": ctx.inputs["model"].step_id, "tokens_seen": tokens_seen(model_folder)}
    rows = []
    provenance: list[dict] = []
    if suite["tasks"]:
        results, provenance = run_lighteval(model_dir, suite["tasks"], ctx.scratch)
        for name, values in results.items():
            for metric, value in values.items():
                if not metric.endswith("_stderr"):
                    metrics[f"{name}/{metric}"] = value = float(value)
                    rows.append({"task": name, "metric": metric, "value": round(value, 4),
                                 "stderr": round(values.get(f"{metric}_stderr", float("nan")), 4)})
    sources = {role.removeprefix("tokens:"): art.local() for role, art in ctx.inputs.items()
               if role.startswith("tokens:")}
    if sources:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        losses = heldout_losses(model, sources, model.config.max_position_embeddings, masking=True,
                                device=torch.device("cpu"))
        for name, loss in losses.items():
            metrics[f"val_loss:{name}"] = loss
            metrics[f"val_ppl:{name}"] = math.exp(loss)
            rows.append({"task": f"held-out {name}", "metric": "perplexity", "value": round(math.exp(loss), 3),
                         "stderr": ""})
    (ctx.out / "results.json").write_text(json.dumps(metrics, indent=2))
    shown = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if isinstance(v, float))
    summary = f"### evaluate `{ctx.inputs['model'].step_id}`\n\n{shown}"
    return StepResult(metrics=metrics, summary=summary, tables={"evaluation": rows}, provenance=provenance)
