"""Cross-field checks: the rules no single field can enforce, each with a message a person can act on."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compass.specs.sources import SourceUriError, parse_source_uri
from compass.specs.spec import TrainingSpec

Loc = tuple[str | int, ...]

STEP_KINDS = ("fetch", "curate", "tokenizer", "ablate", "pretrain", "long_context", "post_train", "evaluate",
              "compare", "report", "curves")


@dataclass(frozen=True)
class Issue:
    loc: Loc
    message: str
    hint: str = ""


def check_spec(spec: TrainingSpec, base_dir: Path) -> list[Issue]:
    """Run every check and return all issues (empty when the spec is consistent)."""
    checks = (_architecture, _sources, _mixtures, _stages, _schedule, _parallelism, _tokenizer,
              _references, _ablations, _orchestration, _evaluation)
    return [issue for check in checks for issue in check(spec, base_dir)]


def _architecture(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    a = spec.what.architecture
    at = ("what", "architecture")
    if a.num_kv_heads > a.num_heads or a.num_heads % a.num_kv_heads:
        divisors = [d for d in range(1, a.num_heads + 1) if a.num_heads % d == 0]
        yield Issue((*at, "num_kv_heads"), f"num_kv_heads={a.num_kv_heads} must divide num_heads={a.num_heads}",
                    f"use one of {divisors} (1 = MQA, {a.num_heads} = MHA)")
    if a.head_dim is None and a.hidden_size % a.num_heads:
        yield Issue((*at, "hidden_size"), f"hidden_size={a.hidden_size} is not divisible by num_heads={a.num_heads}",
                    "change one of them, or set head_dim explicitly")
    if a.resolved_head_dim % 2:
        yield Issue((*at, "head_dim"), f"head_dim={a.resolved_head_dim} must be even for RoPE",
                    "pick an even head dimension")
    pos = a.positions
    if pos.kind == "rnope" and pos.nope_every is None:
        yield Issue((*at, "positions", "nope_every"), "rnope needs nope_every",
                    "SmolLM3 uses nope_every: 4 (every 4th layer without RoPE)")
    if pos.kind == "rnope" and pos.nope_every is not None and pos.nope_every < 2:
        yield Issue((*at, "positions", "nope_every"), "nope_every must be at least 2 for a hybrid",
                    "use kind: nope for no positional encoding at all")
    if pos.kind != "rnope" and pos.nope_every is not None:
        yield Issue((*at, "positions", "nope_every"), f"nope_every only applies to kind: rnope, not {pos.kind}",
                    "remove nope_every or set kind: rnope")
    if a.family == "moe" and a.moe is None:
        yield Issue((*at, "family"), "family: moe needs a moe block",
                    "add moe: {num_experts, experts_per_token, expert_ffn_size}")
    if a.family == "dense" and a.moe is not None:
        yield Issue((*at, "moe"), "a moe block on a dense model", "set family: moe or remove the block")
    if a.moe and a.moe.experts_per_token > a.moe.num_experts:
        yield Issue((*at, "moe", "experts_per_token"),
                    f"experts_per_token={a.moe.experts_per_token} exceeds num_experts={a.moe.num_experts}",
                    "route to at most num_experts experts")


def _repeats(names: list[str]) -> list[tuple[int, str]]:
    """(index, name) of every entry whose name appeared earlier: the duplicate, not the original."""
    return [(i, n) for i, n in enumerate(names) if n in names[:i]]


def _sources(spec: TrainingSpec, base_dir: Path) -> Iterator[Issue]:
    sources = spec.what.data.sources
    for i, dup in _repeats([s.name for s in sources]):
        yield Issue(("what", "data", "sources", i, "name"), f"source name '{dup}' is used twice",
                    "give every source its own name")
    for i, src in enumerate(sources):
        at = ("what", "data", "sources", i)
        try:
            uri = parse_source_uri(src.uri)
        except SourceUriError as exc:
            yield Issue((*at, "uri"), str(exc), exc.hint)
            continue
        if uri.scheme == "file" and not (base_dir / uri.path).expanduser().exists():
            yield Issue((*at, "uri"), f"local source '{uri.path}' does not exist (relative to {base_dir})",
                        "fix the path, or use s3://, deb://, pypi:// or stdlib://")
        if src.format in ("jsonl", "parquet") and uri.scheme in ("deb", "stdlib"):
            yield Issue((*at, "format"), f"format {src.format} does not fit a {uri.scheme}:// source",
                        "packages hold text, html or code files")
        for j, flt in enumerate(src.curation.filters):
            yield from _filter_params(flt.name, flt.params, (*at, "curation", "filters", j))


def _filter_params(name: str, params: dict[str, Any], loc: Loc) -> Iterator[Issue]:
    from compass.tasks.curate_blocks import FILTERS

    cls = FILTERS[name]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "exclusion_writer")]
    for key in params:
        if key not in accepted:
            yield Issue((*loc, "params", key), f"{cls.__name__} has no parameter '{key}'",
                        f"accepted: {', '.join(accepted)}")


def _mixture(mixture: dict[str, float], loc: Loc, source_names: set[str]) -> Iterator[Issue]:
    for name, weight in mixture.items():
        if name not in source_names:
            yield Issue((*loc, name), f"mixture names source '{name}', which is not in what.data.sources",
                        f"known sources: {', '.join(sorted(source_names))}")
        if weight <= 0:
            yield Issue((*loc, name), f"mixture weight {weight} must be positive", "remove the source instead")
    total = sum(mixture.values())
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        yield Issue(loc, f"mixture weights sum to {total:g}, not 1", "rescale the weights so they sum to 1")


def _mixtures(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    names = {s.name for s in spec.what.data.sources}
    for i, stage in enumerate(spec.what.pretraining.stages):
        yield from _mixture(stage.mixture, ("what", "pretraining", "stages", i, "mixture"), names)
    for i, stage in enumerate(spec.what.long_context.stages):
        yield from _mixture(stage.mixture, ("what", "long_context", "stages", i, "mixture"), names)
    if spec.what.ablations:
        yield from _mixture(spec.what.ablations.baseline.mixture, ("what", "ablations", "baseline", "mixture"), names)


def _evaluation(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    """Every benchmark must be runnable here before any work starts, and every criterion must name a metric
    the evaluation produces."""
    from compass.tasks.benchmarks import BENCHMARKS

    ev = spec.what.evaluation
    names = {s.name for s in spec.what.data.sources}
    for i, task in enumerate(ev.tasks):
        at = ("what", "evaluation", "tasks", i)
        if task.source == "compass" and task.name not in BENCHMARKS:
            yield Issue((*at, "name"), f"no offline data for benchmark '{task.name}' on this machine",
                        f"available offline: {', '.join(BENCHMARKS)}; or set source: lighteval for a lighteval "
                        "task whose dataset this machine holds")
        if task.source == "lighteval":
            if "formulation" in task.model_fields_set:
                yield Issue((*at, "formulation"), "a lighteval task has its own prompt; formulation applies to "
                            "compass benchmarks only", "remove formulation")
            from compass.tasks.lighteval_tasks import TaskDataMissing, locate

            try:
                locate(task.name, task.fewshot)
            except TaskDataMissing as e:
                yield Issue((*at, "name"), str(e), e.hint)
    for i, src in enumerate(ev.perplexity_sources):
        if src not in names:
            yield Issue(("what", "evaluation", "perplexity_sources", i), f"unknown source '{src}'",
                        f"known sources: {', '.join(sorted(names))}")
    if not (ev.tasks or ev.perplexity_sources):
        return  # nothing is evaluated, so no success report is compiled
    keys = {t.key for t in ev.tasks}  # each gives <key>/<metric>
    if spec.what.long_context.stages:  # passkey@<length>, and per depth passkey@<length>/depth<d>
        keys |= {f"passkey@{n}" for n in [spec.what.pretraining.stages[-1].sequence_length,
                                          *(s.sequence_length for s in spec.what.long_context.stages)]}
    plain = {f"val_{m}:{s}" for s in ev.perplexity_sources for m in ("loss", "ppl")}
    for i, crit in enumerate(spec.why.success_criteria):
        prefix = crit.metric.split("/")[0]
        if crit.metric in plain or prefix in keys and (prefix.startswith("passkey@") or "/" in crit.metric):
            continue
        given = sorted(k if k.startswith("passkey@") else f"{k}/<metric>" for k in keys) + sorted(plain)
        yield Issue(("why", "success_criteria", i, "metric"), f"no evaluation produces the metric '{crit.metric}'",
                    f"the evaluation suite gives: {', '.join(given)}")


def _stages(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    pre = spec.what.pretraining.stages
    for i, dup in _repeats([s.name for s in pre]):
        yield Issue(("what", "pretraining", "stages", i, "name"),
                    f"stage name '{dup}' is used twice", "name every stage differently")
    for i, (a, b) in enumerate(zip(pre, pre[1:], strict=False)):
        if b.sequence_length < a.sequence_length:
            yield Issue(("what", "pretraining", "stages", i + 1, "sequence_length"),
                        f"sequence_length {b.sequence_length} is shorter than the previous stage's "
                        f"{a.sequence_length}", "stages' sequence lengths must not decrease")
    for i, stage in enumerate(pre):
        one_step = stage.global_batch_size * stage.sequence_length
        if stage.tokens < one_step:
            yield Issue(("what", "pretraining", "stages", i, "tokens"),
                        f"{stage.tokens:g} tokens is less than one optimizer step ({one_step} tokens)",
                        "raise tokens or lower global_batch_size")
    lc = spec.what.long_context.stages
    previous = pre[-1].sequence_length if pre else 0
    previous_theta = spec.what.architecture.positions.rope_theta
    for i, stage in enumerate(lc):
        at = ("what", "long_context", "stages", i)
        if stage.sequence_length <= previous:
            yield Issue((*at, "sequence_length"), f"sequence_length {stage.sequence_length} does not extend the "
                        f"context beyond {previous}", "each long-context stage must be longer than the one before")
        if stage.rope_theta < previous_theta:
            yield Issue((*at, "rope_theta"),
                        f"rope_theta {stage.rope_theta:g} is below the previous {previous_theta:g}",
                        "raise the RoPE base as the context grows (SmolLM3: 50k -> 2M -> 5M)")
        one_step = stage.global_batch_size * stage.sequence_length
        if stage.tokens < one_step:
            yield Issue((*at, "tokens"), f"{stage.tokens:g} tokens is less than one optimizer step ({one_step})",
                        "raise tokens or lower global_batch_size")
        previous, previous_theta = stage.sequence_length, stage.rope_theta
    source = spec.what.long_context.retrieval_source
    names = {s.name for s in spec.what.data.sources}
    if source and source not in names:
        yield Issue(("what", "long_context", "retrieval_source"), f"unknown source '{source}'",
                    f"use one of: {', '.join(sorted(names))}")
    if any(not 0 <= d <= 1 for d in spec.what.long_context.retrieval_depths):
        yield Issue(("what", "long_context", "retrieval_depths"), "depths are fractions of the context",
                    "use values between 0 (start) and 1 (end)")
    if spec.what.architecture.positions.kind == "nope" and lc:
        yield Issue(("what", "long_context"), "long-context stages change rope_theta, but the model has no RoPE",
                    "use positions.kind: rope or rnope, or drop the long-context stages")


def _schedule(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    pt = spec.what.pretraining
    sched = pt.schedule
    segments = [s.schedule_segment for s in pt.stages]
    total_steps = sum(max(1, int(s.tokens // (s.global_batch_size * s.sequence_length))) for s in pt.stages)
    if sched.kind != "wsd" and any(seg != "auto" for seg in segments):
        i = next(i for i, seg in enumerate(segments) if seg != "auto")
        yield Issue(("what", "pretraining", "stages", i, "schedule_segment"),
                    f"schedule_segment only applies to wsd, not {sched.kind}", "remove it or use kind: wsd")
    if "decay" in segments:
        first = segments.index("decay")
        if any(seg != "decay" for seg in segments[first:]):
            yield Issue(("what", "pretraining", "stages", first, "schedule_segment"),
                        "only the last stages may decay: a stable stage follows a decay stage",
                        "mark every stage after the first decay stage as decay")
    if sched.warmup_steps >= total_steps:
        yield Issue(("what", "pretraining", "schedule", "warmup_steps"),
                    f"warmup_steps={sched.warmup_steps} covers the whole run ({total_steps} steps)",
                    "shorten the warmup (SmolLM3 warmed up for 2,000 steps)")
    if sched.kind == "multistep":
        m = sched.milestones
        if not m:
            yield Issue(("what", "pretraining", "schedule", "milestones"), "multistep needs milestones",
                        "e.g. milestones: [0.8, 0.9]")
        if any(not 0 < x < 1 for x in m) or m != sorted(m):
            yield Issue(("what", "pretraining", "schedule", "milestones"),
                        "milestones must be increasing fractions between 0 and 1", "e.g. [0.8, 0.9]")
    elif sched.milestones:
        yield Issue(("what", "pretraining", "schedule", "milestones"), f"milestones do not apply to {sched.kind}",
                    "remove them or use kind: multistep")


def _parallelism(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    how = spec.how
    par = how.parallelism
    devices = how.hardware.total_devices
    used = par.data_parallel * par.tensor_parallel * par.pipeline_parallel
    if used != devices:
        yield Issue(("how", "parallelism"), f"data_parallel x tensor_parallel x pipeline_parallel = {used}, "
                    f"but the hardware has {devices} devices", "make the product equal nodes x devices_per_node")
    arch = spec.what.architecture
    if arch.num_heads % par.tensor_parallel or arch.num_kv_heads % par.tensor_parallel:
        yield Issue(("how", "parallelism", "tensor_parallel"),
                    f"tensor_parallel={par.tensor_parallel} must divide num_heads={arch.num_heads} "
                    f"and num_kv_heads={arch.num_kv_heads}", "pick a common divisor")
    stages = [("pretraining", i, s.global_batch_size, par.micro_batch_size)
              for i, s in enumerate(spec.what.pretraining.stages)]
    stages += [("long_context", i, s.global_batch_size, s.micro_batch_size or par.micro_batch_size)
               for i, s in enumerate(spec.what.long_context.stages)]
    for section, i, gbs, micro in stages:
        per_step = micro * par.data_parallel
        if gbs % per_step:
            yield Issue(("what", section, "stages", i, "global_batch_size"),
                        f"global_batch_size={gbs} is not a multiple of micro_batch_size x data_parallel = {per_step}",
                        "gradient accumulation needs a whole number of micro-batches")
    if how.hardware.accelerator == "cpu" and how.precision == "fp16":
        yield Issue(("how", "precision"), "fp16 is not supported on CPU", "use fp32 on CPU (bf16 is ~17x slower)")
    if how.hardware.accelerator == "cpu" and par.tensor_parallel > 1:
        yield Issue(("how", "parallelism", "tensor_parallel"), "tensor parallelism needs GPUs",
                    "use data_parallel on CPU")
    if not par.deepspeed and par.zero_stage:
        yield Issue(("how", "parallelism", "zero_stage"), "ZeRO needs deepspeed: true",
                    "set deepspeed: true or zero_stage: 0")
    hw = how.hardware
    if hw.hosts and len(hw.hosts) != hw.nodes:
        yield Issue(("how", "hardware", "hosts"), f"{len(hw.hosts)} hosts for nodes={hw.nodes}",
                    "list one address per node, the rendezvous host first")
    if hw.launcher == "deepspeed" and not par.deepspeed:
        yield Issue(("how", "hardware", "launcher"), "the deepspeed launcher needs parallelism.deepspeed: true",
                    "use launcher: torchrun, or set deepspeed: true")


def _tokenizer(spec: TrainingSpec, base_dir: Path) -> Iterator[Issue]:
    cands = spec.what.tokenizer.candidates
    keys = [candidate_key(c) for c in cands]
    for i, dup in _repeats(keys):
        yield Issue(("what", "tokenizer", "candidates", i), f"candidate '{dup}' is listed twice",
                    "list each candidate once")
    for i, c in enumerate(cands):
        if c.kind == "local" and not (base_dir / c.path / "tokenizer.json").expanduser().exists():
            yield Issue(("what", "tokenizer", "candidates", i, "path"),
                        f"no tokenizer.json in '{c.path}' (relative to {base_dir})",
                        "point to a folder saved with save_pretrained()")
    vocab = spec.what.architecture.vocab_size
    if vocab is not None and len(cands) > 1:
        yield Issue(("what", "architecture", "vocab_size"),
                    "vocab_size is fixed while several tokenizer candidates compete",
                    "leave vocab_size empty so the chosen tokenizer sets it")


def candidate_key(c: Any) -> str:
    return {"bpe": lambda: f"bpe-{c.vocab_size}", "local": lambda: c.name,
            "hub": lambda: c.repo.replace("/", "--")}[c.kind]()


def valid_checkpoints(spec: TrainingSpec) -> set[str]:
    names = {"final"}
    names |= {f"pretrain:{s.name}" for s in spec.what.pretraining.stages}
    names |= {f"long_context:{s.name}" for s in spec.what.long_context.stages}
    names |= {f"post_train:{s.name}" for s in spec.what.post_training}
    return names


def _references(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    valid = valid_checkpoints(spec)
    hint = f"one of: {', '.join(sorted(valid))}"
    for i, crit in enumerate(spec.why.success_criteria):
        if crit.checkpoint not in valid:
            yield Issue(("why", "success_criteria", i, "checkpoint"), f"unknown checkpoint '{crit.checkpoint}'", hint)
    post = spec.what.post_training
    for i, dup in _repeats([s.name for s in post]):
        yield Issue(("what", "post_training", i, "name"),
                    f"post-training step '{dup}' is named twice", "name every step differently")
    sources = {s.name for s in spec.what.data.sources}
    for i, step in enumerate(post):
        if step.method == "mid_training":
            if step.dataset not in sources:
                yield Issue(("what", "post_training", i, "dataset"),
                            f"mid-training continues pretraining on a curated source; '{step.dataset}' is not one",
                            f"use one of: {', '.join(sorted(sources))}")
            if any(s.method != "mid_training" for s in post[:i]):
                yield Issue(("what", "post_training", i, "method"),
                            "mid-training continues the pretraining state, so it comes before SFT, preference "
                            "optimisation and RL", "move it to the top of post_training")
        refs = []
        if step.method in ("dpo", "orpo", "kto") and step.pairs and step.pairs.kind == "strong_vs_weak":
            refs = [("pairs", "strong", step.pairs.strong), ("pairs", "weak", step.pairs.weak)]
        if step.method == "distill":
            refs = [("teacher", step.teacher)]
            layers = spec.what.architecture.num_layers
            if step.student_layers is not None and step.student_layers >= layers:
                yield Issue(("what", "post_training", i, "student_layers"),
                            f"a student of {step.student_layers} layers is not smaller than the model's {layers}",
                            f"use fewer than {layers} layers, or leave it out to distil into the model as is")
        for *path, ref in refs:
            if ref not in valid:
                yield Issue(("what", "post_training", i, *path), f"unknown checkpoint '{ref}'", hint)


def _ablations(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    abl = spec.what.ablations
    if abl is None:
        return
    arch_fields = set(type(spec.what.architecture).model_fields)
    for key in abl.baseline.architecture:
        if key not in arch_fields:
            yield Issue(("what", "ablations", "baseline", "architecture", key), f"unknown architecture field '{key}'",
                        "proxy overrides use what.architecture's field names")
    base = abl.baseline.model_dump()
    base["architecture"] = {**spec.what.architecture.model_dump(), **abl.baseline.architecture}
    for i, dup in _repeats([v.name for v in abl.variants]):
        yield Issue(("what", "ablations", "variants", i, "name"),
                    f"variant '{dup}' is named twice", "name every variant differently")
    for i, variant in enumerate(abl.variants):
        at = ("what", "ablations", "variants", i, "change")
        if len(variant.change) != 1:
            yield Issue(at, f"variant '{variant.name}' changes {len(variant.change)} fields "
                        f"({', '.join(sorted(variant.change))}); an ablation changes exactly one",
                        "split it into one variant per field")
            continue
        (path, value), = variant.change.items()
        current = _lookup(base, path.split("."))
        if current is _MISSING:
            yield Issue((*at, path), f"'{path}' is not a field of the ablation baseline",
                        "use a dotted path such as architecture.tied_embeddings, mixture or lr")
        elif current == value:
            yield Issue((*at, path), f"variant '{variant.name}' sets {path} to its baseline value {value!r}",
                        "a variant must differ from the baseline")


_MISSING = object()


def _lookup(node: Any, parts: list[str]) -> Any:
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _orchestration(spec: TrainingSpec, _: Path) -> Iterator[Issue]:
    orch = spec.how.orchestration
    for kind in orch.step_timeouts:
        if kind not in STEP_KINDS:
            yield Issue(("how", "orchestration", "step_timeouts", kind), f"unknown step kind '{kind}'",
                        f"one of: {', '.join(STEP_KINDS)}")
    ev = spec.how.evaluation
    if ev.schedule_cron and ev.schedule_interval_seconds:
        yield Issue(("how", "evaluation"), "both schedule_cron and schedule_interval_seconds are set",
                    "choose one schedule")
