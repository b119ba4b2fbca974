"""Evaluation of one model step: lighteval on the benchmarks the spec names (compass's offline benchmarks in CF or
MCF, or lighteval's own tasks on local data), the validation loss and perplexity of each curated source the spec
lists, and passkey retrieval at every trained length when the spec extends the context."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from compass.infra.errors import StopRequested
from compass.infra.layout import CHECKPOINTS, FINAL, HELDOUT, METRICS, WEIGHTS, checkpoint_step
from compass.model.attention import DOCUMENT_SDPA, register
from compass.model.training.history import checkpoint_tokens, tokens_seen
from compass.model.training.records import GoodputSplit, goodput_table
from compass.model.training.trackers import Trackers
from compass.specs.base import Issue
from compass.specs.evaluation import COMPASS_BENCHMARKS, Benchmark, Evaluation
from compass.specs.how import How, slurm_seconds
from compass.specs.spec import TrainingSpec
from compass.tasks.common.devices import Device, device_for, setup_of
from compass.tasks.common.inputs import EvaluateInputs, tokens
from compass.tasks.common.tracking import tracker_run_of
from compass.tasks.evaluation.costs import evaluation_costs
from compass.tasks.evaluation.heldout_reads import heldout_sample
from compass.tasks.evaluation.lighteval_benchmarks import TaskDataMissing, locate
from compass.tasks.evaluation.lighteval_run import run_lighteval
from compass.tasks.evaluation.live_results import live_scores
from compass.tasks.evaluation.scored import ModelEvaluation, ScoredCheckpoints, folder_digest
from compass.tasks.evaluation.scores import ITEMS, BenchmarkScores
from compass.tasks.steps.context import InputArtifact, StepContext, StepResult
from compass.tasks.steps.kind import EVALUATION_HOW, TRANSFORMERS, NodeFile, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig

# how this kind scores (in its steps' fingerprints and in the suite hash live evaluations key their results by)
VERSION = "4"


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


def build(plan: PlanBuilder) -> None:
    ev = plan.spec.what.evaluation
    if not (ev.benchmarks or ev.perplexity_sources):
        return
    retrieval = retrieval_of(plan.spec)
    config = EvaluateConfig(suite=ev, every_checkpoint=plan.spec.how.evaluation.every_checkpoint, retrieval=retrieval)
    for model in plan.evaluated_models():
        inputs = EvaluateInputs(model=model, tokenizer=plan.tokenizer(), tokens=tokens(plan, ev.perplexity_sources),
                                haystack=plan.require("tokenize", retrieval.source) if retrieval else None)
        plan.add(KIND, f"{model.kind}-{model.name}", config, inputs)  # evaluate:<kind>-<name>


def check_spec(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    """The evaluation jobs' time limit against one checkpoint's scoring, once every benchmark is one compass knows
    (specs/checks.py says which is not)."""
    if not any(task.source == "compass" and task.formulation not in COMPASS_BENCHMARKS.get(task.name, ())
               for task in spec.what.evaluation.benchmarks):
        yield from check_time_limit(spec)


def check_time_limit(spec: TrainingSpec) -> Iterator[Issue]:
    """One checkpoint's scoring (tasks/evaluation/costs.py) fits in one evaluation job: a job asked to stop ends
    between checkpoints, so a checkpoint longer than the job's time never completes and the step never ends."""
    limit = spec.how.shape("evaluation").time_limit
    if limit is None:
        return
    too_long = [c for c in evaluation_costs(spec) if not c.fits]
    if not too_long:
        return
    given = spec.how.resources.evaluation.time_limit
    at = ("how", "resources", "evaluation", "time_limit") if given else ("how", "orchestration", "cluster",
                                                                           "time_limit")
    worst = max(too_long, key=lambda c: c.per_checkpoint_s)
    needed = worst.per_checkpoint_s + worst.startup_s + worst.stop_lead_s
    steps = ", ".join(c.step for c in too_long)
    yield Issue(at, f"{steps}: one checkpoint's evaluation takes ~{needed / 60:,.0f} min ({worst.step}: "
                f"{worst.tokens:.3g} tokens scored, start-up and the stop signal's lead included), longer than the "
                f"evaluation jobs' time limit {limit} ({slurm_seconds(limit) / 60:,.0f} min): no job could finish a "
                "checkpoint", f"set how.resources.evaluation.time_limit to at least {math.ceil(needed / 3600)}:00:00, "
                "give the evaluation phase more devices (how.resources.evaluation.devices_per_node), or score fewer "
                "benchmark items (limit)")


def check_machine(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    """Every lighteval benchmark's dataset is on this machine before any work starts."""

    for i, task in enumerate(spec.what.evaluation.benchmarks):
        if task.source == "lighteval":
            try:
                locate(task.name, task.fewshot)
            except TaskDataMissing as e:
                yield Issue(("what", "evaluation", "benchmarks", i, "name"), str(e), e.hint)


def node_files(spec: TrainingSpec) -> Iterator[NodeFile]:
    """Each lighteval task's dataset in the Hugging Face cache (one this machine lacks is check_machine's error)."""

    for i, task in enumerate(spec.what.evaluation.benchmarks):
        if task.source == "lighteval":
            try:
                yield NodeFile(("what", "evaluation", "benchmarks", i, "name"),
                               f"the dataset of lighteval task {task.name}", locate(task.name, task.fewshot).dataset)
            except TaskDataMissing:
                continue


def trained_length(config: Any) -> int:
    """The context the model was trained at (YaRN/linear scaling raise max_position_embeddings beyond it)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return int(rope.get("original_max_position_embeddings") or config.max_position_embeddings)


Lighteval = Callable[[Path, list[Benchmark], Path], BenchmarkScores]


def evaluate_model(model_dir: Path, suite: Evaluation, sources: dict[str, Path], scratch: Path,
                   retrieval: Retrieval | None = None, haystack: Path | None = None,
                   where: Device | None = None, how: How | None = None,
                   lighteval: Lighteval | None = None, scored: dict[str, float] | None = None) -> ModelEvaluation:
    """Score one Hugging Face checkpoint. `lighteval` runs the benchmarks (default: lighteval in this process);
    `scored`: its benchmark scores as an evaluation outside the run computed them (then only the held-out and
    passkey scores are computed here)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from compass.model.training.heldout import heldout_losses

    scratch.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {}
    rows: list[dict] = []
    scores = BenchmarkScores()
    load_s = score_s = 0.0
    if suite.benchmarks and scored is not None:
        metrics.update(scored)
    elif suite.benchmarks:
        began = time.perf_counter()
        if lighteval is not None:
            scores = lighteval(model_dir, suite.benchmarks, scratch)
        else:
            scores = run_lighteval(model_dir, suite.benchmarks, scratch, where, how)
        score_s += scores.score_s
        load_s += time.perf_counter() - began - scores.score_s
        for name, values in scores.results.items():
            for metric, value in values.items():
                if not metric.endswith("_stderr"):
                    metrics[f"{name}/{metric}"] = value = float(value)
                    rows.append({"task": name, "metric": metric, "value": round(value, 4),
                                 "stderr": round(values.get(f"{metric}_stderr", float("nan")), 4)})
    if sources:

        register()

        device = torch.device(where.device if where else "cpu")
        began = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=DOCUMENT_SDPA,
                                                     dtype=getattr(torch, where.dtype if where else "float32"))
        model.to(device)
        loaded = time.perf_counter()
        losses = heldout_losses(model, sources, trained_length(model.config), masking=True,
                                device=device)
        load_s += loaded - began
        score_s += time.perf_counter() - loaded
        for name, loss in losses.items():
            metrics[f"val_loss:{name}"] = loss
            metrics[f"val_ppl:{name}"] = math.exp(loss)
            rows.append({"task": f"held-out {name}", "metric": "perplexity", "value": round(math.exp(loss), 3),
                         "stderr": ""})
    if retrieval and haystack is not None:
        from compass.model.training.heldout_sample import HeldoutSample
        from compass.model.training.token_files import TokenizedSource
        from compass.tasks.evaluation.retrieval import passkey_accuracy

        began = time.perf_counter()
        text = HeldoutSample(TokenizedSource(haystack, HELDOUT)).tokens
        cells = passkey_accuracy(model_dir, np.asarray(text), retrieval.lengths, retrieval.depths, retrieval.samples,
                                 where=where)
        score_s += time.perf_counter() - began
        for length in retrieval.lengths:
            at = [c for c in cells if c["length"] == length]
            if not at:
                continue
            metrics[f"passkey@{length}"] = sum(c["accuracy"] for c in at) / len(at)
            for c in at:
                metrics[f"passkey@{length}/depth{c['depth']}"] = float(c["accuracy"])
                rows.append({"task": f"passkey {length} tokens, depth {c['depth']}", "metric": "accuracy",
                             "value": c["accuracy"], "stderr": ""})
    return ModelEvaluation(metrics=metrics, rows=rows, provenance=scores.provenance, items=scores.items,
                           load_s=load_s, score_s=score_s)


def run_evaluate(ctx: StepContext[EvaluateConfig]) -> StepResult:
    """Evaluate the model step's final weights, and with `every_checkpoint` each checkpoint it kept: the
    points of the evaluation curves (metric against tokens seen). Checkpoints are read one at a time, and each one's
    scores are kept in the work folder by its files' digest: an attempt after a stop (the job's time limit near:
    the stop file), a requeue or a crash scores only what no attempt scored yet."""
    started = time.perf_counter()
    suite = ctx.config.suite
    given = ctx.given(EvaluateInputs)
    model = given.model
    # only what is scored: the final weights (and, one at a time, the kept checkpoints), the history, the held-out
    # samples; never a model's training state, a source's training split or the rest of its held-out split (the
    # step's resource ledger shows it)
    model_folder = model.local(METRICS)  # the history: tokens seen at each checkpoint
    sources = {name: heldout_sample(tokens) for name, tokens in given.tokens.items()}
    retrieval = ctx.config.retrieval
    haystack = heldout_sample(given.haystack) if given.haystack else None
    where = device_for(ctx.runtime.how)
    lighteval = _lighteval_on_ranks(ctx, where)
    scored = ScoredCheckpoints(ctx.workdir / "scored")
    reused = 0
    this_attempt: list[ModelEvaluation] = []  # its time split: what an earlier attempt scored took that one's time

    live = 0  # checkpoints whose benchmarks an evaluation outside the run scored (compass deploy's, per checkpoint)

    def evaluated_at(folder_in_artifact: str, name: str) -> ModelEvaluation:
        nonlocal reused, live
        digest = folder_digest(model.manifest.files, folder_in_artifact)
        if (kept := scored.get(digest)) is not None:
            reused += 1
            return kept
        # the final model's items are scored here (a paired verdict reads them); a kept checkpoint's benchmark
        # scores are taken from a live evaluation of the same weights and suite where one exists
        outside = None if folder_in_artifact == FINAL else _live_scores(ctx, model, folder_in_artifact, where)
        live += outside is not None
        folder = model.local_folder(folder_in_artifact)
        evaluation = evaluate_model(folder, suite, sources, ctx.scratch / name, retrieval, haystack, where,
                                    ctx.runtime.how, lighteval, outside)
        scored.put(digest, evaluation)
        this_attempt.append(evaluation)
        model.release(folder, folder_in_artifact)
        _stop_if_asked(ctx, scored.count())
        return evaluation

    final = evaluated_at(FINAL, FINAL)
    final_metrics = final.metrics
    curve = []
    evaluated = [final]
    if ctx.config.every_checkpoint and (names := _checkpoint_names(model)):
        checkpoints = checkpoint_tokens(model_folder, names)
        for name, tokens in checkpoints[:-1]:  # the last kept checkpoint holds the final weights
            under = f"{CHECKPOINTS}/{name}"
            evaluated.append(evaluated_at(under, name))
            values = evaluated[-1].metrics
            curve.append({"checkpoint": name, "tokens": tokens, **values})
            ctx.log.info("%s %s (%s tokens): %s", model.step_id, name, tokens, _shown(values))
        curve.append({"checkpoint": checkpoints[-1][0], "tokens": checkpoints[-1][1], **final_metrics})
    else:
        curve.append({"checkpoint": FINAL, "tokens": tokens_seen(model_folder), **final_metrics})
    if reused:
        ctx.log.info("%s: %d of %d checkpoint(s) scored by an earlier attempt, not scored again", model.step_id,
                     reused, len(evaluated))
    goodput = evaluation_split(this_attempt, time.perf_counter() - started)
    metrics = {"checkpoint": model.step_id, "tokens_seen": tokens_seen(model_folder), **final_metrics,
               "curve": curve, "scored_before": reused, "benchmarks_scored_live": live,
               "setup": setup_of(ctx.runtime.how),
               "goodput": goodput.model_dump(mode="json")}
    (ctx.out / "results.json").write_text(json.dumps(metrics, indent=2))
    if final.items:  # the final model's benchmark items as scored: what a paired verdict and a recount read
        (ctx.out / ITEMS).write_text(json.dumps({k: [i.model_dump() for i in v] for k, v in final.items.items()}))
    _to_tensorboard(ctx, model.step_id, curve)
    _to_trackers(ctx, curve)
    summary = (f"### evaluate `{model.step_id}`\n\n{_shown(final_metrics)}\n\n"
               f"{len(curve)} checkpoint(s) evaluated: {', '.join(p['checkpoint'] for p in curve)}; {goodput.line()}")
    return StepResult(metrics=metrics, summary=summary, tables={"evaluation": final.rows, **goodput_table(goodput)},
                      provenance=final.provenance)


def _live_scores(ctx: StepContext[EvaluateConfig], model: InputArtifact, folder: str,
                 where: Device) -> dict[str, float] | None:
    """The benchmark scores an evaluation outside the run wrote for the weights under `folder`, if any."""
    weights = next((e.sha256 for e in model.manifest.files if e.path == f"{folder}/{WEIGHTS}"), None)
    if ctx.store is None or weights is None or not ctx.config.suite.benchmarks:
        return None
    found = live_scores(ctx.store, ctx.config.suite.benchmarks, VERSION, weights, where)
    if found is not None:
        ctx.log.info("%s %s: benchmark scores taken from the live evaluation of these weights", model.step_id,
                     folder.rsplit("/", 1)[-1])
    return found


def _checkpoint_names(model: InputArtifact) -> list[str]:
    """The kept checkpoints' folder names, from the model's manifest (none copied to read them)."""
    prefix = f"{CHECKPOINTS}/"
    names = {e.path[len(prefix):].split("/", 1)[0] for e in model.manifest.files if e.path.startswith(prefix)}
    return sorted(n for n in names if checkpoint_step(n) is not None)


def _stop_if_asked(ctx: StepContext[EvaluateConfig], scored: int) -> None:
    """Between two checkpoints: a job near its time limit (the batch shell touched the stop file, infra/slurm.py)
    ends here; its scores so far are kept and the requeued job goes on from the next checkpoint."""
    stop = os.environ.get("COMPASS_STOP_FILE")
    if stop and Path(stop).exists():
        raise StopRequested(scored, f"stopped on request with {scored} checkpoint(s) scored and kept in "
                                    f"{ctx.workdir / 'scored'}; the next attempt scores the rest")


def evaluation_split(evaluated: list[ModelEvaluation], total_s: float) -> GoodputSplit:
    """Where an evaluation step's time went: scoring is its goodput; starting ranks, preparing benchmarks and
    loading each checkpoint its start-up; the rest (reading inputs, writing results) other. One attempt: a retried
    evaluation scores again from the start."""
    score = sum(e.score_s for e in evaluated)
    load = sum(e.load_s for e in evaluated)
    return GoodputSplit(total_s=total_s, compute_s=score, startup_s=load, data_wait_s=0.0, checkpoint_s=0.0,
                        evaluation_s=0.0, restart_s=0.0, redone_s=0.0, other_s=max(0.0, total_s - score - load),
                        attempts=1)


def _lighteval_on_ranks(ctx: StepContext[EvaluateConfig], where: Device) -> Lighteval | None:
    """With several devices for evaluation (and transformers generating), lighteval runs data-parallel on them;
    its folders on the step's work folder, which the ranks of several nodes share."""
    how = ctx.runtime.how
    shape = ctx.runtime.placement.shape
    if shape is None or shape.ranks <= 1 or how.generation == "vllm":  # vLLM spreads over the GPUs itself
        return None
    from compass.tasks.evaluation.lighteval_ranks import lighteval_on_ranks

    def run(model_dir: Path, tasks: list[Benchmark], scratch: Path) -> tuple[dict, list[dict]]:
        return lighteval_on_ranks(model_dir, tasks, ctx.workdir / "lighteval" / scratch.name, where, how, shape,
                                  ctx.runtime, ctx.log)

    return run


def _to_tensorboard(ctx: StepContext[EvaluateConfig], model_step: str, curve: list[dict[str, Any]]) -> None:
    """Scores against tokens in the evaluated step's TensorBoard run, beside its training curves."""
    if "tensorboard" not in ctx.runtime.how.monitoring.trackers:
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


def _to_trackers(ctx: StepContext[EvaluateConfig], curve: list[dict[str, Any]]) -> None:
    """The scores of every evaluated checkpoint in this step's tracker run, against the tokens it had seen."""
    run = tracker_run_of(ctx)
    if run is None:
        return
    trackers = Trackers(run)
    try:
        for point in curve:
            if point.get("tokens") is not None:
                trackers.log({f"eval/{k}": v for k, v in point.items() if isinstance(v, float) and "/depth" not in k},
                             int(point["tokens"]))
    finally:
        trackers.close()


def _shown(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in values.items() if isinstance(v, float))


# 3: held-out loss packed by the new packer, with the chunked loss and per-document attention
KIND = StepKind("evaluate", EvaluateConfig, run_evaluate, build, version=VERSION, resources=phase("evaluation"),
                imports=TRANSFORMERS, check_spec=check_spec, check_machine=check_machine,
                node_files=node_files, reads_how=EVALUATION_HOW, inputs=EvaluateInputs, after=("tokenize",),
                after_models=True, headline=("*:cf/acc", "*verified_acc", "val_ppl:*"))
STEP_KINDS = (KIND,)
