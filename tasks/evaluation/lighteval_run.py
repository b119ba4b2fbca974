"""lighteval's Pipeline on compass's offline benchmarks, in this process: custom tasks served from local data,
the model on the step's device (transformers, or vLLM with how.generation: vllm), results keyed by benchmark.
Used by the evaluate, gate and ablation steps, scheduled evaluations, and each rank of
tasks/evaluation/lighteval_ranks.py."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from compass.infra.lighteval_compat import grad_mode_kept, install
from compass.specs.evaluation import Benchmark
from compass.specs.how import How
from compass.tasks.common.devices import Device, hf_attention, require_vllm
from compass.tasks.evaluation.lighteval_benchmarks import LOCAL_PREFIX, locate
from compass.tasks.evaluation.offline_benchmarks import prepare
from compass.tasks.evaluation.scores import BenchmarkScores, ItemScore, item_score


def _pipeline_task(task: Benchmark) -> str:

    if task.source == "lighteval":
        return f"{LOCAL_PREFIX}{task.name}|{task.fewshot}"
    return f"{task.name}_{task.formulation}|{task.fewshot}"


def custom_tasks_module(tasks: list[Benchmark], scratch: Path) -> tuple[Path, list[dict]]:
    """A lighteval custom-tasks file serving every task of the suite from local data, and its provenance."""

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
                  how: How | None = None, data_parallel: bool = False) -> BenchmarkScores:
    """Run lighteval's Pipeline with compass's offline custom tasks: every benchmark's aggregates, its data's
    provenance and each item as scored. On a GPU lighteval
    finds the largest batch that fits; `how` gives the attention kernel and torch.compile. `data_parallel`: this
    process is one of the step's ranks (tasks/evaluation/lighteval_ranks.py), lighteval's accelerate launcher
    splits the samples over them."""

    with grad_mode_kept():  # lighteval turns autograd off in this thread when it loads a model
        return _run_lighteval(model_dir, tasks, scratch, where, how, data_parallel)


def _run_lighteval(model_dir: Path, tasks: list[Benchmark], scratch: Path, where: Device | None, how: How | None,
                   data_parallel: bool) -> BenchmarkScores:

    started = time.perf_counter()
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
    results: dict[str, dict[str, float]] = {}
    items: dict[str, list[ItemScore]] = {}
    score_s = 0.0
    for limit, group in by_limit.items():
        launcher = ParallelismManager.ACCELERATE if data_parallel else ParallelismManager.NONE
        params = PipelineParameters(launcher_type=launcher, custom_tasks_directory=str(module), max_samples=limit)
        tracker = EvaluationTracker(output_dir=str(scratch / "lighteval"), save_details=False)
        attention = hf_attention(how, where.device) if how else None
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
        scoring = time.perf_counter()
        try:
            with torch.no_grad():  # lighteval relies on grad being off process-wide; a step runs with it on
                pipeline.evaluate()
        except RuntimeError as exc:
            if "must match the size of tensor" not in str(exc):
                raise
            raise RuntimeError(f"{', '.join(names.values())} on {model_dir}: lighteval cannot score an answer longer "
                               f"than the model's context ({_context_length(model_dir)} tokens): evaluate these "
                               "benchmarks on a model with a longer context, or in multiple-choice form (mcf)") from exc
        score_s += time.perf_counter() - scoring
        by_task = {_task_and_shots(k): v for k, v in names.items()}
        for key, metrics in pipeline.get_results()["results"].items():
            if key == "all":
                continue
            if _task_and_shots(key) not in by_task:
                raise RuntimeError(f"lighteval returned results for '{key}', none of the tasks asked for: "
                                   f"{', '.join(names)}")
            results[by_task[_task_and_shots(key)]] = {k: float(v) for k, v in metrics.items()}
        for key, details in pipeline.get_details().items():  # on the main process: every rank's items
            if _task_and_shots(key) in by_task:
                scored = (item_score(d.doc, d.model_response, d.metric) for d in details)
                items[by_task[_task_and_shots(key)]] = sorted(scored, key=lambda i: (len(i.item), i.item))
    return BenchmarkScores(results=results, provenance=provenance, items=items, score_s=score_s,
                           load_s=time.perf_counter() - started - score_s)


def _vllm_config(model_dir: Path, where: Device, how: How) -> Any:
    """lighteval's vLLM model on the step's GPUs (how.generation: vllm; validation refuses it on CPU specs)."""

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
