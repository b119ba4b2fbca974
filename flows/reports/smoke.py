"""The table a smoke run or a rehearsal ends with: every step, what it exercised, and what was shrunk for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from compass.flows.compiler import Plan
from compass.flows.reports.step_record import StepRecord
from compass.specs.how import Phase
from compass.specs.post_training_methods import method_of
from compass.specs.smoke import Shrink, Size
from compass.specs.spec import TrainingSpec
from compass.tasks.steps.backends import launcher_for
from compass.tasks.steps.kind import Step
from compass.tasks.steps.placement import place_phase

if TYPE_CHECKING:
    from compass.infra.store import Store

TRAINING = ("pretrain", "long_context", "ablate", "mid_training")  # compass's trainer
SAYS_SETUP = (*TRAINING, "post_train", "evaluate")  # steps whose manifests record `setup` (substitutions included)
PHASE_OF: dict[str, Phase] = {"pretrain": "pretraining", "long_context": "long_context", "ablate": "ablation",
                              "mid_training": "mid_training"}


def _engine(spec: TrainingSpec, step: Step, rehearsal: bool) -> str:
    """The engine and where its ranks ran: gloo processes on this machine (smoke), or the phase's Slurm shape."""
    how = spec.how
    par = how.parallelism
    engine = {"deepspeed": f"DeepSpeed ZeRO-{par.zero_stage}", "ddp": "torch", "fsdp2": "FSDP2"}[par.engine_name]
    tp = f" + TP {par.tensor_parallel}" if par.tensor_parallel > 1 else ""
    if not rehearsal:
        return engine + (f" + AutoTP {par.tensor_parallel} on {par.tensor_parallel} gloo processes" if tp else "")
    shape = how.shape(PHASE_OF.get(step.kind, "mid_training"))
    launch = launcher_for(place_phase(PHASE_OF.get(step.kind, "mid_training"), how)).describe(how).launch
    return (f"{engine}{tp} in {how.precision} on {shape.ranks} ranks over {shape.nodes} node(s) x "
            f"{shape.devices_per_node} {how.hardware.accelerator} ({launch})")


def exercised(step: Step, spec: TrainingSpec, rehearsal: bool = False) -> str:
    """What running this step at smoke or rehearsal size proves about the real spec's step."""
    how, what = spec.how, spec.what
    staging = ", node-local staging" if rehearsal and how.storage.local_cache else ""
    core = (f"{_engine(spec, step, rehearsal)}, attention {how.attention}, loss {how.loss}{staging}, "
            "checkpoints and resume")
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
        method = method_of(config)
        return method.label + (f" ({config.loss_type})" if "loss_type" in method.reads else "")
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
        "mid_training": (f"what.post_training.{name}", "what.architecture"),
        "ablate": ("what.ablations.baseline", f"what.ablations.variants.{name.rsplit('-s', 1)[0]}"),
        "evaluate": ("what.evaluation", "what.long_context"),
    }.get(step.kind, ())


def substituted(result: StepRecord | None, store: Store | None) -> list[str]:
    """What a step's CPU ranks replaced (its manifest's setup): the trainer's CUDA-only kernels, a library model's
    flash-attn."""
    if not result or not store:
        return []
    try:
        setup = (store.read_manifest(result.uri).metrics or {}).get("setup") or {}
    except (OSError, ValueError):
        return []
    return list(setup.get("substituted") or [])


def smoke_table(plan: Plan, spec: TrainingSpec, changes: tuple[Shrink, ...], size: Size = "smoke",
                results: list[StepRecord] | None = None, store: Store | None = None) -> list[dict[str, str]]:
    """One row per step, then one for what changed for every step (`how`: hardware, precision, parallelism). A
    rehearsal's training, post-training and evaluation rows also say what its CPU ranks replaced (CUDA-only kernels,
    flash-attn for TRL and lighteval), read from the steps' manifests (`results`)."""
    rehearsal = size == "rehearsal"
    by_step = {r.step: r for r in results or []}
    rows = []
    for step in plan.steps:
        prefixes = _sections(step)
        mine = [str(c) for c in changes if any(c.section == p or c.section.startswith(p + ".") for p in prefixes)]
        said = exercised(step, spec, rehearsal)
        replaced = substituted(by_step.get(step.id), store) if step.kind in SAYS_SETUP else []
        if replaced:
            said += "; on CPU ranks: " + "; ".join(replaced)
        rows.append({"step": step.id, "exercised": said, "shrunk": "; ".join(mine) or "-"})
    everywhere = [f"{c.section.removeprefix('how.')}.{c}" if c.section != "how" else str(c)
                  for c in changes if c.section.startswith("how")]
    where = "how, kept but for these" if rehearsal else "how, on this machine"
    rows.append({"step": "(every step)", "exercised": where, "shrunk": "; ".join(everywhere) or "-"})
    return rows
