"""Ablations: one short training run per (variant, seed) on the baseline's proxy model and budget, and the
comparison that says, per variant, whether the change helped, hurt, or stayed within the seed noise."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from compass.infra.layout import COMPARISON, CheckpointFolder, ModelArtifact, WorkFolder
from compass.model.training.job import StageRecipe
from compass.model.training.records import goodput_table
from compass.model.training.schedules import schedule_shape
from compass.specs.ablation import AblationBaseline
from compass.specs.architecture import Architecture
from compass.specs.evaluation import Benchmark
from compass.specs.training import Monitors, Optimizer, PretrainStage, Schedule
from compass.tasks.common.comparison import ComparedVariant, Comparison
from compass.tasks.common.devices import device_for
from compass.tasks.common.inputs import TrainingInputs, gates, tokens
from compass.tasks.common.plots import figure_png, use_token_axis
from compass.tasks.common.training import build_job, run_training
from compass.tasks.evaluation.lighteval_run import run_lighteval
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import TRAINER_HOW, TRANSFORMERS, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig
from compass.tasks.steps.wiring import Inputs, R


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
    benchmarks: list[Benchmark] = []  # the evaluation tasks the compared metrics come from
    probes: int = 0  # benchmark evaluations during the run besides its end

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
    lower_is_better: dict[str, bool] = {}


@dataclass(frozen=True)
class CompareInputs(Inputs[R]):
    """Every (variant, seed) run, by `ablate/<variant>-s<seed>` (the roles the comparison's identity was made with)."""

    prefixes: ClassVar[Mapping[str, str]] = {"runs": ""}
    runs: Mapping[str, R]


def build(plan: PlanBuilder) -> None:
    what = plan.spec.what
    abl, pt = what.ablations, what.pretraining
    if abl is None:
        return
    runs = {}
    keys = {m.partition("/")[0] for m in abl.metrics}
    benchmarks = [t for t in what.evaluation.benchmarks if t.key in keys]
    for variant, change in [("baseline", {}), *((v.name, v.change) for v in abl.variants)]:
        for seed in abl.seeds:
            config = AblateConfig(architecture=what.architecture, baseline=abl.baseline, change=change, seed=seed,
                                  optimizer=pt.optimizer, metrics=abl.metrics, schedule=pt.schedule,
                                  monitors=pt.monitors, intra_document_masking=pt.intra_document_masking,
                                  benchmarks=benchmarks, probes=abl.probes if benchmarks else 0)
            inputs = TrainingInputs(tokenizer=plan.tokenizer(), tokens=tokens(plan, abl.baseline.mixture),
                                    gate=gates(plan))
            run = plan.add(ABLATE, f"{variant}-s{seed}", config, inputs)
            runs[f"{run.kind}/{run.name}"] = run
    directions = {m: abl.lower_is_better(m) for m in abl.metrics}
    plan.add(COMPARE, "ablations", CompareConfig(metrics=abl.metrics, seeds=abl.seeds, lower_is_better=directions),
             CompareInputs(runs))


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
    cfg = ctx.config
    recipe = cfg.recipe()
    job = build_job(ctx, recipe, exports_evaluated=False)  # its probes read the work folder's checkpoints
    if cfg.probes:  # a checkpoint at each probe point (and the end), every one of them kept to be evaluated
        steps = schedule_shape(recipe.schedule, recipe.stages).stages[0].steps
        job = job.with_how(checkpoints=job.checkpoints.model_copy(update={
            "every_steps": max(1, math.ceil(steps / (cfg.probes + 1))), "keep_last": cfg.probes + 2}))
    result = run_training(job, ctx.log, ctx.runtime.placement)
    val = result.val_loss
    metrics = {"val_loss": statistics.fmean(val.values()), "val_loss_by_source": val,
               **{f"val_loss:{source}": loss for source, loss in val.items()},
               "final_loss": result.final_loss, "tokens": result.tokens, "seed": cfg.seed,
               "change": cfg.change, "setup": result.setup.model_dump(mode="json"),  # kernels, engine, precision
               "goodput": result.goodput.model_dump(mode="json") if result.goodput else None}
    if cfg.benchmarks:
        probes = _probe_evaluations(ctx, job.recipe.current.global_batch_size * job.recipe.current.sequence_length)
        metrics |= {k: v for k, v in probes[-1].items() if k != "tokens"} | {"probes": probes}
    shutil.copy(WorkFolder(ctx.workdir).metrics, ModelArtifact(ctx.out).metrics)
    shown = ", ".join(f"{m} {metrics[m]:.4f}" for m in cfg.metrics if isinstance(metrics.get(m), float))
    summary = (f"### ablation `{ctx.name}`\n\nchange {cfg.change or 'none (baseline)'}; {shown} after "
               f"{result.tokens:,} tokens" + (f"; {result.goodput.line()}" if result.goodput else ""))
    return StepResult(metrics=metrics, summary=summary, tables=goodput_table(result.goodput))


def _probe_evaluations(ctx: StepContext[AblateConfig], tokens_per_step: int) -> list[dict[str, Any]]:
    """The benchmarks on every kept checkpoint of the run, oldest first (the last is the run's end)."""
    from compass.model.training import checkpoints as ckpt

    points = []
    folders = [CheckpointFolder(p) for p in ckpt.complete_checkpoints(WorkFolder(ctx.workdir).checkpoints)]
    for folder in folders if ctx.config.probes else folders[-1:]:
        scratch = ctx.scratch / folder.root.name
        scratch.mkdir(parents=True, exist_ok=True)
        results = run_lighteval(folder.hf, ctx.config.benchmarks, scratch, device_for(ctx.runtime.how),
                                ctx.runtime.how).results
        points.append({"tokens": folder.step * tokens_per_step,
                       **{f"{task}/{m}": float(v) for task, values in results.items() for m, v in values.items()
                          if not m.endswith("_stderr")}})
    return points


ONE_SEED = "one seed: no noise estimate"
CONFIDENCE = 0.95


def _metric_row(metric: str, base: dict[int, float], values: dict[int, float],
                lower_is_better: bool) -> dict[str, Any]:
    mean, base_mean = statistics.fmean(values.values()), statistics.fmean(base.values())
    std = statistics.stdev(values.values()) if len(values) > 1 else 0.0
    interval = delta_interval(base, values)
    return {"mean": mean, "std": std, "delta": mean - base_mean, "interval": interval,
            "verdict": verdict(interval, lower_is_better)}


def delta_interval(base: dict[int, float], values: dict[int, float]) -> tuple[float, float] | None:
    """The 95% confidence interval of the variant's difference from the baseline, paired by seed (the same seed
    draws the same data order and initialisation in both): Student's t over the seeds' differences. None with one
    seed in common: one run says nothing of the noise."""
    seeds = sorted(base.keys() & values.keys())
    if len(seeds) < 2:
        return None
    from scipy.stats import t

    diffs = [values[s] - base[s] for s in seeds]
    mean = statistics.fmean(diffs)
    half = float(t.ppf(0.5 + CONFIDENCE / 2, len(seeds) - 1)) * statistics.stdev(diffs) / len(seeds) ** 0.5
    return mean - half, mean + half


def verdict(interval: tuple[float, float] | None, lower_is_better: bool) -> str:
    """Better or worse only when the interval excludes 0 (no difference at all is within noise too, not "worse")."""
    if interval is None:
        return ONE_SEED
    low, high = interval
    if low <= 0 <= high:
        return "within noise"
    improved = high < 0 if lower_is_better else low > 0
    return "better" if improved else "worse"


def run_comparison(ctx: StepContext[CompareConfig]) -> StepResult:
    """Per variant and metric: the mean over seeds, the seed spread, the difference with the baseline, its 95%
    interval paired by seed and a verdict (better or worse only when the interval excludes 0; one seed: no noise
    estimate, said so); the first metric decides the overall verdict."""
    metrics, lower = ctx.config.metrics, ctx.config.lower_is_better
    by_variant: dict[str, dict[str, dict[int, float]]] = {}
    changes: dict[str, Any] = {}
    probes: dict[str, list[list[dict[str, Any]]]] = {}
    for art in ctx.given(CompareInputs).runs.values():
        variant, _, seed = art.step_id.split(":", 1)[1].rpartition("-s")
        produced = art.manifest.metrics
        missing = [m for m in metrics if not isinstance(produced.get(m), int | float)]
        if missing:
            have = sorted(k for k, v in produced.items() if isinstance(v, int | float) and k not in ("seed", "tokens"))
            raise ValueError(f"{art.step_id} has no {', '.join(missing)}; its run produced {', '.join(have)}")
        for m in metrics:
            by_variant.setdefault(variant, {}).setdefault(m, {})[int(seed)] = float(produced[m])
        changes[variant] = produced.get("change", {})
        if produced.get("probes"):
            probes.setdefault(variant, []).append(produced["probes"])
    base = by_variant.pop("baseline")
    first = metrics[0]
    rows = [{"variant": "baseline", "change": "", first: round(statistics.fmean(base[first].values()), 4),
             "seed std": round(statistics.stdev(base[first].values()) if len(base[first]) > 1 else 0.0, 4),
             "delta": 0.0, "delta 95% interval": None, "verdict": "reference", "runs": len(base[first]),
             **{f"{m}": round(statistics.fmean(base[m].values()), 4) for m in metrics[1:]}}]
    for name, values in sorted(by_variant.items()):
        judged = {m: _metric_row(m, base[m], values[m], lower.get(m, "loss" in m or "ppl" in m)) for m in metrics}
        head = judged[first]
        interval = head["interval"]
        row = {"variant": name, "change": json.dumps(changes[name]), first: round(head["mean"], 4),
               "seed std": round(head["std"], 4), "delta": round(head["delta"], 4),
               "delta 95% interval": [round(interval[0], 4), round(interval[1], 4)] if interval else None,
               "verdict": head["verdict"], "runs": len(values[first])}
        for m in metrics[1:]:
            row |= {m: round(judged[m]["mean"], 4), f"{m} delta": round(judged[m]["delta"], 4),
                    f"{m} verdict": judged[m]["verdict"]}
        rows.append(row)
    directions = {m: "lower" if lower.get(m, "loss" in m or "ppl" in m) else "higher" for m in metrics}
    comparison = Comparison(metric=first, metrics=metrics, better_is=directions,
                            rows=[ComparedVariant.model_validate(r) for r in rows])
    (ctx.out / COMPARISON).write_text(comparison.json_text())
    _plot(rows, first, ctx.out / "comparison.png", directions[first] == "lower")
    if probes:
        _plot_probes(probes, [m for m in metrics if "/" in m], ctx.out / "probes.png")
    best = [r for r in rows[1:] if r["verdict"] == "better"]
    summary = (f"### ablations on `{first}` ({directions[first]} is better)\n\n" + "\n".join(
        f"- **{r['variant']}** {r['change']}: {r[first]} ({r['delta']:+.4f}"
        + (f", 95% interval {r['delta 95% interval'][0]:+.4f} to {r['delta 95% interval'][1]:+.4f}"
           if r["delta 95% interval"] else "") + f") {r['verdict']}"
        + "".join(f"; {m} {r[m]} {r[f'{m} verdict']}" for m in metrics[1:]) for r in rows[1:])
        + (f"\n\npromote with `compass ablate promote SPEC --variant {best[0]['variant']}`" if best else ""))
    return StepResult(metrics={"metric": first, "rows": rows}, summary=summary, tables={"ablations": rows})


def _plot_probes(probes: dict[str, list[list[dict[str, Any]]]], metrics: list[str], out: Path) -> None:
    """Each benchmark metric against tokens during the runs, one line per variant (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.2), squeeze=False)
    for ax, metric in zip(axes.flat, metrics, strict=True):
        for variant, runs in sorted(probes.items()):
            tokens = [p["tokens"] for p in runs[0]]
            means = [statistics.fmean(run[i][metric] for run in runs) for i in range(len(tokens))]
            ax.plot(tokens, means, marker="o", label=variant)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("tokens seen")
        use_token_axis(ax)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out.write_bytes(figure_png(fig, dpi=90))


def _plot(rows: list[dict], metric: str, out: Path, lower_is_better: bool = True) -> None:
    """Each variant's difference from the baseline on `metric`: bars from zero (the baseline), the 95% interval
    paired by seed as the error bar, the verdict and the interval written on the bar. A bar chart of the raw means
    on an axis cut just below them made a 0.2% difference look like a factor of two."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = rows[1:]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(variants) + 2), 3.6))
    names = [r["variant"] for r in variants]
    deltas = [r["delta"] for r in variants]
    intervals = [r["delta 95% interval"] for r in variants]
    errors = [[d - i[0] if i else 0.0 for d, i in zip(deltas, intervals, strict=True)],
              [i[1] - d if i else 0.0 for d, i in zip(deltas, intervals, strict=True)]]
    colours = {"better": "tab:green", "worse": "tab:red"}
    ax.bar(names, deltas, yerr=errors, capsize=4, color=[colours.get(r["verdict"], "tab:blue") for r in variants])
    ax.axhline(0.0, color="black", linewidth=0.8, label=f"_baseline {rows[0][metric]:.4g}")
    for i, r in enumerate(variants):
        interval = r["delta 95% interval"]
        said = f"{r['verdict']}\n{r['delta']:+.3g}" + (f" [{interval[0]:+.3g}, {interval[1]:+.3g}]" if interval else "")
        top = max(r["delta"], interval[1] if interval else r["delta"], 0.0)
        ax.annotate(said, (i, top), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.margins(y=0.35)
    better = "lower" if lower_is_better else "higher"
    ax.set_ylabel(f"{metric} minus the baseline's\n({better} is better)")
    ax.set_title(f"ablations against the baseline ({metric} {rows[0][metric]:.4g})\nerror bars: 95% interval "
                 "paired by seed", fontsize=9)
    fig.tight_layout()
    out.write_bytes(figure_png(fig, dpi=100))


ABLATE = StepKind("ablate", AblateConfig, run_ablation, build, version="5", resources=phase("ablation"),
                  trains=True, reads_how=TRAINER_HOW, inputs=TrainingInputs, after=("gate", "tokenize"),
                  imports=TRANSFORMERS, deployment="ablations", headline=("val_loss", "final_loss"))
# 3: verdicts from a 95% interval paired by seed; one seed says it has no noise estimate; 4: the plot of differences
COMPARE = StepKind("compare", CompareConfig, run_comparison, None, version="4", deployment="ablations",
                   inputs=CompareInputs)
STEP_KINDS = (ABLATE, COMPARE)
