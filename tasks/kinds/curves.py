"""Evaluation curves: every metric the evaluations measured, against tokens seen, one line per model step
(pretraining stages, long-context stages, post-training), so a person sees where each phase helped."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from compass.tasks.common.inputs import Evaluations, evaluations_by_model
from compass.tasks.common.plots import figure_png, use_readable_log_axis, use_token_axis
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepKind
from compass.tasks.steps.step_config import StepConfig


class CurvesConfig(StepConfig):
    runs: list[str]  # the model steps drawn, in training order
    thresholds: dict[str, list[str]] = {}  # metric -> the success criteria on it ("<= 1000"), drawn as lines


CONTINUING = ("pretrain", "long_context", "mid_training")  # kinds that continue one model: joined across stages


def build(plan: PlanBuilder) -> None:
    evaluations = evaluations_by_model(plan)
    runs = [m.id for m in plan.evaluated_models() if m.id in evaluations]
    thresholds: dict[str, list[str]] = {}
    for criterion in plan.spec.why.success_criteria:
        thresholds.setdefault(criterion.metric, []).append(f"{criterion.op} {criterion.threshold:g}")
    if runs:
        plan.add(KIND, "evaluation", CurvesConfig(runs=runs, thresholds=thresholds),
                 Evaluations({m: evaluations[m] for m in runs}))


def y_label(metric: str) -> str:
    """What a metric's axis measures, with its unit."""
    if metric.startswith("val_ppl"):
        return "perplexity (log scale, lower is better)"
    if metric.startswith("passkey"):
        return "retrieval accuracy (0-1)"
    if metric.endswith(("/acc", "/acc_norm", "/em", "/f1", "/pass@1")) or "accuracy" in metric:
        return f"{metric.rsplit('/', 1)[-1]} (0-1, higher is better)"
    return metric


def curve_points(evaluations: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """metric -> run -> [(tokens, value)], from each evaluation's per-checkpoint results."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for run, results in evaluations.items():
        for point in results.get("curve", []):
            if point.get("tokens") is None:
                continue
            for metric, value in point.items():
                if (isinstance(value, float) and math.isfinite(value) and not metric.startswith("val_loss:")
                        and "/depth" not in metric):
                    out.setdefault(metric, {}).setdefault(run, []).append((int(point["tokens"]), value))
    return {m: {r: sorted(p) for r, p in runs.items()} for m, runs in sorted(out.items())}


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot_curves(points: dict[str, dict[str, list[tuple[int, float]]]], out: Path, title: str,
                thresholds: dict[str, list[str]] | None = None) -> None:
    """A panel per metric: each model step's checkpoints (its own marker), one faint line joining the checkpoints
    of the model that continues through pretraining, long context and mid-training, and each success criterion on
    the metric as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(points))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    from matplotlib.transforms import offset_copy

    order = list(dict.fromkeys(run for runs in points.values() for run in runs))
    for ax, (metric, runs) in zip(axes.flat, points.items(), strict=False):
        for run, pts in runs.items():
            i = order.index(run)
            # steps evaluated at the same token count (post-training methods) would hide each other: each run has
            # its own marker and is shifted a few points
            # sideways (set after plotting: matplotlib sizes the axes only from lines drawn in data coordinates)
            (line,) = ax.plot([t for t, _ in pts], [v for _, v in pts], marker=MARKERS[i % len(MARKERS)],
                              markersize=5, fillstyle="full" if i % 2 == 0 else "none", label=run)
            line.set_transform(offset_copy(ax.transData, fig=fig, x=3.0 * (i - (len(order) - 1) / 2), units="points"))
        joined = sorted(p for run, pts in runs.items() if run.split(":", 1)[0] in CONTINUING for p in pts)
        if len(joined) > 1:
            ax.plot([t for t, _ in joined], [v for _, v in joined], color="grey", linewidth=1, alpha=0.5,
                    zorder=0, label="the model across its stages")
        for said in (thresholds or {}).get(metric, []):
            value = float(said.split()[1])
            ax.axhline(value, color="tab:red", linestyle="--", linewidth=1, label=f"criterion {said}")
            ax.annotate(f"criterion {said}", (0.01, value), xycoords=("axes fraction", "data"), xytext=(0, 2),
                        textcoords="offset points", fontsize=7, color="tab:red")
        ax.set_title(metric, fontsize=9)
        ax.set_ylabel(y_label(metric), fontsize=8)
        ax.set_xlabel("tokens seen")
        use_token_axis(ax)
        if "ppl" in metric:
            use_readable_log_axis(ax)
    for ax in list(axes.flat)[len(points):]:
        ax.axis("off")
    shown: dict[str, Any] = {}  # every panel's runs once (a criterion's line is named on its panel)
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if not label.startswith("criterion "):
                shown.setdefault(label, handle)
    fig.legend(list(shown.values()), list(shown), loc="lower center", ncol=min(4, max(1, len(shown))), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out.write_bytes(figure_png(fig, dpi=90))


def run_curves(ctx: StepContext[CurvesConfig]) -> StepResult:
    evaluations = {model: json.loads((art.local() / "results.json").read_text())
                   for model, art in ctx.given(Evaluations).evaluations.items()}
    points = curve_points(evaluations)
    (ctx.out / "curves.json").write_text(json.dumps(points, indent=1))
    plot_curves(points, ctx.out / "curves.png", "evaluation against tokens seen", ctx.config.thresholds)
    table = [{"run": run, "metric": metric, "tokens": t, "value": round(v, 4)}
             for metric, runs in points.items() for run, pts in runs.items() for t, v in pts]
    n = sum(len(p) for runs in points.values() for p in runs.values())
    summary = (f"### evaluation curves\n\n{len(points)} metrics, {len(evaluations)} runs, {n} points; "
               f"`curves.png` in the artifact")
    return StepResult(metrics={"metrics": sorted(points), "points": n}, summary=summary, tables={"curve_points": table})


# 2: the model joined across stages, criteria drawn, axis labels with units
KIND = StepKind("curves", CurvesConfig, run_curves, build, version="2", inputs=Evaluations, after=("evaluate",),
                after_models=True)
STEP_KINDS = (KIND,)
