"""What a run ends with, for the person who started it: the success criteria with their numbers and verdicts, and
where the report, the plots and the Prefect run are (the last lines of `compass run`; `--json` carries the same).
A run that ends "exit 0" while its own report says NOT MET must say so where it ends."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from compass.flows.reports.step_record import StepRecord
from compass.infra.layout import COMPARISON
from compass.infra.resource_ledger import Resources
from compass.infra.store import Store
from compass.model.training.records import GoodputSplit, summed
from compass.tasks.common.comparison import Comparison

PLOTTING_KINDS = ("curves", "compare")  # the run-level plots (each training stage's loss.png sits in its step)


class Criterion(BaseModel):
    model_config = ConfigDict(frozen=True)

    criterion: str  # "metric op threshold"
    checkpoint: str
    measured: float | None
    verdict: str  # pass, fail, or "not measured"
    note: str = ""  # why it could not be judged
    interval: tuple[float, float] | None = None  # the 95% interval over the benchmark's items, where it has items

    def line(self) -> str:
        """`arc_easy:cf/acc >= 0.3 at evaluate:...: 0.42 (95% interval 0.36 to 0.48), pass`."""
        if self.measured is None:
            return f"{self.criterion} at {self.checkpoint}: not measured ({self.note})"
        interval = f" (95% interval {self.interval[0]:.4g} to {self.interval[1]:.4g})" if self.interval else ""
        return f"{self.criterion} at {self.checkpoint}: {self.measured:.4g}{interval}, {self.verdict}"


class Verdict(BaseModel):
    """The success report's judgement of the spec's `why.success_criteria`."""

    model_config = ConfigDict(frozen=True)

    passed: bool
    criteria: tuple[Criterion, ...]
    report: str  # the report.json's location in the store

    def headline(self) -> str:
        """`MET: 2 of 2 pass`."""
        passing = sum(c.verdict == "pass" for c in self.criteria)
        return f"{'MET' if self.passed else 'NOT MET'}: {passing} of {len(self.criteria)} pass"


class AblationVerdict(BaseModel):
    """One variant of the ablations against the baseline: its difference on the comparison's metric, the 95%
    interval paired by seed, and the verdict (better, worse, within noise)."""

    model_config = ConfigDict(frozen=True)

    variant: str
    metric: str
    delta: float
    interval: tuple[float, float] | None
    verdict: str

    def line(self) -> str:
        """`untied: val_loss -0.0213 (95% interval -0.031 to -0.0116), better`."""
        interval = f" (95% interval {self.interval[0]:.3g} to {self.interval[1]:.3g})" if self.interval else ""
        return f"{self.variant}: {self.metric} {self.delta:+.3g}{interval}, {self.verdict}"


class KindResources(BaseModel):
    """What the steps of one kind that ran in this run read, copied, wrote and sent (their manifests' resource
    ledgers summed: the jobs' and ranks' counts, wherever they ran)."""

    model_config = ConfigDict(frozen=True)

    kind: str
    steps: int
    resources: Resources


class RunOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    verdict: Verdict | None  # None: the run did not reach its success report (--until, or the spec has none)
    plots: tuple[str, ...]
    prefect_run: str | None  # the flow run's page in the Prefect UI
    goodput: GoodputSplit | None = None  # the steps that trained or evaluated in this run (not the cached), summed
    goodput_steps: int = 0
    resources: tuple[KindResources, ...] = ()  # by kind, in the order the kinds first ended
    ablations: tuple[AblationVerdict, ...] = ()  # the comparison's verdict of each variant, when the run compared


def run_outcome(results: list[StepRecord], store: Store, prefect_run: str | None = None) -> RunOutcome:
    """From the run's step records and their committed manifests."""
    verdict, plots, splits = None, [], []
    ablations: list[AblationVerdict] = []
    by_kind: dict[str, tuple[int, Resources]] = {}
    for result in results:
        kind = result.kind
        if result.executed:
            manifest = store.read_manifest(result.uri)
            split = (manifest.metrics or {}).get("goodput")
            if split:
                splits.append(GoodputSplit.model_validate(split))
            if manifest.resources is not None:
                steps, total = by_kind.get(kind, (0, Resources()))
                by_kind[kind] = (steps + 1, total.merged(manifest.resources))
        if kind == "report":
            metrics = store.read_manifest(result.uri).metrics or {}
            verdict = Verdict(passed=bool(metrics.get("passed")), report=f"{result.uri}/report.json",
                              criteria=tuple(Criterion(**row) for row in metrics.get("criteria", [])))
        elif kind in PLOTTING_KINDS:
            plots += [f"{result.uri}/{f.path}" for f in store.read_manifest(result.uri).files
                      if f.path.endswith(".png")]
        if kind == "compare":
            ablations += _ablation_verdicts(store, result.uri)
    return RunOutcome(verdict=verdict, plots=tuple(plots), prefect_run=prefect_run, goodput=summed(splits),
                      ablations=tuple(ablations),
                      goodput_steps=len(splits),
                      resources=tuple(KindResources(kind=k, steps=n, resources=r) for k, (n, r) in by_kind.items()))


def _ablation_verdicts(store: Store, uri: str) -> list[AblationVerdict]:
    """Each variant's row of the committed comparison (the baseline's row, its reference, left out)."""
    comparison = Comparison.model_validate_json(store.read_bytes(uri, COMPARISON))
    return [AblationVerdict(variant=r.variant, metric=comparison.metric, delta=r.delta, verdict=r.verdict,
                            interval=tuple(r.interval) if r.interval and len(r.interval) == 2 else None)
            for r in comparison.rows[1:]]


def outcome_lines(outcome: RunOutcome, log: str | None = None) -> list[str]:
    """The lines a terminal shows: the verdict first, each criterion with its number, then where things are (`log`:
    the file holding what the terminal left out)."""
    lines = []
    if outcome.verdict is not None:
        v = outcome.verdict
        lines.append(f"success criteria {v.headline()}")
        lines += [f"  {c.line()}" for c in v.criteria]
        lines.append(f"report: {v.report}")
    if outcome.ablations:
        lines.append(f"ablations against the baseline ({outcome.ablations[0].metric}, paired by seed):")
        lines += [f"  {a.line()}" for a in outcome.ablations]
    if outcome.goodput is not None:
        n = outcome.goodput_steps
        lines.append(f"time of the {n} step{'s' * (n != 1)} that trained or evaluated: {outcome.goodput.line()}")
    if outcome.resources:
        lines.append("what the steps that ran read, copied and wrote (their resource ledgers), by kind:")
        lines += [f"  {k.kind} ({k.steps} step{'s' * (k.steps != 1)}): {k.resources.line()}" for k in outcome.resources]
    if outcome.plots:
        lines.append(f"plots: {', '.join(outcome.plots)}")
    if log:
        lines.append(f"log: {log}")
    if outcome.prefect_run:
        lines.append(f"Prefect run: {outcome.prefect_run}")
    return lines
