"""The success report: does the run meet the `why` success criteria? Pass or fail, with the numbers."""

from __future__ import annotations

import json

from compass.specs.base import Issue
from compass.specs.why import SuccessCriterion
from compass.tasks.common.inputs import Evaluations, evaluations_by_model
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepConfig, StepKind
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


def run_success_report(ctx: StepContext[ReportConfig]) -> StepResult:
    final = ctx.config.final
    measured = {role.removeprefix("eval:"): art.manifest.metrics for role, art in ctx.inputs.items()}
    rows = []
    for crit in ctx.config.criteria:
        checkpoint = final if crit.checkpoint == "final" else crit.checkpoint
        value = measured.get(checkpoint, {}).get(crit.metric)
        if value is None:
            verdict = "not measured"
            available = sorted(k for k, v in measured.get(checkpoint, {}).items() if isinstance(v, int | float))
            note = f"the evaluation of {checkpoint} has no metric '{crit.metric}' (it has: {', '.join(available)})"
        else:
            verdict = "pass" if crit.met_by(value) else "fail"
            note = ""
        rows.append({"criterion": f"{crit.metric} {crit.op} {crit.threshold}", "checkpoint": checkpoint,
                     "measured": value, "verdict": verdict, "note": note})
    passed = all(r["verdict"] == "pass" for r in rows)
    override = ctx.config.override
    (ctx.out / "report.json").write_text(json.dumps({"passed": passed, "criteria": rows, "override": override},
                                                    indent=2))
    lines = [f"- **{r['verdict'].upper()}** {r['criterion']} at `{r['checkpoint']}`: measured {r['measured']}"
             + (f" ({r['note']})" if r["note"] else "") for r in rows]
    summary = f"### success criteria: {'MET' if passed else 'NOT MET'}\n\n" + "\n".join(lines)
    if override:
        summary += f"\n\n**trained despite the gate** (why.override): {override}"
    return StepResult(metrics={"passed": passed, "criteria": rows, "override": override}, summary=summary,
                      tables={"success": rows})


KIND = StepKind("report", ReportConfig, run_success_report, build, version="1", inputs=Evaluations,
                after=("evaluate",), after_models=True,
                headline=("passed",))
STEP_KINDS = (KIND,)
