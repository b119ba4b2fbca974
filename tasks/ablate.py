"""Ablations: one short training run per (variant, seed) on the baseline's proxy model and budget, and the
comparison that says, per variant, whether the change helped, hurt, or stayed within the seed noise."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from typing import Any

from compass.tasks.base import StepContext, StepResult


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


def run_config(config: dict[str, Any]) -> dict[str, Any]:
    """The pretraining config of one ablation run: proxy architecture, one stage, this seed."""
    base = {"architecture": {**config["architecture"], **config["baseline"]["architecture"]},
            **{k: v for k, v in config["baseline"].items() if k != "architecture"}}
    run = apply_change(base, config["change"])
    optimizer = dict(config["optimizer"])
    if run.get("lr"):
        optimizer["lr"] = run["lr"]
    stage = {"name": "ablation", "tokens": run["tokens"], "sequence_length": run["sequence_length"],
             "global_batch_size": run["global_batch_size"], "mixture": run["mixture"], "schedule_segment": "auto",
             "reset_optimizer": False}
    return {"architecture": run["architecture"], "optimizer": optimizer, "schedule": config["schedule"],
            "stages": [stage], "stage": "ablation", "seed": config["seed"],
            "intra_document_masking": config["intra_document_masking"], "monitors": config["monitors"]}


def run_ablation(ctx: StepContext) -> StepResult:
    from compass.tasks.pretrain import build_job, run_training

    job = build_job(replace(ctx, config=run_config(ctx.config)))
    result = run_training(job, ctx.workdir, ctx.log)
    val = result["val_loss"]
    metrics = {"val_loss": statistics.fmean(val.values()), "val_loss_by_source": val,
               "final_loss": result["final_loss"], "tokens": result["tokens"], "seed": ctx.config["seed"],
               "change": ctx.config["change"]}
    (ctx.out / "metrics.jsonl").write_text((ctx.workdir / "metrics.jsonl").read_text())
    summary = (f"### ablation `{ctx.name}`\n\nchange {ctx.config['change'] or 'none (baseline)'}; "
               f"validation loss {metrics['val_loss']:.4f} after {result['tokens']:,} tokens")
    return StepResult(metrics=metrics, summary=summary)


def verdict(delta: float, noise: float, lower_is_better: bool) -> str:
    if noise > 0 and abs(delta) <= 2 * noise:
        return "within noise"
    improved = delta < 0 if lower_is_better else delta > 0
    return "better" if improved else "worse"


def run_comparison(ctx: StepContext) -> StepResult:
    metric = ctx.config["metrics"][0]
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
