"""The gate: should this model be trained at all? The playbook's first question, measured instead of taken on
trust. Each existing model a production `why` names is evaluated on the spec's own benchmarks as the first steps
of the plan; when one already meets every success criterion that can be measured on it, training is not
justified and the run stops before any training step (`why.override` with a written reason lets it go on).

Models come as a hub id (from the local Hugging Face cache: nothing downloads), a local folder, or an s3:// URI.
The verdict is part of the committed artifact, so a cached re-run stops the same way."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compass.infra.fingerprint import weights_digest
from compass.specs.evaluation import Benchmark
from compass.specs.spec import TrainingSpec
from compass.specs.why import ProductionWhy, SuccessCriterion
from compass.tasks.common.devices import device_for
from compass.tasks.evaluation.intervals import criterion_verdict, item_values, mean_interval
from compass.tasks.evaluation.lighteval_run import run_lighteval
from compass.tasks.evaluation.scores import ItemScore
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import EVALUATION_HOW, TRANSFORMERS, NodeFile, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig

NOT_JUSTIFIED = "not justified"


class GateConfig(StepConfig):
    model: str  # hub id, folder or s3:// URI
    criteria: list[SuccessCriterion]  # those measurable on an existing model (benchmark metrics)
    benchmarks: list[Benchmark]  # the benchmarks those criteria read
    override: str | None = None


def measurable(criterion: SuccessCriterion, benchmarks: list[Benchmark]) -> bool:
    """A benchmark metric of the suite; perplexities depend on the tokenizer and do not compare across models."""
    return criterion.metric.partition("/")[0] in {t.key for t in benchmarks}


def build(plan: PlanBuilder) -> None:
    why = plan.spec.why
    if not isinstance(why, ProductionWhy):
        return
    benchmarks = plan.spec.what.evaluation.benchmarks
    criteria = [c for c in why.success_criteria if measurable(c, benchmarks)]
    keys = {c.metric.partition("/")[0] for c in criteria}
    for existing in why.existing_models:
        config = GateConfig(model=existing.model, criteria=criteria,
                            benchmarks=[t for t in benchmarks if t.key in keys], override=why.override)
        plan.add(KIND, slug(existing.model), config)


def slug(model: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:60] or "model"


def resolve_model(model: str, scratch: Path) -> tuple[Path, dict[str, Any]]:
    """The model's folder on this machine and where it came from (revision, for lineage)."""
    if model.startswith("s3://"):
        import fsspec

        local = scratch / "existing-model"
        fs, path = fsspec.core.url_to_fs(model)
        fs.get(path.rstrip("/") + "/", str(local), recursive=True)
        return local, {"source": model}
    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder.resolve(), {"source": str(folder.resolve())}
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(model, local_files_only=True))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"existing model '{model}' is not a folder and not in the local Hugging Face cache; "
                                f"bring it with `hf download {model}` where there is network") from None
    return snapshot, {"source": f"hf://{model}", "revision": snapshot.name}


def node_files(spec: TrainingSpec) -> Iterator[NodeFile]:
    """Each existing model the gate scores that comes from the Hugging Face cache."""
    for i, existing in enumerate(getattr(spec.why, "existing_models", [])):
        model = existing.model
        if model.startswith("s3://") or Path(model).expanduser().is_dir():
            continue
        with contextlib.suppress(OSError, ValueError):
            path, _ = resolve_model(model, Path())
            yield NodeFile(("why", "existing_models", i, "model"), f"the existing model {model} in the Hugging "
                           "Face cache", path)


def run_gate(ctx: StepContext[GateConfig]) -> StepResult:

    cfg = ctx.config
    folder, origin = resolve_model(cfg.model, ctx.scratch)
    measured = run_lighteval(folder, cfg.benchmarks, ctx.scratch, device_for(ctx.runtime.how), ctx.runtime.how)
    provenance = measured.provenance
    scores = {f"{task}/{m}": v for task, values in measured.results.items() for m, v in values.items()
              if not m.endswith("_stderr")}
    rows = [judged(c, scores.get(c.metric), measured.items) for c in cfg.criteria]
    meets_all = bool(rows) and all(r["met"] for r in rows)
    verdict = ("overridden" if cfg.override else NOT_JUSTIFIED) if meets_all else "justified"
    weights = weights_digest(folder)
    report = {"model": cfg.model, **origin, "weights_sha256": weights, "scores": scores, "criteria": rows,
              "verdict": verdict, "override": cfg.override}
    (ctx.out / "gate.json").write_text(json.dumps(report, indent=2))
    lines = "\n".join(f"- {r['criterion']}: measured {r['measured']}, 95% interval {r['interval']}: {r['verdict']}"
                      for r in rows)
    reason = {NOT_JUSTIFIED: f"`{cfg.model}` already meets every success criterion: training is not justified",
              "overridden": f"`{cfg.model}` already meets every success criterion; training goes on because: "
                            f"{cfg.override}",
              "justified": f"`{cfg.model}` falls short of the success criteria: training is justified"}[verdict]
    summary = f"### gate: {reason}\n\n{lines}"
    return StepResult(metrics=report, summary=summary, tables={"gate": rows},
                      provenance=[{"model": cfg.model, **origin, "weights_sha256": weights}, *provenance])


def judged(criterion: SuccessCriterion, value: float | None, items: dict[str, list[ItemScore]]) -> dict[str, Any]:
    """A criterion on the existing model: met only when the interval over the benchmark's items clears the
    threshold (an existing model that meets it by noise alone does not make training unjustified)."""
    values = item_values(criterion.metric, items)
    interval = mean_interval(values) if values else None
    verdict = criterion_verdict(criterion, interval) if value is not None else "not measured"
    return {"criterion": f"{criterion.metric} {criterion.op} {criterion.threshold}", "measured": value,
            "interval": [round(x, 4) for x in interval] if interval else None, "verdict": verdict,
            "met": verdict == "met" or (verdict == "no interval" and criterion.met_by(value)),
            "items": len(values or [])}


def stops_the_run(metrics: dict[str, Any]) -> str | None:
    """Why the run must stop after this gate (None: it goes on)."""
    if metrics.get("verdict") != NOT_JUSTIFIED:
        return None
    shown = ", ".join(f"{r['criterion']} (measured {r['measured']:.4g}, 95% interval {r['interval']})"
                      for r in metrics["criteria"])
    return (f"training is not justified: the existing model {metrics['model']} already meets every success "
            f"criterion: {shown}. Use it, raise the bar in why.success_criteria, or set why.override to the "
            "reason to train anyway")


# 2: a criterion is met only when its 95% interval over the benchmark's items clears the threshold
KIND = StepKind("gate", GateConfig, run_gate, build, version="2", resources=phase("evaluation"),
                imports=TRANSFORMERS, node_files=node_files, stops_run=stops_the_run,
                reads_how=EVALUATION_HOW)
STEP_KINDS = (KIND,)
