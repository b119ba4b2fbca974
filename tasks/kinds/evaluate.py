"""Evaluation of one model step: lighteval on the benchmarks the spec names (compass's offline benchmarks in CF or
MCF, or lighteval's own tasks on local data), the validation loss and perplexity of each curated source the spec
lists, and passkey retrieval at every trained length when the spec extends the context."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from compass.infra.layout import FINAL, HELDOUT, ModelArtifact
from compass.model.training.history import kept_checkpoints, tokens_seen
from compass.specs.base import Issue
from compass.specs.evaluation import Benchmark, Evaluation
from compass.specs.how import How
from compass.specs.spec import TrainingSpec
from compass.tasks.common.devices import Device, device_for, hf_attention
from compass.tasks.kinds.encode_tokens import tokens_of
from compass.tasks.kinds.select_tokenizer import tokenizer_step
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import TRANSFORMERS, PlanBuilder, StepConfig, StepKind
from compass.tasks.steps.placement import phase


class Retrieval(BaseModel):
    """Passkey retrieval: at each trained length, needles at these depths in held-out text of `source`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lengths: list[int]
    depths: list[float]
    samples: int
    source: str


class EvaluateConfig(StepConfig):
    omit_when_none = frozenset({"retrieval"})

    suite: Evaluation
    every_checkpoint: bool
    retrieval: Retrieval | None = None


def retrieval_of(spec: TrainingSpec) -> Retrieval | None:
    """Passkey retrieval at every trained length (the last pretraining one, then each extension stage)."""
    lc = spec.what.long_context
    if not lc.stages:
        return None
    first = lc.stages[0].mixture
    lengths = [spec.what.trained_length, *(s.sequence_length for s in lc.stages)]
    return Retrieval(lengths=lengths, depths=lc.retrieval_depths, samples=lc.retrieval_samples,
                     source=lc.retrieval_source or max(sorted(first), key=lambda n: first[n]))


def step_name(model_step: str) -> str:
    """`evaluate:<kind>-<name>` evaluates the model step `<kind>:<name>`."""
    return model_step.replace(":", "-")


def build(plan: PlanBuilder) -> None:
    ev = plan.spec.what.evaluation
    if not (ev.benchmarks or ev.perplexity_sources):
        return
    retrieval = retrieval_of(plan.spec)
    config = EvaluateConfig(suite=ev, every_checkpoint=plan.spec.how.evaluation.every_checkpoint, retrieval=retrieval)
    for model_step in plan.model_steps:
        inputs = {"model": model_step, "tokenizer": tokenizer_step(plan),
                  **{f"tokens:{n}": tokens_of(plan, n) for n in ev.perplexity_sources}}
        if retrieval:
            inputs["haystack"] = tokens_of(plan, retrieval.source)
        plan.add(KIND, step_name(model_step), config, inputs)


def check_machine(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    """Every benchmark must be runnable on this machine before any work starts: compass's own from the offline
    data it knows, lighteval's from a dataset the machine holds."""
    from compass.tasks.evaluation.lighteval_benchmarks import TaskDataMissing, locate
    from compass.tasks.evaluation.offline_benchmarks import BENCHMARKS, GENERATIVE, VERIFIED, formulations

    offline = [*BENCHMARKS, *GENERATIVE, *VERIFIED]
    for i, task in enumerate(spec.what.evaluation.benchmarks):
        at = ("what", "evaluation", "benchmarks", i, "name")
        if task.source == "compass" and task.name not in offline:
            yield Issue(at, f"no offline data for benchmark '{task.name}' on this machine",
                        f"available offline: {', '.join(offline)}; or set source: lighteval for a lighteval "
                        "task whose dataset this machine holds")
        elif task.source == "compass" and task.formulation not in formulations(task.name):
            yield Issue(("what", "evaluation", "benchmarks", i, "formulation"),
                        f"{task.name} has no '{task.formulation}' formulation",
                        f"use formulation: {' or '.join(formulations(task.name))}")
        if task.source == "lighteval":
            try:
                locate(task.name, task.fewshot)
            except TaskDataMissing as e:
                yield Issue(at, str(e), e.hint)


def _pipeline_task(task: Benchmark) -> str:
    from compass.tasks.evaluation.lighteval_benchmarks import LOCAL_PREFIX

    if task.source == "lighteval":
        return f"{LOCAL_PREFIX}{task.name}|{task.fewshot}"
    return f"{task.name}_{task.formulation}|{task.fewshot}"


def custom_tasks_module(tasks: list[Benchmark], scratch: Path) -> tuple[Path, list[dict]]:
    """A lighteval custom-tasks file serving every task of the suite from local data, and its provenance."""
    from compass.tasks.evaluation.lighteval_benchmarks import locate
    from compass.tasks.evaluation.offline_benchmarks import prepare

    prepared, provenance, formulations, standard = {}, [], {}, {}
    for t in tasks:
        if t.source == "lighteval":
            if t.name not in standard:
                local = locate(t.name, t.fewshot)
                standard[t.name] = str(local.dataset)
                provenance.append(local.provenance)
            continue
        if t.name not in prepared:
            folder, prov = prepare(t.name)
            prepared[t.name] = str(folder)
            provenance.append(prov)
        formulations.setdefault(t.name, []).append(t.formulation)
    module = scratch / "compass_custom_tasks.py"
    module.write_text("from compass.tasks.evaluation.offline_benchmarks import task_table\n"
                      "from compass.tasks.evaluation.lighteval_benchmarks import local_configs\n"
                      f"TASKS_TABLE = list(task_table({json.dumps(prepared)}, {json.dumps(formulations)}))\n"
                      f"TASKS_TABLE += local_configs({json.dumps(standard)})\n")
    return module, provenance


def run_lighteval(model_dir: Path, tasks: list[Benchmark], scratch: Path, where: Device | None = None,
                  how: How | None = None) -> tuple[dict, list[dict]]:
    """Run lighteval's Pipeline with compass's offline custom tasks; returns (results, provenance). On a GPU lighteval
    finds the largest batch that fits; `how` gives the attention kernel and torch.compile."""
    from compass.infra.lighteval_compat import install

    install()
    import torch
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.models.transformers.transformers_model import TransformersModelConfig
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters

    module, provenance = custom_tasks_module(tasks, scratch)
    where = where or Device("cpu", bf16=False)
    by_limit: dict[int | None, list[Benchmark]] = {}
    for t in tasks:  # one pipeline (one model load) per sample limit
        by_limit.setdefault(t.limit, []).append(t)
    results = {}
    for limit, group in by_limit.items():
        params = PipelineParameters(launcher_type=ParallelismManager.NONE, custom_tasks_directory=str(module),
                                    max_samples=limit)
        tracker = EvaluationTracker(output_dir=str(scratch / "lighteval"), save_details=False)
        attention = hf_attention(how) if how else None
        if how is not None and how.generation == "vllm":
            config = _vllm_config(model_dir, where, how)
        else:
            config = TransformersModelConfig(model_name=str(model_dir),
                                             batch_size=8 if where.device == "cpu" else None,
                                             dtype=where.dtype, device=where.device,
                                             cache_dir=str(scratch / "lighteval-cache"),
                                             compile=bool(how and how.compile),
                                             model_loading_kwargs={"attn_implementation": attention} if attention
                                             else {})
        names = {_pipeline_task(t): t.key for t in group}
        pipeline = Pipeline(tasks=",".join(names), pipeline_parameters=params, evaluation_tracker=tracker,
                            model_config=config)
        try:
            with torch.no_grad():  # lighteval relies on grad being off process-wide; a step runs with it on
                pipeline.evaluate()
        except RuntimeError as exc:
            if "must match the size of tensor" not in str(exc):
                raise
            raise RuntimeError(f"{', '.join(names.values())} on {model_dir}: lighteval cannot score an answer longer "
                               f"than the model's context ({_context_length(model_dir)} tokens): evaluate these "
                               "benchmarks on a model with a longer context, or in multiple-choice form (mcf)") from exc
        by_task = {_task_and_shots(k): v for k, v in names.items()}
        for key, metrics in pipeline.get_results()["results"].items():
            if key == "all":
                continue
            if _task_and_shots(key) not in by_task:
                raise RuntimeError(f"lighteval returned results for '{key}', none of the tasks asked for: "
                                   f"{', '.join(names)}")
            results[by_task[_task_and_shots(key)]] = metrics
    return results, provenance


def _vllm_config(model_dir: Path, where: Device, how: How) -> Any:
    """lighteval's vLLM model on the step's GPUs (how.generation: vllm; validation refuses it on CPU specs)."""
    from compass.tasks.post_training.trl_ranks import require_vllm

    require_vllm("evaluate")
    from lighteval.models.vllm.vllm_model import VLLMModelConfig

    return VLLMModelConfig(model_name=str(model_dir), dtype=where.dtype, tensor_parallel_size=1,
                           data_parallel_size=how.shape("evaluation").devices_per_node or 1)


def _task_and_shots(key: str) -> tuple[str, str]:
    """(task, few-shot count) of a lighteval task key, in any of the spellings lighteval uses for it:
    `task|5`, `suite|task|5`, `task:5` (its results)."""
    match = re.fullmatch(r"(?:.*\|)?(.+?)[|:](\d+)", key)
    return (match.group(1), match.group(2)) if match else (key, "")


def _context_length(model_dir: Path) -> int | None:
    return json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")


def trained_length(config: Any) -> int:
    """The context the model was trained at (YaRN/linear scaling raise max_position_embeddings beyond it)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return int(rope.get("original_max_position_embeddings") or config.max_position_embeddings)


def evaluate_model(model_dir: Path, suite: Evaluation, sources: dict[str, Path], scratch: Path,
                   retrieval: Retrieval | None = None, haystack: Path | None = None,
                   where: Device | None = None,
                   how: How | None = None) -> tuple[dict[str, Any], list[dict], list[dict]]:
    """Score one Hugging Face checkpoint: (metrics, table rows, benchmark provenance)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from compass.model.training.heldout import heldout_losses

    scratch.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {}
    rows: list[dict] = []
    provenance: list[dict] = []
    if suite.benchmarks:
        results, provenance = run_lighteval(model_dir, suite.benchmarks, scratch, where, how)
        for name, values in results.items():
            for metric, value in values.items():
                if not metric.endswith("_stderr"):
                    metrics[f"{name}/{metric}"] = value = float(value)
                    rows.append({"task": name, "metric": metric, "value": round(value, 4),
                                 "stderr": round(values.get(f"{metric}_stderr", float("nan")), 4)})
    if sources:
        from compass.model.attention import DOCUMENT_SDPA, register

        register()

        device = torch.device(where.device if where else "cpu")
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=DOCUMENT_SDPA,
                                                     dtype=getattr(torch, where.dtype if where else "float32"))
        model.to(device)
        losses = heldout_losses(model, sources, trained_length(model.config), masking=True,
                                device=device)
        for name, loss in losses.items():
            metrics[f"val_loss:{name}"] = loss
            metrics[f"val_ppl:{name}"] = math.exp(loss)
            rows.append({"task": f"held-out {name}", "metric": "perplexity", "value": round(math.exp(loss), 3),
                         "stderr": ""})
    if retrieval and haystack is not None:
        from compass.model.training.token_files import TokenizedSource
        from compass.tasks.evaluation.retrieval import passkey_accuracy

        text = TokenizedSource(haystack, HELDOUT).tokens
        cells = passkey_accuracy(model_dir, np.asarray(text), retrieval.lengths, retrieval.depths, retrieval.samples,
                                 where=where)
        for length in retrieval.lengths:
            at = [c for c in cells if c["length"] == length]
            if not at:
                continue
            metrics[f"passkey@{length}"] = sum(c["accuracy"] for c in at) / len(at)
            for c in at:
                metrics[f"passkey@{length}/depth{c['depth']}"] = float(c["accuracy"])
                rows.append({"task": f"passkey {length} tokens, depth {c['depth']}", "metric": "accuracy",
                             "value": c["accuracy"], "stderr": ""})
    return metrics, rows, provenance


def run_evaluate(ctx: StepContext[EvaluateConfig]) -> StepResult:
    """Evaluate the model step's final weights, and with `every_checkpoint` each checkpoint it kept: the
    points of the evaluation curves (metric against tokens seen)."""
    suite = ctx.config.suite
    model = ctx.inputs["model"]
    model_folder = model.local()
    sources = ctx.local_inputs("tokens:")
    retrieval = ctx.config.retrieval
    haystack = ctx.inputs["haystack"].local() if "haystack" in ctx.inputs else None
    where = device_for(ctx.runtime.how)
    final_metrics, rows, provenance = evaluate_model(ModelArtifact(model_folder).final, suite, sources,
                                                     ctx.scratch / FINAL, retrieval, haystack, where, ctx.runtime.how)
    curve = []
    if ctx.config.every_checkpoint:
        checkpoints = kept_checkpoints(model_folder)
        for name, folder, tokens in checkpoints[:-1]:  # the last kept checkpoint holds the final weights
            values, _, _ = evaluate_model(folder, suite, sources, ctx.scratch / name, retrieval, haystack, where,
                                          ctx.runtime.how)
            curve.append({"checkpoint": name, "tokens": tokens, **values})
            ctx.log.info("%s %s (%s tokens): %s", model.step_id, name, tokens, _shown(values))
        curve.append({"checkpoint": checkpoints[-1][0], "tokens": checkpoints[-1][2], **final_metrics})
    else:
        curve.append({"checkpoint": FINAL, "tokens": tokens_seen(model_folder), **final_metrics})
    metrics = {"checkpoint": model.step_id, "tokens_seen": tokens_seen(model_folder), **final_metrics,
               "curve": curve}
    (ctx.out / "results.json").write_text(json.dumps(metrics, indent=2))
    _to_tensorboard(ctx, model.step_id, curve)
    summary = (f"### evaluate `{model.step_id}`\n\n{_shown(final_metrics)}\n\n"
               f"{len(curve)} checkpoint(s) evaluated: {', '.join(p['checkpoint'] for p in curve)}")
    return StepResult(metrics=metrics, summary=summary, tables={"evaluation": rows}, provenance=provenance)


def _to_tensorboard(ctx: StepContext[EvaluateConfig], model_step: str, curve: list[dict[str, Any]]) -> None:
    """Scores against tokens in the evaluated step's TensorBoard run, beside its training curves."""
    if not ctx.runtime.how.monitoring.tensorboard:
        return
    from torch.utils.tensorboard import SummaryWriter

    from compass.model.training.telemetry import tensorboard_run

    folder = tensorboard_run(ctx.runtime.monitoring_dir(ctx.store, ctx.workdir), model_step)
    with SummaryWriter(str(folder), filename_suffix=".eval") as writer:
        for point in curve:
            if point.get("tokens") is None:
                continue
            for metric, value in point.items():
                if isinstance(value, float) and "/depth" not in metric:
                    writer.add_scalar(f"eval/{metric}", value, int(point["tokens"]))


def _shown(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in values.items() if isinstance(v, float))


# 3: held-out loss packed by the new packer, with the chunked loss and per-document attention
KIND = StepKind("evaluate", EvaluateConfig, run_evaluate, build, version="3", resources=phase("evaluation"),
                imports=TRANSFORMERS, tags=("evaluation",), check_machine=check_machine)
STEP_KINDS = (KIND,)
