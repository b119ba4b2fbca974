"""The success report: does the run meet the `why` success criteria? Pass or fail, with the numbers."""

from __future__ import annotations

import json

from compass.specs.base import Issue
from compass.specs.why import SuccessCriterion
from compass.tasks.common.inputs import Evaluations, evaluations_by_model
from compass.tasks.evaluation.intervals import criterion_verdict, item_values, mean_interval
from compass.tasks.evaluation.scores import ITEMS, ItemScore
from compass.tasks.steps.context import InputArtifact, StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepKind
from compass.tasks.steps.step_config import StepConfig
from compass.tasks.steps.wiring import StepRef


class ReportConfig(StepConfig):
    criteria: list[SuccessCriterion]
    final: str  # the model step 'final' stands for
    override: str | None = None  # why the run trained although an existing model met the criteria


def build(plan: PlanBuilder) -> None:
    """The report reads the evaluations of the checkpoints its criteria name, nothing else."""
    criteria = plan.spec.why.success_criteria
    evaluations = evaluations_by_model(plan)
    named: dict[str, StepRef] = {}
    for i, c in enumerate(criteria):
        at = ("why", "success_criteria", i, "checkpoint")
        model = plan.checkpoint(c.checkpoint, at)
        if model is None or not evaluations:
            continue
        if model.id not in evaluations:
            plan.issues.append(Issue(at, f"checkpoint '{c.checkpoint}' ({model.id}) is not evaluated",
                                     f"name one of: {', '.join(evaluations)}"))
            continue
        named[model.id] = evaluations[model.id]
    if not evaluations:
        return  # nothing is evaluated: there is nothing to report on
    final = plan.newest_model()
    plan.add(KIND, "success", ReportConfig(criteria=criteria, final=final.id if final else "",
                                           override=plan.spec.why.override), Evaluations(dict(sorted(named.items()))))


def items_of(art: InputArtifact) -> dict[str, list[ItemScore]]:
    """The evaluated model's benchmark items as scored (none for an evaluation without benchmarks)."""
    entry = next((e for e in art.files("") if e.path == ITEMS), None)
    if entry is None:
        return {}
    with art.open(entry) as f:
        kept = json.load(f)
    return {key: [ItemScore.model_validate(i) for i in items] for key, items in kept.items()}


def run_success_report(ctx: StepContext[ReportConfig]) -> StepResult:
    """Pass or fail only when the criterion's 95% interval over the benchmark's items clears its threshold; a
    metric without items (a perplexity over held-out tokens) is judged by its value."""
    final = ctx.config.final
    evaluations = ctx.given(Evaluations).evaluations  # by the evaluated model's step id
    measured = {model: art.manifest.metrics for model, art in evaluations.items()}
    items = {model: items_of(art) for model, art in evaluations.items()}
    rows = []
    for crit in ctx.config.criteria:
        checkpoint = final if crit.checkpoint == "final" else crit.checkpoint
        value = measured.get(checkpoint, {}).get(crit.metric)
        values = item_values(crit.metric, items.get(checkpoint, {}))
        interval = mean_interval(values) if values else None
        note = ""
        if value is None:
            verdict = "not measured"
            available = sorted(k for k, v in measured.get(checkpoint, {}).items() if isinstance(v, int | float))
            note = f"the evaluation of {checkpoint} has no metric '{crit.metric}' (it has: {', '.join(available)})"
        elif interval is None:
            verdict = "pass" if crit.met_by(value) else "fail"
        else:
            verdict = {"met": "pass", "missed": "fail", "within noise": "within noise"}[
                criterion_verdict(crit, interval)]
            if verdict == "within noise":
                note = (f"the 95% interval over {len(values or [])} items, {interval[0]:.4g} to {interval[1]:.4g}, "
                        f"straddles {crit.threshold}: evaluate more items (the benchmark's limit) to decide")
        rows.append({"criterion": f"{crit.metric} {crit.op} {crit.threshold}", "checkpoint": checkpoint,
                     "measured": value, "interval": [round(x, 4) for x in interval] if interval else None,
                     "verdict": verdict, "note": note})
    passed = all(r["verdict"] == "pass" for r in rows)
    override = ctx.config.override
    (ctx.out / "report.json").write_text(json.dumps({"passed": passed, "criteria": rows, "override": override},
                                                    indent=2))
    lines = [f"- **{r['verdict'].upper()}** {r['criterion']} at `{r['checkpoint']}`: measured "
             + ("nothing" if r["measured"] is None else f"{r['measured']:.4g}")
             + (f", 95% interval {r['interval'][0]:.4g} to {r['interval'][1]:.4g}" if r["interval"] else "")
             + (f" ({r['note']})" if r["note"] else "") for r in rows]
    summary = f"### success criteria: {'MET' if passed else 'NOT MET'}\n\n" + "\n".join(lines)
    if override:
        summary += f"\n\n**trained despite the gate** (why.override): {override}"
    return StepResult(metrics={"passed": passed, "criteria": rows, "override": override}, summary=summary,
                      tables={"success": rows})


# 2: pass or fail only when the interval over the benchmark's items clears the threshold; 3: the summary rounds
KIND = StepKind("report", ReportConfig, run_success_report, build, version="3", inputs=Evaluations,
                after=("evaluate",), after_models=True,
                headline=("passed",))
STEP_KINDS = (KIND,)
