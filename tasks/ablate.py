"""Ablations: one short training run per (variant, seed) on the baseline's proxy model and budget, and the
comparison that says, per variant, whether the change helped, hurt, or stayed within the seed noise."""

from __future__ import annotations

import json
import statistics
from typing import Any

from compass.model.job import StageRecipe
from compass.specs.ablation import AblationBaseline
from compass.specs.architecture import Architecture
from compass.specs.training import Monitors, Optimizer, PretrainStage, Schedule
from compass.tasks.base import StepContext, StepResult
from compass.tasks.steps import TRANSFORMERS, PlanBuilder, StepConfig, StepKind
from compass.tasks.tokenize import data_inputs
from compass.tasks.training import build_job, run_training


class AblateConfig(StepConfig):
    """One (variant, seed) run: the baseline with `change` applied (a dotted field and its value)."""

    architecture: Architecture
    baseline: AblationBaseline
    change: dict[str, Any]
    seed: int
    optimizer: Optimizer
    metrics: list[str]
    schedule: Schedule
    monitors: Monitors
    intra_document_masking: bool

    def recipe(self) -> StageRecipe:
        """The pretraining recipe of this run: proxy architecture, one stage, this seed."""
        base = {"architecture": {**self.architecture.model_dump(), **self.baseline.architecture},
                **self.baseline.model_dump(exclude={"architecture"})}
        run = apply_change(base, self.change)
        stage = PretrainStage(name="ablation", tokens=run["tokens"], sequence_length=run["sequence_length"],
                              global_batch_size=run["global_batch_size"], mixture=run["mixture"])
        optimizer = self.optimizer.model_copy(update={"lr": run["lr"]}) if run.get("lr") else self.optimizer
        return StageRecipe(architecture=Architecture.model_validate(run["architecture"]), optimizer=optimizer,
                           schedule=self.schedule, stages=[stage], stage="ablation", seed=self.seed,
                           intra_document_masking=self.intra_document_masking, monitors=self.monitors)


class CompareConfig(StepConfig):
    metrics: list[str]
    seeds: list[int]


def build(plan: PlanBuilder) -> None:
    what = plan.spec.what
    abl, pt = what.ablations, what.pretraining
    if abl is None:
        return
    runs = {}
    for variant, change in [("baseline", {}), *((v.name, v.change) for v in abl.variants)]:
        for seed in abl.seeds:
            config = AblateConfig(architecture=what.architecture, baseline=abl.baseline, change=change, seed=seed,
                                  optimizer=pt.optimizer, metrics=abl.metrics, schedule=pt.schedule,
                                  monitors=pt.monitors, intra_document_masking=pt.intra_document_masking)
            step_id = plan.add(ABLATE, f"{variant}-s{seed}", config, data_inputs(plan, list(abl.baseline.mixture)))
            runs[step_id.replace(":", "/")] = step_id
    plan.add(COMPARE, "ablations", CompareConfig(metrics=abl.metrics, seeds=abl.seeds), runs)


def apply_change(baseline: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """The baseline with one dotted field set (e.g. architecture.tied_embeddings, mixture, lr)."""
    out = json.loads(json.dumps(baseline))
    for path, value in change.items():
        node = out
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return out


def run_ablation(ctx: StepContext[AblateConfig]) -> StepResult:
    result = run_training(build_job(ctx, ctx.config.recipe()), ctx.log, ctx.runtime.how.orchestration.cluster)
    val = result["val_loss"]
    metrics = {"val_loss": statistics.fmean(val.values()), "val_loss_by_source": val,
               "final_loss": result["final_loss"], "tokens": result["tokens"], "seed": ctx.config.seed,
               "change": ctx.config.change}
    (ctx.out / "metrics.jsonl").write_text((ctx.workdir / "metrics.jsonl").read_text())
    summary = (f"### ablation `{ctx.name}`\n\nchange {ctx.config.change or 'none (baseline)'}; "
               f"validation loss {metrics['val_loss']:.4f} after {result['tokens']:,} tokens")
    return StepResult(metrics=metrics, summary=summary)


def verdict(delta: float, noise: float, lower_is_better: bool) -> str:
    if noise > 0 and abs(delta) <= 2 * noise:
        return "within noise"
    improved = delta < 0 if lower_is_better else delta > 0
    return "better" if improved else "worse"


def run_comparison(ctx: StepContext[CompareConfig]) -> StepResult:
    metric = ctx.config.metrics[0]
    lower_is_better = "loss" in metric or "ppl" in metric
    by_variant: dict[str, list[float]] = {}
    changes: dict[str, Any] = {}
    for art in ctx.inputs.values():
        variant = art.step_id.split(":", 1)[1].rsplit("-s", 1)[0]
        by_variant.setdefault(variant, []).append(art.manifest.metrics[metric])
        changes[variant] = art.manifest.metrics.get("change", {})
    base = by_variant.pop("baseline")
    base_mean = statistics.fmean(base)
    base_std = statistics.stdev(base) if len(base) > 1 else 0.0
    rows = [{"variant": "baseline", "change": "", metric: round(base_mean, 4), "seed std": round(base_std, 4),
             "delta": 0.0, "verdict": "reference", "runs": len(base)}]
    for name, values in sorted(by_variant.items()):
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        noise = max(base_std, std)
        rows.append({"variant": name, "change": json.dumps(changes[name]), metric: round(mean, 4),
                     "seed std": round(std, 4), "delta": round(mean - base_mean, 4),
                     "verdict": verdict(mean - base_mean, noise, lower_is_better), "runs": len(values)})
    (ctx.out / "comparison.json").write_text(json.dumps({"metric": metric, "rows": rows}, indent=2))
    _plot(rows, metric, ctx.out / "comparison.png")
    best = [r for r in rows[1:] if r["verdict"] == "better"]
    summary = (f"### ablations on `{metric}`\n\n" + "\n".join(
        f"- **{r['variant']}** {r['change']}: {r[metric]} ({r['delta']:+.4f}, std {r['seed std']}) {r['verdict']}"
        for r in rows[1:]) + (f"\n\npromote with `compass ablate promote SPEC --variant {best[0]['variant']}`"
                              if best else ""))
    return StepResult(metrics={"metric": metric, "rows": rows}, summary=summary, tables={"ablations": rows})


def _plot(rows: list[dict], metric: str, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["variant"] for r in rows]
    ax.bar(names, [r[metric] for r in rows], yerr=[r["seed std"] for r in rows], capsize=4,
           color=["grey"] + ["tab:green" if r["verdict"] == "better" else "tab:red" if r["verdict"] == "worse"
                             else "tab:blue" for r in rows[1:]])
    low = min(r[metric] - r["seed std"] for r in rows)
    ax.set_ylim(bottom=low * 0.98)
    ax.set_ylabel(metric)
    ax.set_title("ablations (error bars: seed std)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


ABLATE = StepKind("ablate", AblateConfig, run_ablation, build, version="2", uses_accelerator=True, trains=True,
                  imports=TRANSFORMERS, deployment="ablations", tags=("ablation",))
COMPARE = StepKind("compare", CompareConfig, run_comparison, None, version="1", deployment="ablations",
                   tags=("ablation",))
STEP_KINDS = (ABLATE, COMPARE)
