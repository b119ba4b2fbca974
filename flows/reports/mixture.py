"""What each training stage draws from each source: tokens by the stage's mixture weight, and how many epochs of
the source that is, per stage and over the run (pretraining then long context). A source read more often than its
`max_epochs` is flagged: repeated data stops helping after a few epochs (Muennighoff et al., 2023).

A source's size is its tokenized training split once the plan's tokenize step is in the store; before that, an
estimate from the characters its ingest step kept; before that, unknown."""

from __future__ import annotations

from dataclasses import dataclass

from compass.flows.compiler import Plan
from compass.flows.reports.plan_status import StepStatus
from compass.flows.reports.plan_tables import Section, human
from compass.infra.manifest import DamagedManifest
from compass.infra.store import Store
from compass.specs.spec import TrainingSpec

CHARS_PER_TOKEN = 4.0  # an English BPE's rough ratio, for the estimate before tokenization


@dataclass(frozen=True)
class SourceSize:
    tokens: float | None
    how: str  # "tokenized" | "estimated from ingest" | "unknown"


def source_sizes(plan: Plan, statuses: list[StepStatus], store: Store) -> dict[str, SourceSize]:
    """Each source's training tokens, as far as the store knows them."""
    done = {s.step_id: s.uri for s in statuses if s.state == "cached"}
    sizes: dict[str, SourceSize] = {}
    for step in plan.steps:
        if step.kind != "ingest":
            continue
        name = step.name
        tokens = _metric(store, done.get(f"tokenize:{name}"), "train_tokens")
        if tokens is not None:
            sizes[name] = SourceSize(tokens, "tokenized")
            continue
        characters = _metric(store, done.get(f"ingest:{name}"), "characters")
        sizes[name] = (SourceSize(characters / CHARS_PER_TOKEN, "estimated from ingest") if characters is not None
                       else SourceSize(None, "unknown"))
    return sizes


def _metric(store: Store, uri: str | None, key: str) -> float | None:
    """One metric of a cached step, or None when there is none or its manifest is damaged: the run sets that
    artifact aside and recomputes it, so its report must not stop the run first."""
    if uri is None:
        return None
    try:
        return store.read_manifest(uri).metrics[key]
    except DamagedManifest:
        return None


def consumption_section(spec: TrainingSpec, sizes: dict[str, SourceSize]) -> Section:
    limits = {s.name: s.max_epochs for s in spec.what.data.sources}
    stages = [(f"pretraining {s.name}", s.tokens, s.mixture) for s in spec.what.pretraining.stages]
    stages += [(f"long context {s.name}", s.tokens, s.mixture) for s in spec.what.long_context.stages]
    read: dict[str, float] = {}
    rows, over = [], {}
    for stage, tokens, mixture in stages:
        for source, weight in sorted(mixture.items()):
            drawn = tokens * weight
            size = sizes.get(source, SourceSize(None, "unknown"))
            epochs = drawn / size.tokens if size.tokens else None
            if epochs is not None:
                read[source] = read.get(source, 0.0) + epochs
            total = read.get(source)
            flag = total is not None and total > limits[source]
            if flag:
                over[source] = total
            rows.append([stage, source, f"{weight:g}", human(drawn), human(size.tokens) if size.tokens else "?",
                         size.how, f"{epochs:.2f}" if epochs is not None else "?",
                         (f"{total:.2f}" + (" > max" if flag else "")) if total is not None else "?"])
    notes = [f"{source} is read {epochs:.1f} times over the run, more than its max_epochs {limits[source]:g}: add "
             "data to it, lower its weight, or raise max_epochs if the repetition is meant" for source, epochs in
             sorted(over.items())]
    if any(s.tokens is None for s in sizes.values()):
        notes.append("? = not ingested yet: sizes come from the store once the data steps have run")
    return Section("Data consumption by stage",
                   ["stage", "source", "weight", "tokens drawn", "source tokens", "size", "epochs", "epochs so far"],
                   rows, notes)
