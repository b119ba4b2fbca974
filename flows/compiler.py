"""The pure compiler: a TrainingSpec becomes a Plan, a DAG of Steps (no Prefect here, so it unit-tests fast).

Each Step carries only the slice of the spec it reads, so changing one field re-runs exactly the steps
that read it and their descendants.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any

from compass.infra.fingerprint import fingerprint
from compass.specs.spec import TrainingSpec

# Bump a phase's version when its code changes what it produces: its steps then re-run.
PHASE_VERSIONS: dict[str, str] = {
    "ingest": "1", "curate": "2", "tokenizer": "1", "tokenize": "1", "ablate": "1", "pretrain": "1",
    "long_context": "1", "post_train": "1", "evaluate": "2", "compare": "1", "report": "1", "curves": "1",
}


class UnknownTarget(ValueError):
    """`--until` named something the plan does not have."""


@dataclass(frozen=True)
class Step:
    """One unit of work: (kind, name, config, inputs). `inputs` maps a role to the id of another step."""

    kind: str
    name: str
    config: dict[str, Any]
    inputs: dict[str, str] = field(default_factory=dict)
    tags: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass
class Plan:
    """Steps in dependency order with their fingerprints."""

    spec_name: str
    steps: list[Step]
    fingerprints: dict[str, str]

    def step(self, step_id: str) -> Step:
        return next(s for s in self.steps if s.id == step_id)

    def descendants(self, step_id: str) -> set[str]:
        out: set[str] = set()
        frontier = {step_id}
        while frontier:
            nxt = {s.id for s in self.steps if set(s.inputs.values()) & frontier} - out
            out |= nxt
            frontier = nxt
        return out

    def up_to(self, targets: list[str]) -> Plan:
        """The steps named in `targets` (a step id such as `pretrain:stage1`, or a kind such as `pretrain`) and
        every step they need: what `--until` runs. Raises UnknownTarget for a name that matches no step."""
        unknown = [t for t in targets if not any(t in (s.id, s.kind) for s in self.steps)]
        if unknown:
            kinds = sorted({s.kind for s in self.steps})
            raise UnknownTarget(f"--until {', '.join(unknown)}: no such step or step kind in this spec's plan; "
                                f"use a kind ({', '.join(kinds)}) or a step id such as {self.steps[-1].id}")
        wanted = {s.id for s in self.steps if s.id in targets or s.kind in targets}
        frontier = set(wanted)
        while frontier:
            needed = {i for s in self.steps if s.id in frontier for i in s.inputs.values()} - wanted
            wanted |= needed
            frontier = needed
        return Plan(self.spec_name, [s for s in self.steps if s.id in wanted],
                    {i: fp for i, fp in self.fingerprints.items() if i in wanted})

    def restricted_to(self, kinds: set[str]) -> Plan:
        """The sub-plan of steps of the given kinds whose inputs are all inside it."""
        kept: list[Step] = []
        ids: set[str] = set()
        for s in self.steps:
            if s.kind in kinds and set(s.inputs.values()) <= ids:
                kept.append(s)
                ids.add(s.id)
        return Plan(self.spec_name, kept, {i: fp for i, fp in self.fingerprints.items() if i in ids})


def _dump(model: Any) -> Any:
    return model.model_dump(mode="json") if hasattr(model, "model_dump") else model


def compile_spec(spec: TrainingSpec) -> Plan:
    """Build the lifecycle DAG: ingest -> curate -> tokenizer -> ablations -> pretraining stages ->
    long-context stages -> post-training -> evaluation of every model step -> success report."""
    what = spec.what
    steps: list[Step] = []
    sources = {s.name: s for s in what.data.sources}

    for src in what.data.sources:
        ingest_cfg = src.model_dump(mode="json", include={"uri", "include", "exclude", "format", "text_key", "split",
                                                          "section_chars", "language", "domain", "max_documents"})
        if src.uri.startswith("stdlib://"):  # the code differs between Python versions
            ingest_cfg["python"] = platform.python_version()
        steps.append(Step("ingest", src.name, ingest_cfg, tags=("data",)))
        curate_cfg = {"curation": _dump(src.curation), "language": src.language, "domain": src.domain}
        steps.append(Step("curate", src.name, curate_cfg, {"raw": f"ingest:{src.name}"}, tags=("data",)))

    curated = {f"curated:{name}": f"curate:{name}" for name in sources}
    steps.append(Step("tokenizer", "select", _dump(what.tokenizer), curated, tags=("tokenizer",)))

    trained_on = sorted({n for st in what.pretraining.stages for n in st.mixture}
                        | {n for st in what.long_context.stages for n in st.mixture}
                        | (set(what.ablations.baseline.mixture) if what.ablations else set())
                        | set(what.evaluation.perplexity_sources)
                        | ({what.long_context.retrieval_source} if what.long_context.retrieval_source else set())
                        | {p.dataset for p in what.post_training if p.method == "mid_training"})
    for name in trained_on:
        steps.append(Step("tokenize", name, {}, {"tokenizer": "tokenizer:select", "curated": f"curate:{name}"},
                          tags=("data",)))

    def data_inputs(mixture: dict[str, float]) -> dict[str, str]:
        return {"tokenizer": "tokenizer:select", **{f"tokens:{n}": f"tokenize:{n}" for n in sorted(mixture)}}

    arch = _dump(what.architecture)
    model_steps: list[str] = []
    if what.ablations:
        abl = what.ablations
        variants = [("baseline", {})] + [(v.name, v.change) for v in abl.variants]
        run_ids = []
        for variant, change in variants:
            for seed in abl.seeds:
                cfg = {"architecture": arch, "baseline": _dump(abl.baseline), "change": change, "seed": seed,
                       "optimizer": _dump(what.pretraining.optimizer), "metrics": abl.metrics,
                       "schedule": _dump(what.pretraining.schedule), "monitors": _dump(what.pretraining.monitors),
                       "intra_document_masking": what.pretraining.intra_document_masking}
                name = f"{variant}-s{seed}"
                steps.append(Step("ablate", name, cfg, data_inputs(abl.baseline.mixture), tags=("ablation", "gpu")))
                run_ids.append(f"ablate:{name}")
        steps.append(Step("compare", "ablations", {"metrics": abl.metrics, "seeds": abl.seeds},
                          {r.replace(":", "/"): r for r in run_ids}, tags=("ablation",)))

    pt = what.pretraining
    schedule_needs_total = pt.schedule.kind != "wsd" or all(s.schedule_segment == "auto" for s in pt.stages)
    previous: str | None = None
    for i, stage in enumerate(pt.stages):
        cfg = {
            "architecture": arch, "optimizer": _dump(pt.optimizer), "schedule": _dump(pt.schedule),
            "seed": pt.seed, "intra_document_masking": pt.intra_document_masking, "monitors": _dump(pt.monitors),
            # a stable WSD stage does not depend on later stages: extending the run keeps it cached
            "stages": [_dump(s) for s in (pt.stages if schedule_needs_total or stage.schedule_segment == "decay"
                                          else pt.stages[: i + 1])],
            "stage": stage.name,
        }
        inputs = data_inputs(stage.mixture)
        if previous:
            inputs["previous"] = previous
        steps.append(Step("pretrain", stage.name, cfg, inputs, tags=("training", "gpu")))
        previous = f"pretrain:{stage.name}"
        model_steps.append(previous)

    lc = what.long_context
    previous_length = pt.stages[-1].sequence_length
    for stage in lc.stages:
        cfg = {"stage": _dump(stage), "inference_scaling": _dump(lc.inference_scaling),
               "intra_document_masking": pt.intra_document_masking, "architecture": arch,
               "optimizer": _dump(pt.optimizer), "seed": pt.seed, "monitors": _dump(pt.monitors),
               "previous_length": previous_length}
        previous_length = stage.sequence_length
        inputs = {**data_inputs(stage.mixture), "previous": previous}
        steps.append(Step("long_context", stage.name, cfg, inputs, tags=("training", "gpu")))
        previous = f"long_context:{stage.name}"
        model_steps.append(previous)

    for post in what.post_training:
        cfg = {**_dump(post), "seed": pt.seed, "vibe_prompts": what.evaluation.vibe_prompts}
        inputs = {"tokenizer": "tokenizer:select", "previous": previous}
        refs = []
        if post.method in ("dpo", "orpo", "kto") and post.pairs and post.pairs.kind == "strong_vs_weak":
            refs = [("strong", post.pairs.strong), ("weak", post.pairs.weak)]
        elif post.method == "distill":
            refs = [("teacher", post.teacher)]
        for role, ref in refs:
            inputs[role] = _resolve_checkpoint(ref, model_steps)
        if post.method == "mid_training":  # the pretraining engine, on the tokenized source
            cfg.update({"architecture": arch, "optimizer": _dump(pt.optimizer), "monitors": _dump(pt.monitors),
                        "intra_document_masking": pt.intra_document_masking})
            inputs.update(data_inputs({post.dataset: 1.0}))
        elif post.dataset in sources:
            inputs[f"curated:{post.dataset}"] = f"curate:{post.dataset}"
        steps.append(Step("post_train", post.name, cfg, inputs, tags=("training", "gpu")))
        previous = f"post_train:{post.name}"
        model_steps.append(previous)

    ev = what.evaluation
    eval_ids = []
    retrieval = _retrieval(spec)
    if ev.tasks or ev.perplexity_sources:
        for model_step in model_steps:
            inputs = {"model": model_step, "tokenizer": "tokenizer:select",
                      **{f"tokens:{n}": f"tokenize:{n}" for n in ev.perplexity_sources}}
            name = model_step.replace(":", "-")
            cfg = {"suite": _dump(ev), "every_checkpoint": spec.how.evaluation.every_checkpoint}
            if retrieval:
                cfg["retrieval"] = retrieval
                inputs["haystack"] = f"tokenize:{retrieval['source']}"
            steps.append(Step("evaluate", name, cfg, inputs, tags=("evaluation", "gpu")))
            eval_ids.append(f"evaluate:{name}")
    if eval_ids:
        steps.append(Step("curves", "evaluation", {"runs": model_steps},
                          {f"eval:{m}": f"evaluate:{m.replace(':', '-')}" for m in model_steps}, tags=("report",)))
        # the report reads the evaluations of the checkpoints its criteria name, nothing else
        named = {_resolve_checkpoint(c.checkpoint, model_steps) for c in spec.why.success_criteria}
        inputs = {f"eval:{m}": f"evaluate:{m.replace(':', '-')}" for m in sorted(named)}
        steps.append(Step("report", "success", {"criteria": [_dump(c) for c in spec.why.success_criteria],
                                                "final": model_steps[-1]}, inputs, tags=("report",)))
    return _order(spec.name, steps)


def _retrieval(spec: TrainingSpec) -> dict[str, Any] | None:
    """Passkey retrieval at every trained length (the last pretraining one, then each extension stage)."""
    lc = spec.what.long_context
    if not lc.stages:
        return None
    first = lc.stages[0].mixture
    return {"lengths": [spec.what.pretraining.stages[-1].sequence_length, *(s.sequence_length for s in lc.stages)],
            "depths": lc.retrieval_depths, "samples": lc.retrieval_samples,
            "source": lc.retrieval_source or max(sorted(first), key=lambda n: first[n])}


def _resolve_checkpoint(ref: str, model_steps: list[str]) -> str:
    return model_steps[-1] if ref == "final" else ref


def _order(spec_name: str, steps: list[Step]) -> Plan:
    by_id = {s.id: s for s in steps}
    for s in steps:
        missing = set(s.inputs.values()) - set(by_id)
        if missing:
            raise ValueError(f"step {s.id} depends on unknown steps {sorted(missing)}")
    ordered = _stable_topo(steps)
    fps: dict[str, str] = {}
    for s in ordered:
        inputs = {role: fps[dep] for role, dep in s.inputs.items()}
        fps[s.id] = fingerprint(s.kind, s.config, inputs, PHASE_VERSIONS[s.kind])
    return Plan(spec_name, ordered, fps)


def _stable_topo(steps: list[Step]) -> list[Step]:
    """Dependency order that keeps declaration order where the DAG allows, so plans read like the spec."""
    done: set[str] = set()
    out: list[Step] = []
    pending = list(steps)
    while pending:
        ready = next(s for s in pending if set(s.inputs.values()) <= done)
        out.append(ready)
        done.add(ready.id)
        pending.remove(ready)
    return out
