"""Cross-section checks: the rules that read more than one section of the spec, each with a message a person can
act on. A rule that reads one section sits beside its schema (architecture_rules, data_rules, pretraining_rules,
how_rules); check_spec runs them all.

Pure: they read the spec and nothing else. What depends on the machine (local paths, installed libraries,
cached datasets) or on the compiled plan (step kinds, checkpoint names) is checked by the validation layer,
compass.flows.validation, before anything runs.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pydantic import ValidationError

from compass.specs.architecture import Architecture, architecture_rules
from compass.specs.base import Issue, Loc, repeats, unused
from compass.specs.costs import PHASE_OF_SECTION
from compass.specs.data import data_rules
from compass.specs.evaluation import COMPASS_BENCHMARKS
from compass.specs.goodput_plan import predicted_splits
from compass.specs.how import PHASES, Phase, how_rules, slurm_seconds
from compass.specs.post_training import MidTraining, PostTrainStep, checkpoint_refs
from compass.specs.post_training_methods import family_reads
from compass.specs.secrets import redact
from compass.specs.spec import TrainingSpec
from compass.specs.staging_costs import GIB, over_capacity
from compass.specs.starting_model import NAMED_MODEL_PREFIX
from compass.specs.training import pretraining_rules

HOST = re.compile(r"[A-Za-z0-9_[][A-Za-z0-9._@:\[\]-]{0,252}")


def check_spec(spec: TrainingSpec) -> list[Issue]:
    """Run every check and return all issues (empty when the spec is consistent)."""
    start = list(_starting_point(spec))
    if start:
        return start  # the other checks read the architecture and the tokenizer
    checks: tuple[Callable[[TrainingSpec], Iterable[Issue]], ...] = (
        lambda s: architecture_rules(s.what.architecture, ("what", "architecture")), lambda s: data_rules(s.what.data),
        _mixtures, _stages, lambda s: pretraining_rules(s.what.pretraining), _parallelism, _resources,
        _trl_micro_batches, _tokenizer, _post_training, _ablations, lambda s: how_rules(s.how), _evaluation, _gate,
        _attention, _credentials)
    return [issue for check in checks for issue in check(spec)]


def _starting_point(spec: TrainingSpec) -> Iterator[Issue]:
    """Random weights need an architecture, a tokenizer and pretraining; a checkpoint brings the first two."""
    what = spec.what
    if what.model is None:
        if what.architecture is None:
            yield Issue(("what", "architecture"), "missing: training from random weights needs an architecture",
                        "add what.architecture, or start from a checkpoint with what.model.init_from")
        if what.tokenizer is None:
            yield Issue(("what", "tokenizer"), "missing: training from random weights needs tokenizer candidates",
                        "add what.tokenizer, or start from a checkpoint with what.model.init_from")
        if not what.pretraining.stages:
            yield Issue(("what", "pretraining", "stages"), "no pretraining stage: random weights need pretraining",
                        "add a stage, or fine-tune an existing checkpoint with what.model.init_from")
        if not what.data.sources:
            yield Issue(("what", "data", "sources"), "no data source to pretrain on or to train a tokenizer on",
                        "add what.data.sources")
    elif what.tokenizer is not None:
        yield Issue(("what", "tokenizer"), "the tokenizer comes with what.model.init_from: the checkpoint's "
                    "embeddings index its vocabulary", "remove what.tokenizer")


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


def _mixtures(spec: TrainingSpec) -> Iterator[Issue]:
    names = {s.name for s in spec.what.data.sources}
    for i, stage in enumerate(spec.what.pretraining.stages):
        yield from _mixture(stage.mixture, ("what", "pretraining", "stages", i, "mixture"), names)
    for i, stage in enumerate(spec.what.long_context.stages):
        yield from _mixture(stage.mixture, ("what", "long_context", "stages", i, "mixture"), names)
    if spec.what.ablations:
        yield from _mixture(spec.what.ablations.baseline.mixture, ("what", "ablations", "baseline", "mixture"), names)


def _evaluation(spec: TrainingSpec) -> Iterator[Issue]:
    """Every compass benchmark is one compass has offline data for, in a formulation it offers, and every criterion
    names a metric the evaluation produces; a criterion naming a benchmark written wrong is that one mistake, said
    once, at the benchmark (whether a lighteval task's data is on this machine is a machine check in
    compass.flows.validation)."""
    ev = spec.what.evaluation
    names = {s.name for s in spec.what.data.sources}
    wrong: set[str] = set()  # the keys (and the names meant) of benchmarks written wrong
    for i, task in enumerate(ev.benchmarks):
        if task.source == "lighteval" and "formulation" in task.model_fields_set:
            yield Issue(("what", "evaluation", "benchmarks", i, "formulation"), "a lighteval task has its own prompt; "
                        "formulation applies to compass benchmarks only", "remove formulation")
        elif task.source == "compass" and task.name not in COMPASS_BENCHMARKS:
            meant = difflib.get_close_matches(task.name, list(COMPASS_BENCHMARKS), n=1, cutoff=0.6)
            wrong |= {task.key, *meant}
            yield Issue(("what", "evaluation", "benchmarks", i, "name"),
                        f"'{task.name}' is not a benchmark compass has offline data for",
                        (f"did you mean '{meant[0]}'? " if meant else "") +
                        f"compass has: {', '.join(COMPASS_BENCHMARKS)}; or set source: lighteval for a lighteval "
                        "task whose dataset this machine holds")
        elif task.source == "compass" and task.formulation not in COMPASS_BENCHMARKS[task.name]:
            wrong.add(task.key)
            yield Issue(("what", "evaluation", "benchmarks", i, "formulation"),
                        f"{task.name} has no '{task.formulation}' formulation",
                        f"use formulation: {' or '.join(COMPASS_BENCHMARKS[task.name])}")
    for i, src in enumerate(ev.perplexity_sources):
        if src not in names:
            yield Issue(("what", "evaluation", "perplexity_sources", i), f"unknown source '{src}'",
                        f"known sources: {', '.join(sorted(names))}")
    chats = any(p.method != "mid_training" for p in spec.what.post_training)
    yield from unused(ev, "vibe_prompts", ("what", "evaluation"), chats or not ev.vibe_prompts,
                       "vibe prompts are answered by chat post-training steps (sft, dpo, grpo, ...); there are none")
    if not (ev.benchmarks or ev.perplexity_sources):
        return  # nothing is evaluated, so no success report is compiled
    keys = {t.key for t in ev.benchmarks} - wrong  # each gives <key>/<metric>
    if spec.what.long_context.stages:  # passkey@<length>, and per depth passkey@<length>/depth<d>
        keys |= {f"passkey@{n}" for n in [spec.what.trained_length,
                                          *(s.sequence_length for s in spec.what.long_context.stages)]}
    plain = {f"val_{m}:{s}" for s in ev.perplexity_sources for m in ("loss", "ppl")}
    for i, crit in enumerate(spec.why.success_criteria):
        prefix = crit.metric.split("/")[0]
        if crit.metric in plain or prefix in keys and (prefix.startswith("passkey@") or "/" in crit.metric):
            continue
        if prefix in wrong or prefix.split(":")[0] in wrong:  # the benchmark it names is written wrong: said there
            continue
        given = sorted(k if k.startswith("passkey@") else f"{k}/<metric>" for k in keys) + sorted(plain)
        yield Issue(("why", "success_criteria", i, "metric"), f"no evaluation produces the metric '{crit.metric}'",
                    f"the evaluation suite gives: {', '.join(given)}")


def _stages(spec: TrainingSpec) -> Iterator[Issue]:
    pre = spec.what.pretraining.stages
    for i, dup in repeats([s.name for s in pre]):
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
    previous = spec.what.trained_length
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
        yield from unused(stage, "decay_fraction", at, stage.schedule == "wsd", "only wsd decays by a fraction")
        previous, previous_theta = stage.sequence_length, stage.rope_theta
    source = spec.what.long_context.retrieval_source
    names = {s.name for s in spec.what.data.sources}
    if source and source not in names:
        yield Issue(("what", "long_context", "retrieval_source"), f"unknown source '{source}'",
                    f"use one of: {', '.join(sorted(names))}")
    if any(not 0 <= d <= 1 for d in spec.what.long_context.retrieval_depths):
        yield Issue(("what", "long_context", "retrieval_depths"), "depths are fractions of the context",
                    "use values between 0 (start) and 1 (end)")
    for name in ("inference_scaling", "retrieval_depths", "retrieval_samples", "retrieval_source"):
        yield from unused(spec.what.long_context, name, ("what", "long_context"), bool(lc),
                           "there are no long-context stages")
    if spec.what.architecture.positions.kind == "nope" and lc:
        yield Issue(("what", "long_context"), "long-context stages change rope_theta, but the model has no RoPE",
                    "use positions.kind: rope or rnope, or drop the long-context stages")


def _attention(spec: TrainingSpec) -> Iterator[Issue]:
    """torch's varlen kernels run without attention dropout: refused where the architecture asks for some (`auto`
    picks per-document SDPA then)."""
    arch = spec.what.architecture
    if spec.how.attention == "varlen" and arch is not None and arch.dropout > 0:
        yield Issue(("how", "attention"), f"varlen attention has no dropout, and what.architecture.dropout is "
                    f"{arch.dropout:g}", "set how.attention to sdpa or flash, or what.architecture.dropout to 0")


def _parallelism(spec: TrainingSpec) -> Iterator[Issue]:
    how = spec.how
    par = how.parallelism
    devices = how.shape("pretraining").ranks
    used = par.data_parallel * par.tensor_parallel * par.pipeline_parallel
    if used != devices:
        where = "how.resources.pretraining" if how.resources.pretraining.model_fields_set else "the hardware"
        yield Issue(("how", "parallelism"), f"data_parallel x tensor_parallel x pipeline_parallel = {used}, "
                    f"but {where} has {devices} devices", "make the product equal nodes x devices_per_node")
    arch = spec.what.architecture
    if arch.num_heads % par.tensor_parallel or arch.num_kv_heads % par.tensor_parallel:
        yield Issue(("how", "parallelism", "tensor_parallel"),
                    f"tensor_parallel={par.tensor_parallel} must divide num_heads={arch.num_heads} "
                    f"and num_kv_heads={arch.num_kv_heads}", "pick a common divisor")
    stages = [("pretraining", i, s.global_batch_size, par.micro_batch_size)
              for i, s in enumerate(spec.what.pretraining.stages)]
    stages += [("long_context", i, s.global_batch_size, s.micro_batch_size or par.micro_batch_size)
               for i, s in enumerate(spec.what.long_context.stages)]
    locs = [(("what", section, "stages", i, "global_batch_size"), section, gbs, micro)
            for section, i, gbs, micro in stages]
    locs += [(("what", "post_training", i, "batch_size"), "mid_training", s.batch_size, par.micro_batch_size)
             for i, s in enumerate(spec.what.post_training) if s.method == "mid_training"]
    if spec.what.ablations is not None:
        locs.append((("what", "ablations", "baseline", "global_batch_size"), "ablation",
                     spec.what.ablations.baseline.global_batch_size, par.micro_batch_size))
    for loc, phase, gbs, micro in locs:
        data_parallel = par.data_parallel if phase == "pretraining" else how.data_parallel(phase)
        per_step = micro * data_parallel
        if gbs % per_step:
            yield Issue(loc, f"{loc[-1]}={gbs} is not a multiple of micro_batch_size x data_parallel = {per_step}"
                        + ("" if phase == "pretraining" else f" ({phase} on {how.shape(phase).ranks} devices)"),
                        "gradient accumulation needs a whole number of micro-batches")
    if how.hardware.accelerator == "cpu" and how.generation == "vllm":
        yield Issue(("how", "generation"), "vLLM generates on GPUs and this spec's hardware is cpu",
                    "use generation: transformers on CPU, or set how.hardware.accelerator to the GPUs the steps run on")
    if how.hardware.accelerator == "cpu" and how.precision != "fp32":
        yield Issue(("how", "precision"), f"{how.precision} is not supported on CPU: training there is fp32",
                    "use fp32 on CPU (bf16 is ~17x slower there; fp16 does not train)")
    elif how.precision == "fp16" and par.engine_name != "deepspeed":
        yield Issue(("how", "precision"), f"fp16 trains only under DeepSpeed (its loss scaler); the {par.engine_name} "
                    "engine would train in fp32", "use bf16, or parallelism.engine: deepspeed")
    yield from _gradient_reduction(spec)
    yield from _node_scratch(spec)
    yield from _checkpoint_cadence(spec)
    if par.pipeline_parallel > 1:
        yield Issue(("how", "parallelism", "pipeline_parallel"), "pipeline parallelism is not supported",
                    "use data and tensor parallelism (with ZeRO) instead")
    if par.engine_name == "fsdp2" and par.tensor_parallel > 1 and arch.family == "moe":
        yield Issue(("how", "parallelism", "tensor_parallel"), "FSDP2's tensor parallelism splits dense blocks: the "
                    "experts of a moe architecture are not split", "use engine: deepspeed with tensor_parallel, or "
                    "tensor_parallel: 1 (FSDP2 alone shards the experts over the data-parallel ranks)")
    elif par.tensor_parallel > 1 and par.engine_name == "ddp":
        yield Issue(("how", "parallelism", "tensor_parallel"), "DDP does not split layers: tensor parallelism runs on "
                    "FSDP2's DTensor plans or DeepSpeed's AutoTP", "set parallelism.engine: fsdp2 (or deepspeed), or "
                    "tensor_parallel: 1")
    if par.tensor_parallel > 1 and par.deepspeed and par.zero_stage == 3:
        yield Issue(("how", "parallelism", "zero_stage"), "DeepSpeed's AutoTP trains with ZeRO stages 0-2, not 3",
                    "use zero_stage: 1 or 2 with tensor parallelism (ZeRO-3 alone shards the weights too)")
    if how.loss == "liger" and par.sharding_stage == 3:
        yield Issue(("how", "loss"), "Liger's fused loss reads the whole output head outside the head's forward, "
                    f"where {'FSDP2' if par.engine_name == 'fsdp2' else 'ZeRO-3'} holds only this rank's shard of it",
                    "use loss: chunked or auto (under ZeRO-3 compass recomputes the head inside its gathered "
                    "forward), or zero_stage: 2")
    if par.tensor_parallel > 1 and spec.what.architecture.family == "moe":
        yield Issue(("how", "parallelism", "tensor_parallel"), "tensor parallelism of MoE layers is not supported",
                    "use data parallelism with ZeRO for MoE models")
    if not par.reshard_after_forward and par.engine_name != "fsdp2":
        yield Issue(("how", "parallelism", "reshard_after_forward"), "reshard_after_forward is FSDP2's; the "
                    f"{par.engine_name} engine does not use it", "remove it, or use engine: fsdp2")
    if par.shard_group is not None and par.engine_name != "fsdp2":
        yield Issue(("how", "parallelism", "shard_group"), f"shard_group is FSDP2's; the {par.engine_name} engine "
                    "does not use it", "remove shard_group, or use engine: fsdp2")
    elif par.shard_group is not None and par.data_parallel % par.shard_group:
        yield Issue(("how", "parallelism", "shard_group"), f"{par.data_parallel} data-parallel ranks do not split "
                    f"into shard groups of {par.shard_group}", "use a divisor of data_parallel (the GPUs of a node)")
    if par.engine_name == "fsdp2" and par.zero_stage:
        yield Issue(("how", "parallelism", "zero_stage"), "zero_stage is DeepSpeed's; FSDP2 shards parameters, "
                    "gradients and optimizer states over the data-parallel ranks (as ZeRO-3)", "remove zero_stage")
    elif not par.deepspeed and par.zero_stage:
        yield Issue(("how", "parallelism", "zero_stage"), "ZeRO needs deepspeed: true",
                    "set deepspeed: true or zero_stage: 0")
    hw = how.hardware
    for i, host in enumerate(hw.hosts):
        if not HOST.fullmatch(host):
            yield Issue(("how", "hardware", "hosts", i), f"{host!r} is not a host name or address",
                        "letters, digits and . - _ : @ (user@host), not starting with '-': it reaches ssh's command "
                        "line and DeepSpeed's hostfile")
    if hw.hosts and len(hw.hosts) != hw.nodes:
        yield Issue(("how", "hardware", "hosts"), f"{len(hw.hosts)} hosts for nodes={hw.nodes}",
                    "list one address per node, the rendezvous host first")
    if how.orchestration.cluster is not None and hw.hosts:
        yield Issue(("how", "hardware", "hosts"), "Slurm chooses the nodes of each job: hosts are not used with "
                    "orchestration.cluster", "remove how.hardware.hosts (use cluster.exclude to avoid nodes)")
    if how.orchestration.cluster is not None and how.orchestration.task_runner == "ray":
        yield Issue(("how", "orchestration", "cluster"), "training runs either as Slurm jobs or as Ray tasks",
                    "use task_runner: local with a Slurm cluster (the jobs spread over the nodes themselves)")
    if hw.launcher == "deepspeed" and not par.deepspeed:
        yield Issue(("how", "hardware", "launcher"), "the deepspeed launcher needs parallelism.deepspeed: true",
                    "use launcher: torchrun, or set deepspeed: true")


def _tokenizer(spec: TrainingSpec) -> Iterator[Issue]:
    tok = spec.what.tokenizer
    if tok is None:  # the starting checkpoint's
        return
    for i, dup in repeats([c.key for c in tok.candidates]):
        yield Issue(("what", "tokenizer", "candidates", i), f"candidate '{dup}' is listed twice",
                    "list each candidate once")
    vocab = spec.what.architecture.vocab_size
    if vocab is not None and len(tok.candidates) > 1:
        yield Issue(("what", "architecture", "vocab_size"),
                    "vocab_size is fixed while several tokenizer candidates compete",
                    "leave vocab_size empty so the chosen tokenizer sets it")
    yield from unused(tok.selection, "tolerance", ("what", "tokenizer", "selection"),
                       tok.selection.rule == "smallest_within", "only smallest_within has a tolerance")


def _post_training(spec: TrainingSpec) -> Iterator[Issue]:
    """Rules inside post_training; whether the checkpoints it names exist is checked on the compiled plan."""
    post = spec.what.post_training
    for i, dup in repeats([s.name for s in post]):
        yield Issue(("what", "post_training", i, "name"),
                    f"post-training step '{dup}' is named twice", "name every step differently")
    sources = {s.name for s in spec.what.data.sources}
    named = {ref.removeprefix(NAMED_MODEL_PREFIX) for ref in checkpoint_refs(spec.what.post_training)}
    for name in spec.what.models:
        if name not in named:
            yield Issue(("what", "models", name), f"no step uses model '{name}': it would be copied for nothing",
                        f"name it as model:{name} in a strong_vs_weak pair or a distill teacher, or remove it")
    for i, step in enumerate(post):
        at = ("what", "post_training", i)
        if step.method == "mid_training":
            if step.dataset not in sources:
                yield Issue((*at, "dataset"),
                            f"mid-training continues pretraining on a curated source; '{step.dataset}' is not one",
                            f"use one of: {', '.join(sorted(sources))}")
            if any(s.method != "mid_training" for s in post[:i]):
                yield Issue((*at, "method"),
                            "mid-training continues the pretraining state, so it comes before SFT, preference "
                            "optimisation and RL", "move it to the top of post_training")
        if not isinstance(step, MidTraining):  # a field of another method of the family (DPO's loss_type, SimPO's
            for name, readers in family_reads(type(step)).items():  # simpo_gamma)
                yield from unused(step, name, at, step.method in readers,
                                  f"only {' and '.join(readers)} reads it, not {step.method}")
        if step.method == "grpo" and bool(step.length_penalty) != (step.target_length is not None):
            yield Issue((*at, "length_penalty" if step.length_penalty else "target_length"),
                        "length_penalty and target_length work together: the penalty is per token beyond the target",
                        "set both, or neither")
        peft = getattr(step, "peft", None)
        if peft is not None and peft.kind == "qlora" and spec.how.hardware.accelerator == "cpu":
            yield Issue((*at, "peft", "kind"), "qlora trains on a 4-bit copy of the model made by bitsandbytes, "
                        "which needs CUDA; how.hardware.accelerator is cpu", "use kind: lora on CPU")
        if step.method == "distill":
            layers = spec.what.architecture.num_layers
            if step.student_layers is not None and step.student_layers >= layers:
                yield Issue((*at, "student_layers"),
                            f"a student of {step.student_layers} layers is not smaller than the model's {layers}",
                            f"use fewer than {layers} layers, or leave it out to distil into the model as is")


def _gate(spec: TrainingSpec) -> Iterator[Issue]:
    """The gate measures existing models on the suite's benchmarks: a production `why` needs a criterion on one."""
    why = spec.why
    if getattr(why, "reason", None) != "production":
        return
    keys = {t.key for t in spec.what.evaluation.benchmarks}
    if not any(c.metric.partition("/")[0] in keys for c in why.success_criteria):
        yield Issue(("why", "success_criteria"),
                    "no criterion can be measured on the existing models: perplexities depend on each model's "
                    "tokenizer", "add a criterion on a benchmark of what.evaluation.benchmarks (<task key>/<metric>, "
                    f"e.g. {next(iter(sorted(keys)), 'arc_easy:cf')}/acc)")


def _ablations(spec: TrainingSpec) -> Iterator[Issue]:
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
    tasks = {t.key for t in spec.what.evaluation.benchmarks}
    sources = set(abl.baseline.mixture)
    for i, metric in enumerate(abl.metrics):
        task, _, name = metric.partition("/")
        known = (metric == "val_loss" or (metric.startswith("val_loss:") and metric.split(":", 1)[1] in sources)
                 or (task in tasks and name))
        if not known:
            yield Issue(("what", "ablations", "metrics", i),
                        f"'{metric}' is not a metric the ablation runs produce",
                        "use val_loss, val_loss:<source of the baseline mixture> or <task key>/<metric> of "
                        f"what.evaluation.benchmarks ({', '.join(sorted(tasks)) or 'none listed: add one'})")
    for i, dup in repeats([v.name for v in abl.variants]):
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
        elif path.startswith("architecture."):
            yield from _variant_architecture(variant.name, base["architecture"], path, value, (*at, path))


def _variant_architecture(name: str, proxy: dict[str, Any], path: str, value: Any, at: Loc) -> Iterator[Issue]:
    """The proxy model with the variant's change must itself be a model compass can build."""
    changed = json.loads(json.dumps(proxy))
    node, (*parents, leaf) = changed, path.split(".")[1:]
    for key in parents:
        node = node[key]
    node[leaf] = value
    try:
        arch = Architecture.model_validate(changed)
    except ValidationError as exc:
        yield Issue(at, f"variant '{name}' makes the proxy architecture invalid: {exc.errors()[0]['msg']}",
                    "change a field to a value what.architecture accepts")
        return
    for issue in architecture_rules(arch, at):
        yield Issue(at, f"variant '{name}' makes a model compass cannot build: {issue.message}", issue.hint)


COMPASS_TRAINED = ("ablation", "pretraining", "long_context", "mid_training")  # phases compass's trainer runs


def _node_scratch(spec: TrainingSpec) -> Iterator[Issue]:
    """Each step's copy onto its nodes' local disk (specs/staging_costs.py) fits how.storage.local_cache_gib."""
    for cost in over_capacity(spec):
        shape = spec.how.shape(cost.phase)
        yield Issue(("how", "storage", "local_cache_gib"),
                    f"{cost.step} stages {cost.per_node / GIB:,.0f} GiB of token shards on each of its {cost.nodes} "
                    f"node(s) ({cost.tokens:.3g} tokens drawn, with the window's margin), more than the "
                    f"{spec.how.storage.local_cache_gib:,.0f} GiB of local_cache_gib",
                    f"give how.resources.{cost.phase} more nodes (now {shape.nodes}: each copies its share), "
                    "train the step on fewer tokens, or point local_cache at a larger disk")


def _credentials(spec: TrainingSpec) -> Iterator[Issue]:
    """No value holds a password in a URL (`scheme://user:password@host`): the spec's text is a flow run's
    parameter in Prefect's database, is printed with the plan and sits in every manifest's lineage."""
    for at in _urls_holding_secrets(spec):
        yield Issue(at, "holds a password (a URL's user:password@, or a password= or token= in its query): the "
                    "spec is stored with the run in Prefect's database and in every artifact's lineage",
                    "give the login to the library through its environment on the machines that run the steps "
                    "(MLflow: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; S3: AWS_ACCESS_KEY_ID or "
                    "how.storage.credentials_block) and write the URL without it")


def _urls_holding_secrets(model: TrainingSpec) -> Iterator[Loc]:
    """Where a value of `model` is a URL holding a credential (prose is not judged: a URL has a scheme)."""
    def walk(value: Any, at: tuple) -> Iterator[Loc]:
        if isinstance(value, str) and "://" in value and redact(value) != value:
            yield at
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from walk(item, (*at, key))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                yield from walk(item, (*at, i))

    yield from walk(model.model_dump(mode="json", exclude_defaults=True), ())


def _checkpoint_cadence(spec: TrainingSpec) -> Iterator[Issue]:
    """Each training job trains long enough to commit progress: its time limit outlasts the start-up and the stop
    signal's lead; and without a stop signal before the limit (cluster.requeue: false) a job saves only at the
    checkpoint cadence, so a stage whose checkpoint interval is longer than its jobs' time never commits progress
    and each retry starts from the same checkpoint again (specs/goodput_plan.py times the interval)."""
    how = spec.how
    cluster = how.orchestration.cluster
    if cluster is None:
        return
    for split in predicted_splits(spec):
        phase = PHASE_OF_SECTION[split.stage.split(":", 1)[0]]
        limit = how.shape(phase).time_limit
        if limit is None:
            continue
        given = getattr(how.resources, phase).time_limit is not None
        at = ("how", "resources", phase, "time_limit") if given else ("how", "orchestration", "cluster", "time_limit")
        usable = slurm_seconds(limit) - how.hardware.startup_estimate_s - how.stop_lead_s
        interval = split.compute_s / max(1, split.checkpoints)
        if usable <= 0:  # a job ends (or is asked to stop) before it has started training
            yield Issue(at, f"{split.stage}: its jobs' time limit {limit} leaves no time to train after the start-up "
                        f"(~{how.hardware.startup_estimate_s:,.0f} s, how.hardware.startup_s) and the stop signal's "
                        f"lead ({how.stop_lead_s:,.0f} s)", "give the phase a longer time limit")
        elif not cluster.requeue and interval > usable:
            steps = how.checkpoints.every_steps
            fewer = max(1, int(steps * usable / interval))
            yield Issue(("how", "checkpoints", "every_steps"),
                        f"{split.stage} saves a checkpoint every ~{interval / 3600:,.1f} h ({steps:,} steps), longer "
                        f"than the ~{usable / 3600:,.1f} h a job of its {limit} time limit trains, and nothing stops "
                        "a job to save before its limit (how.orchestration.cluster.requeue: false): no job would "
                        "commit progress",
                        f"set how.checkpoints.every_steps to at most {fewer:,}, or requeue: true (a job saves and "
                        "requeues itself before its limit)")


def _gradient_reduction(spec: TrainingSpec) -> Iterator[Issue]:
    """how.reduce_precision is either fp32 or the training precision, and an engine that can honour it: DeepSpeed
    at ZeRO-0 sums and all-reduces bf16/fp16 gradients in the weights' dtype (its DDP_BFLOAT16 / FP16 optimizers;
    fp32 accumulation there raises NotImplementedError in DeepSpeed 0.19), so fp32 asks for ZeRO-1 or above. TRL's
    steps at ZeRO-0 train under DDP with fp32 weights: only compass's own trainer meets the limit."""
    how, par = spec.how, spec.how.parallelism
    at = ("how", "reduce_precision")
    if how.precision == "fp32" and how.reduce_precision != "fp32":
        yield Issue(at, f"reduce_precision {how.reduce_precision} applies to bf16/fp16 training; this spec trains in "
                    "fp32, whose gradients are fp32", "remove reduce_precision")
    elif how.reduce_precision not in ("fp32", how.precision):
        yield Issue(at, f"gradients of {how.precision} training are reduced in fp32 or in {how.precision}, not in "
                    f"{how.reduce_precision}", f"use reduce_precision: fp32 (the recipe's) or {how.precision}")
    elif par.zero_stage == 0 and zero0_cannot_reduce_in_fp32(spec):
        yield Issue(("how", "parallelism", "zero_stage"), f"DeepSpeed at ZeRO-0 sums and all-reduces {how.precision} "
                    f"gradients in {how.precision} (its low-precision DDP optimizer), and how.reduce_precision asks "
                    "for fp32 (the recipe's)", "use zero_stage: 1 (fp32 accumulation and reduction, and each rank "
                    "keeps and checkpoints only its share of the optimizer state), or reduce_precision: "
                    f"{how.precision}")


def zero0_cannot_reduce_in_fp32(spec: TrainingSpec) -> bool:
    """Whether DeepSpeed at ZeRO-0 would leave this spec's gradients in its low precision: bf16/fp16 training,
    reduction asked in fp32, on GPUs (on the CPU bf16 itself is refused), with a phase compass's trainer runs. The
    planner recommends no such stage (flows/reports/plan_tables.sharding_advice)."""
    how, par = spec.how, spec.how.parallelism
    return (how.precision != "fp32" and how.reduce_precision == "fp32" and par.engine_name == "deepspeed"
            and how.hardware.accelerator != "cpu" and bool(phases_of(spec) & set(COMPASS_TRAINED)))


def phases_of(spec: TrainingSpec) -> set[Phase]:
    """The phases the spec has steps in."""
    what = spec.what
    phases: set[Phase] = set()
    if what.data.sources:
        phases.add("data")
    if what.ablations is not None:
        phases.add("ablation")
    if what.pretraining.stages:
        phases.add("pretraining")
    if what.long_context.stages:
        phases.add("long_context")
    methods = {p.method for p in what.post_training}
    if "mid_training" in methods:
        phases.add("mid_training")
    if methods - {"mid_training"}:
        phases.add("post_training")
    if what.evaluation.benchmarks or what.evaluation.perplexity_sources or getattr(spec.why, "existing_models", None):
        phases.add("evaluation")
    return phases


NO_MODEL_PARALLEL = ("data", "post_training", "evaluation")  # TRL's and lighteval's ranks are data-parallel only


def _trl_batches(post_training: list[PostTrainStep], ranks: int) -> Iterator[Issue]:
    """A TRL step's `batch_size` is its global batch: every rank of the phase's shape (how.resources) takes an equal
    share (GRPO: of whole groups)."""
    for i, post in enumerate(post_training):
        if post.method == "mid_training" or ranks <= 1:
            continue
        batch = post.batch_size
        if post.method == "grpo":
            batch = max(post.num_generations, batch // post.num_generations * post.num_generations)
        if batch % ranks:
            yield Issue(("what", "post_training", i, "batch_size"),
                        f"the global batch of {batch} does not split evenly over the post-training phase's {ranks} "
                        "ranks (how.resources.post_training)", f"use a multiple of {ranks}")


def _trl_micro_batches(spec: TrainingSpec) -> Iterator[Issue]:
    """A TRL step's `micro_batch_size` divides each rank's share of its global batch; GRPO batches itself."""
    ranks = spec.how.shape("post_training").ranks
    for i, post in enumerate(spec.what.post_training):
        micro = getattr(post, "micro_batch_size", None)
        if micro is None:
            continue
        share = max(1, post.batch_size // max(1, ranks))
        if post.method == "grpo":
            yield Issue(("what", "post_training", i, "micro_batch_size"), "GRPO batches whole groups of completions "
                        "itself", "remove micro_batch_size from the grpo step")
        elif share % micro:
            yield Issue(("what", "post_training", i, "micro_batch_size"),
                        f"each of the {ranks} rank(s) takes {share} rows of the global batch, not a multiple of "
                        f"micro_batch_size {micro}", f"use a micro_batch_size that divides {share}")


def _resources(spec: TrainingSpec) -> Iterator[Issue]:
    """Each phase's shape is used by every step of the phase, or refused: a shape for a phase the spec does not
    have, Slurm-only fields without a cluster, devices a phase cannot use, ranks tensor parallelism cannot split."""
    how = spec.how
    par = how.parallelism
    cluster = how.orchestration.cluster
    present = phases_of(spec)
    at = ("how", "resources")
    group = par.tensor_parallel * par.pipeline_parallel
    for phase in PHASES:
        given = getattr(how.resources, phase)
        if not given.model_fields_set:
            continue
        if phase not in present:
            yield Issue((*at, phase), f"the spec has no {phase.replace('_', '-')} steps: this shape would be unused",
                        f"remove how.resources.{phase}")
            continue
        for field in ("cpus_per_node", "memory_gb", "time_limit", "partition"):
            yield from unused(given, field, (*at, phase), cluster is not None,
                               "it is a Slurm job's request: set how.orchestration.cluster, or remove it")
        shape = how.shape(phase)
        if phase == "data" and shape.devices_per_node:
            yield Issue((*at, phase, "devices_per_node"), "data steps use no GPU", "remove devices_per_node")
        if phase == "evaluation" and how.generation == "vllm" and shape.nodes > 1:
            yield Issue((*at, phase, "nodes"), "with how.generation: vllm, lighteval's vLLM spreads over one node's "
                        f"GPUs; {shape.nodes} nodes would sit idle but one", "use nodes: 1 (or generation: "
                        "transformers, which runs lighteval data-parallel over every node's devices)")
        if phase == "post_training":
            yield from _trl_batches(spec.what.post_training, shape.ranks)
        if phase not in ("data", "evaluation") and shape.devices_per_node == 0:
            yield Issue((*at, phase, "devices_per_node"), f"{phase} trains: it needs at least one device per node",
                        "set devices_per_node to the GPUs per node (ranks per node on CPU)")
        elif phase not in NO_MODEL_PARALLEL and shape.ranks % group:
            yield Issue((*at, phase), f"{shape.ranks} devices do not split into tensor_parallel x pipeline_parallel "
                        f"= {group} groups", "use a multiple of that many devices")
        hosts = how.hardware.hosts
        if cluster is None and shape.nodes > 1 and len(hosts) < shape.nodes:
            yield Issue((*at, phase, "nodes"), f"{phase} runs on {shape.nodes} nodes and how.hardware.hosts names "
                        f"{len(hosts)}", "list the nodes' addresses in how.hardware.hosts, or run on a Slurm cluster")
    if cluster is None and how.hardware.cpus_per_node is not None:
        yield Issue(("how", "hardware", "cpus_per_node"), "cpus_per_node has no effect here: it is a Slurm job's "
                    "request", "set how.orchestration.cluster (data steps here use how.orchestration.workers)")
    if cluster is not None and cluster.shared_root is None:
        yield Issue(("how", "orchestration", "cluster", "shared_root"), "a cluster needs a shared root: jobs on "
                    "compute nodes read and write the steps' work folders, staging and input copies",
                    "set shared_root to a folder every node mounts at the same path (e.g. /fsx/compass)")


_MISSING = object()


def _lookup(node: Any, parts: list[str]) -> Any:
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node
