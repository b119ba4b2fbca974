"""The table a smoke run ends with: every step, what it exercised, and what smoke mode shrank for it and how."""

from __future__ import annotations

from compass.flows.compiler import Plan
from compass.specs.smoke import Shrink
from compass.specs.spec import TrainingSpec
from compass.tasks.steps.kind import Step

TRAINING = ("pretrain", "long_context", "ablate")


def exercised(step: Step, spec: TrainingSpec) -> str:
    """What running this step at smoke size proves about the real spec's step."""
    how, what = spec.how, spec.what
    par = how.parallelism
    engine = {"deepspeed": f"DeepSpeed ZeRO-{par.zero_stage}", "ddp": "torch",
              "fsdp2": "FSDP2"}[par.engine_name] + (
        f" + AutoTP {par.tensor_parallel} on {par.tensor_parallel} gloo processes" if par.tensor_parallel > 1 else "")
    core = f"{engine}, attention {how.attention}, loss {how.loss}, checkpoints and resume"
    config = step.config
    if step.kind == "ingest":
        return f"reads {config.uri.split('://')[0] + '://' if '://' in config.uri else 'local'} {config.format}"
    if step.kind == "curate":
        cur = config.curation
        parts = [f.name for f in cur.filters] + (["language id"] if cur.language_id else []) + (
            ["exact dedup"] if cur.exact_dedup else []) + (["MinHash"] if cur.minhash else [])
        return "datatrove: " + (", ".join(parts) or "split only")
    if step.kind == "tokenizer":
        return "candidates: " + ", ".join(c.key for c in config.candidates)
    if step.kind == "tokenize":
        return "token files with the chosen tokenizer"
    if step.kind in TRAINING:
        arch = what.architecture
        features = [f"GQA {arch.num_heads}:{arch.num_kv_heads}", arch.positions.kind,
                    "tied" if arch.tied_embeddings else "untied"] + (["MoE"] if arch.moe else []) + (
            ["z-loss"] if arch.z_loss else [])
        return f"{core}; {', '.join(features)}"
    if step.kind == "post_train":
        method = getattr(config, "method", "")
        detail = {"dpo": f"TRL DPO ({getattr(config, 'loss_type', '')})", "mid_training": f"mid-training, {core}"}
        return detail.get(method, f"TRL {method}")
    if step.kind == "evaluate":
        return "lighteval: " + ", ".join(t.key for t in config.suite.benchmarks) + (
            ", perplexity" if config.suite.perplexity_sources else "") + (", passkey" if config.retrieval else "")
    return {"compare": "ablation verdicts", "curves": "evaluation curves",
            "report": "success criteria"}.get(step.kind, step.kind)


def _sections(step: Step) -> tuple[str, ...]:
    """The spec sections whose shrinking a step feels."""
    name = step.name
    return {
        "ingest": (f"what.data.sources.{name}",), "curate": (f"what.data.sources.{name}",),
        "tokenizer": ("what.tokenizer",),
        "pretrain": (f"what.pretraining.stages.{name}", "what.pretraining.schedule", "what.architecture"),
        "long_context": (f"what.long_context.stages.{name}", "what.architecture"),
        "post_train": (f"what.post_training.{name}",),
        "ablate": ("what.ablations.baseline", f"what.ablations.variants.{name.rsplit('-s', 1)[0]}"),
        "evaluate": ("what.evaluation", "what.long_context"),
    }.get(step.kind, ())


def smoke_table(plan: Plan, spec: TrainingSpec, changes: tuple[Shrink, ...]) -> list[dict[str, str]]:
    """One row per step, then one for what changed for every step (`how`: hardware, precision, parallelism)."""
    rows = []
    for step in plan.steps:
        prefixes = _sections(step)
        mine = [str(c) for c in changes if any(c.section == p or c.section.startswith(p + ".") for p in prefixes)]
        rows.append({"step": step.id, "exercised": exercised(step, spec), "shrunk": "; ".join(mine) or "-"})
    everywhere = [f"{c.section.removeprefix('how.')}.{c}" if c.section != "how" else str(c)
                  for c in changes if c.section.startswith("how")]
    rows.append({"step": "(every step)", "exercised": "how, on this machine", "shrunk": "; ".join(everywhere)})
    return rows
