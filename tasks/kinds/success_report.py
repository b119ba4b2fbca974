"""The success report: does the run meet the `why` success criteria? Pass or fail, with the numbers."""

from __future__ import annotations

import json
import operator

from compass.specs.why import SuccessCriterion
from compass.tasks.kinds.evaluate import step_name
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepConfig, StepKind

OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


class ReportConfig(StepConfig):
    criteria: list[SuccessCriterion]
    final: str  # the model step 'final' stands for
    override: str | None = None  # why the run trained although an existing model met the criteria


def build(plan: PlanBuilder) -> None:
    """The report reads the evaluations of the checkpoints its criteria name, nothing else."""
    criteria = plan.spec.why.success_criteria
    named = {plan.checkpoint(c.checkpoint, ("why", "success_criteria", i, "checkpoint"))
             for i, c in enumerate(criteria)}
    if not plan.of_kind("evaluate"):
        return  # nothing is evaluated: there is nothing to report on
    inputs = {f"eval:{m}": f"evaluate:{step_name(m)}" for m in sorted(n for n in named if n)}
    plan.add(KIND, "success", ReportConfig(criteria=criteria, final=plan.model_steps[-1],
                                           override=plan.spec.why.override), inputs)


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
            verdict = "pass" if OPS[crit.op](value, crit.threshold) else "fail"
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


KIND = StepKind("report", ReportConfig, run_success_report, build, version="1",
                headline=("passed",))
STEP_KINDS = (KIND,)
