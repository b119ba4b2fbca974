"""Evaluation of one checkpoint: lighteval on the offline benchmarks the spec names (CF or MCF), plus the
validation loss and perplexity of each curated source the spec lists."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from compass.tasks.base import StepContext, StepResult


def task_key(task: dict[str, Any]) -> str:
    """The metric prefix of one suite entry, as the spec names it (`arc_easy:cf`, `lighteval:winogrande`)."""
    from compass.specs.evaluation import EvalTask

    return EvalTask.model_validate(task).key


def _pipeline_task(task: dict[str, Any]) -> str:
    from compass.tasks.lighteval_tasks import LOCAL_PREFIX

    if task.get("source", "compass") == "lighteval":
        return f"{LOCAL_PREFIX}{task['name']}|{task['fewshot']}"
    return f"{task['name']}_{task['formulation']}|{task['fewshot']}"


def custom_tasks_module(tasks: list[dict[str, Any]], scratch: Path) -> tuple[Path, list[dict]]:
    """A lighteval custom-tasks file serving every task of the suite from local data, and its provenance."""
    from compass.tasks.benchmarks import prepare
    from compass.tasks.lighteval_tasks import locate

    prepared, provenance, formulations, standard = {}, [], {}, {}
    for t in tasks:
        if t.get("source", "compass") == "lighteval":
            if t["name"] not in standard:
                local = locate(t["name"], t["fewshot"])
                standard[t["name"]] = str(local.dataset)
                provenance.append(local.provenance)
            continue
        if t["name"] not in prepared:
            folder, prov = prepare(t["name"])
            prepared[t["name"]] = str(folder)
            provenance.append(prov)
        formulations.setdefault(t["name"], []).append(t["formulation"])
    module = scratch / "compass_custom_tasks.py"
    module.write_text("from compass.tasks.benchmarks import task_table\n"
                      "from compass.tasks.lighteval_tasks import local_configs\n"
                      f"TASKS_TABLE = list(task_table({json.dumps(prepared)}, {json.dumps(formulations)}))\n"
                      f"TASKS_TABLE += local_configs({json.dumps(standard)})\n")
    return module, provenance


def run_lighteval(model_dir: Path, tasks: list[dict[str, Any]], scratch: Path) -> tuple[dict, list[dict]]:
    """Run lighteval's Pipeline with compass's offline custom tasks; returns (results, provenance)."""
    from compass.infra.lighteval_compat import install

    install()
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.models.transformers.transformers_model import TransformersModelConfig
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters

    module, provenance = custom_tasks_module(tasks, scratch)
    results = {}
    for t in tasks:  # one pipeline per task: each has its own sample limit
        params = PipelineParameters(launcher_type=ParallelismManager.NONE, custom_tasks_directory=str(module),
                                    max_samples=t.get("limit"))
        tracker = EvaluationTracker(output_dir=str(scratch / "lighteval"), save_details=False)
        config = TransformersModelConfig(model_name=str(model_dir), batch_size=8, dtype="float32", device="cpu")
        pipeline = Pipeline(tasks=_pipeline_task(t), pipeline_parameters=params,
                            evaluation_tracker=tracker, model_config=config)
        try:
            pipeline.evaluate()
        except RuntimeError as exc:
            if "must match the size of tensor" not in str(exc):
                raise
            raise RuntimeError(f"{task_key(t)} on {model_dir}: lighteval cannot score an answer longer than the "
                               f"model's context ({_context_length(model_dir)} tokens): evaluate this benchmark "
                               "on a model with a longer context, or in multiple-choice form (mcf)") from exc
        for key, metrics in pipeline.get_results()["results"].items():
            if key != "all":
                results[task_key(t)] = metrics
    return results, provenance


def _context_length(model_dir: Path) -> int | None:
    return json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")


def tokens_seen(model_folder: Path) -> int | None:
    rows = _metric_rows(model_folder)
    return int(rows[-1]["tokens"]) if rows else None


def _metric_rows(model_folder: Path) -> list[dict[str, Any]]:
    metrics = model_folder / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line]


def kept_checkpoints(model_folder: Path) -> list[tuple[str, Path, int | None]]:
    """(name, HF folder, tokens seen) of every checkpoint a model artifact kept, oldest first.

    Tokens come from the metrics of the artifact's own (last) stage: a checkpoint `step-N` holds the weights
    after that stage's step N."""
    rows = _metric_rows(model_folder)
    stage = rows[-1]["stage"] if rows else None
    tokens_at = {r["stage_step"]: int(r["tokens"]) for r in rows if r["stage"] == stage and "stage_step" in r}
    found = sorted((model_folder / "checkpoints").glob("step-*")) if (model_folder / "checkpoints").exists() else []
    out = [(p.name, p, tokens_at.get(int(p.name.split("-")[1]))) for p in found]
    if not out:
        out = [("final", model_folder / "final", tokens_seen(model_folder))]
    return out


def trained_length(config: Any) -> int:
    """The context the model was trained at (YaRN/linear scaling raise max_position_embeddings beyond it)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return int(rope.get("original_max_position_embeddings") or config.max_position_embeddings)


def evaluate_model(model_dir: Path, suite: dict[str, Any], sources: dict[str, Path], scratch: Path,
                   retrieval: dict[str, Any] | None = None,
                   haystack: Path | None = None) -> tuple[dict[str, Any], list[dict], list[dict]]:
    """Score one Hugging Face checkpoint: (metrics, table rows, benchmark provenance)."""
    import torch
    from compass.model.trainer import heldout_losses
    from transformers import AutoModelForCausalLM

    scratch.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {}
    rows: list[dict] = []
    provenance: list[dict] = []
    if suite["tasks"]:
        results, provenance = run_lighteval(model_dir, suite["tasks"], scratch)
        for name, values in results.items():
            for metric, value in values.items():
                if not metric.endswith("_stderr"):
                    metrics[f"{name}/{metric}"] = value = float(value)
                    rows.append({"task": name, "metric": metric, "value": round(value, 4),
                                 "stderr": round(values.get(f"{metric}_stderr", float("nan")), 4)})
    if sources:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        losses = heldout_losses(model, sources, trained_length(model.config), masking=True,
                                device=torch.device("cpu"))
        for name, loss in losses.items():
            metrics[f"val_loss:{name}"] = loss
            metrics[f"val_ppl:{name}"] = math.exp(loss)
            rows.append({"task": f"held-out {name}", "metric": "perplexity", "value": round(math.exp(loss), 3),
                         "stderr": ""})
    if retrieval and haystack is not None:
        from compass.tasks.retrieval import passkey_accuracy
        from compass.tasks.tokenize import TokenizedSource

        text = TokenizedSource(haystack, "heldout").tokens
        cells = passkey_accuracy(model_dir, np.asarray(text), retrieval["lengths"], retrieval["depths"],
                                 retrieval["samples"])
        for length in retrieval["lengths"]:
            at = [c for c in cells if c["length"] == length]
            if not at:
                continue
            metrics[f"passkey@{length}"] = sum(c["accuracy"] for c in at) / len(at)
            for c in at:
                metrics[f"passkey@{length}/depth{c['depth']}"] = float(c["accuracy"])
                rows.append({"task": f"passkey {length} tokens, depth {c['depth']}", "metric": "accuracy",
                             "value": c["accuracy"], "stderr": ""})
    return metrics, rows, provenance


def run_evaluate(ctx: StepContext) -> StepResult:
    """Evaluate the model step's final weights, and with `every_checkpoint` each checkpoint it kept: the
    points of the evaluation curves (metric against tokens seen)."""
    suite = ctx.config["suite"]
    model = ctx.inputs["model"]
    model_folder = model.local()
    sources = {role.removeprefix("tokens:"): art.local() for role, art in ctx.inputs.items()
               if role.startswith("tokens:")}
    retrieval = ctx.config.get("retrieval")
    haystack = ctx.inputs["haystack"].local() if "haystack" in ctx.inputs else None
    final_metrics, rows, provenance = evaluate_model(model_folder / "final", suite, sources, ctx.scratch / "final",
                                                     retrieval, haystack)
    curve = []
    if ctx.config.get("every_checkpoint"):
        checkpoints = kept_checkpoints(model_folder)
        for name, folder, tokens in checkpoints[:-1]:  # the last kept checkpoint holds the final weights
            values, _, _ = evaluate_model(folder, suite, sources, ctx.scratch / name, retrieval, haystack)
            curve.append({"checkpoint": name, "tokens": tokens, **values})
            ctx.log.info("%s %s (%s tokens): %s", model.step_id, name, tokens, _shown(values))
        curve.append({"checkpoint": checkpoints[-1][0], "tokens": checkpoints[-1][2], **final_metrics})
    else:
        curve.append({"checkpoint": "final", "tokens": tokens_seen(model_folder), **final_metrics})
    metrics = {"checkpoint": model.step_id, "tokens_seen": tokens_seen(model_folder), **final_metrics,
               "curve": curve}
    (ctx.out / "results.json").write_text(json.dumps(metrics, indent=2))
    summary = (f"### evaluate `{model.step_id}`\n\n{_shown(final_metrics)}\n\n"
               f"{len(curve)} checkpoint(s) evaluated: {', '.join(p['checkpoint'] for p in curve)}")
    return StepResult(metrics=metrics, summary=summary, tables={"evaluation": rows}, provenance=provenance)


def _shown(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in values.items() if isinstance(v, float))
