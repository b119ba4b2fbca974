"""Post-training steps with TRL: SFT (assistant-only loss), preference optimisation (DPO and its loss types,
ORPO, KTO, SimPO) on pairs the pipeline builds, RL with verifiable rewards (GRPO) and on-policy distillation (GKD),
each method as its record says (specs/post_training_methods.py);
mid-training (continued pretraining on a curated source) is its own kind on compass's trainer
(tasks/kinds/mid_training.py).

Each step starts from the previous model step's final weights, exports a Hugging Face folder with its
tokenizer and chat template, continues the metrics history (tokens keep counting), and answers the spec's
vibe-check prompts so a person can read them in the UI."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compass.infra.errors import DataError, StopRequested
from compass.infra.layout import CONTINUED_PARTS, FINAL, ModelArtifact, WorkFolder
from compass.infra.packages import fetch_package
from compass.model.training.history import tokens_seen
from compass.model.training.job import Telemetry
from compass.model.training.records import MetricsRow, goodput_table, read_metrics, write_metrics
from compass.specs.base import Issue
from compass.specs.post_training import Distillation, Grpo, MidTraining, Preference, Sft
from compass.specs.post_training_methods import method_of
from compass.specs.sources import parse_source_uri
from compass.specs.spec import TrainingSpec
from compass.specs.starting_model import NAMED_MODEL_PREFIX
from compass.tasks.common.arithmetic import fenced, training_arithmetic
from compass.tasks.common.devices import Device, device_for, setup_of
from compass.tasks.common.fence import INDEX_FOLDER, fence_read_by
from compass.tasks.common.tracking import tracker_run_of
from compass.tasks.common.training import plot_loss, telemetry_of
from compass.tasks.evaluation.offline_benchmarks import PACKAGE
from compass.tasks.post_training.adapters import export_merged
from compass.tasks.post_training.chat import IM_END, IM_START, generate, load_chat_model, on_device
from compass.tasks.post_training.datasets import (
    CONVERSATION_SHAPES,
    PAIR_SHAPES,
    chat_examples,
    dataset_problem,
    dataset_root,
)
from compass.tasks.post_training.drawn import DISTILL_SEED, MAX_CHARS_PER_TOKEN, PAIRS_SEED, SFT_SEED
from compass.tasks.post_training.reasoning import (
    HYBRID_TEMPLATE,
    NO_THINK,
    THINK,
    mixed,
    reasoning_conversations,
    with_mode,
)
from compass.tasks.post_training.trl_job import TrlJob, TrlResult
from compass.tasks.steps.context import InputArtifact, StepContext, StepResult
from compass.tasks.steps.kind import TRANSFORMERS, TRL_HOW, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig
from compass.tasks.steps.wiring import Inputs, R


class PostTrainConfig(StepConfig):
    """What every post-training step reads besides its own section: the run's seed and the vibe prompts."""

    omit_when_none = frozenset({"dataset_stamp"})  # packaged data is named by its version: identities as before

    seed: int
    vibe_prompts: list[str]


class SftConfig(Sft, PostTrainConfig):
    pass


class PreferenceConfig(Preference, PostTrainConfig):
    omit_when_none = PostTrainConfig.omit_when_none | {"simpo_gamma"}  # SimPO's, unset: other methods' identities


class GrpoConfig(Grpo, PostTrainConfig):
    pass


class DistillConfig(Distillation, PostTrainConfig):
    pass


TrlConfig = SftConfig | PreferenceConfig | GrpoConfig | DistillConfig
CONFIGS: dict[type, type[PostTrainConfig]] = {Sft: SftConfig, Preference: PreferenceConfig, Grpo: GrpoConfig,
                                              Distillation: DistillConfig}  # by the section model of a method's record


@dataclass(frozen=True)
class PostTrainInputs(Inputs[R]):
    """The tokenizer, the model it continues, and the models a method reads besides: the strong and weak answerers
    of preference pairs, a distillation teacher."""

    tokenizer: R
    previous: R
    strong: R | None = None
    weak: R | None = None
    teacher: R | None = None
    fence: R | None = None  # the decontamination fence whose matches are left out (`remove`)


def build(plan: PlanBuilder) -> None:
    """The spec's post-training list in order, each step continuing the newest model; mid-training entries are
    steps of their own kind (tasks/kinds/mid_training.py: compass's trainer, not TRL), asked for in their place."""
    what = plan.spec.what
    pt = what.pretraining
    common = {"seed": pt.seed, "vibe_prompts": what.evaluation.vibe_prompts}
    for i, post in enumerate(what.post_training):
        if isinstance(post, MidTraining):
            plan.require("mid_training", post.name)
            continue
        previous = plan.newest_model()
        if previous is None:
            raise ValueError(f"post-training {post.name} has no model to continue")
        config = CONFIGS[method_of(post).section](**dict(post), **common)
        at = ("what", "post_training", i)
        refs = []
        if isinstance(post, Preference) and post.pairs and post.pairs.kind == "strong_vs_weak":
            refs = [("strong", post.pairs.strong, (*at, "pairs", "strong")),
                    ("weak", post.pairs.weak, (*at, "pairs", "weak"))]
        elif isinstance(post, Distillation):
            refs = [("teacher", post.teacher, (*at, "teacher"))]
        models = {role: resolved for role, ref, loc in refs if (resolved := plan.checkpoint(ref, loc)) is not None}
        inputs = PostTrainInputs(tokenizer=plan.tokenizer(), previous=previous, fence=fence_read_by(plan), **models)
        plan.add(KIND, post.name, config, inputs)




def _endpoint(ctx: StepContext[TrlConfig]) -> Telemetry | None:
    """What each rank's Prometheus endpoint needs (how.monitoring.prometheus): its labels, port and targets folder.
    TensorBoard and the trackers are the job's own fields."""
    if not ctx.runtime.how.monitoring.prometheus:
        return None
    return telemetry_of(ctx).model_copy(update={"tensorboard": False, "trackers": None})


def _tensorboard_run(ctx: StepContext[TrlConfig]) -> Path | None:
    """A TensorBoard run per post-training step, beside the pretraining ones (how.monitoring.trackers)."""
    if "tensorboard" not in ctx.runtime.how.monitoring.trackers:
        return None
    from compass.model.training.telemetry import tensorboard_run

    return tensorboard_run(ctx.runtime.monitoring_dir(ctx.store, ctx.workdir), f"{ctx.kind}:{ctx.name}")


def _system_prompt(cfg: PostTrainConfig) -> str | None:
    return cfg.system_prompt if isinstance(cfg, SftConfig) else None


def _conversations(ctx: StepContext[TrlConfig], seed: int, limit: int | None) -> list[list[dict[str, str]]]:
    cfg = ctx.config
    root, _ = dataset_root(cfg.dataset, ctx.runtime.base_dir)
    return chat_examples(root, limit, seed, cfg.max_length * MAX_CHARS_PER_TOKEN, _system_prompt(cfg))


def sft_rows(ctx: StepContext[SftConfig], model, tokenizer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """SFT's conversations; a hybrid reasoner's mix of worked arithmetic in /think mode and the dataset in
    /no_think mode (its template set on the tokenizer)."""
    cfg = ctx.config
    # a hybrid mix takes at most max_samples of these too: parsing a package's million lines for eight took 20 s
    conversations = _conversations(ctx, seed=SFT_SEED, limit=cfg.max_samples)
    facts: dict[str, Any] = {}
    if cfg.reasoning:

        tokenizer.chat_template = HYBRID_TEMPLATE
        root = fetch_package(PACKAGE)[0]
        think = reasoning_conversations(fenced(training_arithmetic(root), root, f"sft {ctx.name}'s think mode"))
        total = cfg.max_samples or len(conversations)
        conversations = mixed(think, conversations, cfg.reasoning.think_fraction, total, seed=cfg.seed)
        facts["think_examples"] = sum("/think" in c[0]["content"] for c in conversations)
    return [{"messages": m} for m in conversations], {"examples": len(conversations), **facts}


PAIR_SEED = 17
PAIR_TOKENS = 48


def answer_prompts(model_dir: Path, prompts: list[list[dict[str, str]]], where: Device | None = None,
                   own_template: bool = False) -> list[str]:
    """One checkpoint's sampled answers to the preference prompts (seeded: the same answers every time), on the
    step's GPU when it has one; a model of what.models with its own chat template."""
    model, tokenizer = load_chat_model(model_dir, where, own_template)
    return generate(model, tokenizer, prompts, max_new_tokens=PAIR_TOKENS, seed=PAIR_SEED)


def fitting_prompts(prompts: list[list[dict[str, str]]], tokenizer, budget: int) -> list[list[dict[str, str]]]:
    """Prompts short enough to leave room for an answer within max_length: a truncated pair has no completion
    tokens left, and the preference losses turn into NaN."""
    return [p for p in prompts
            if len(tokenizer(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]) <= budget]


def preference_pairs(ctx: StepContext[PreferenceConfig], tokenizer) -> list[dict[str, Any]]:
    """Strong-versus-weak pairs: held-back prompts answered by the strong and the weak checkpoint (of this run,
    or of what.models); chosen = strong, rejected = weak. Pairs with identical answers, or an empty one (no
    completion tokens: the preference losses would divide by zero), are dropped."""
    cfg = ctx.config
    conversations = _conversations(ctx, seed=PAIRS_SEED, limit=cfg.max_samples)
    prompts = fitting_prompts([c[:-1] for c in conversations], tokenizer, cfg.max_length - PAIR_TOKENS)
    if not prompts:
        raise ValueError(f"post_training {ctx.name}: none of the {len(conversations)} prompts drawn leaves "
                         f"{PAIR_TOKENS} tokens for an answer within max_length {cfg.max_length}: raise max_length or "
                         "max_samples")
    where = device_for(ctx.runtime.how)
    named = {"strong": cfg.pairs.strong, "weak": cfg.pairs.weak}
    given = ctx.given(PostTrainInputs)
    answerers = {"strong": given.strong, "weak": given.weak}
    answers = {role: answer_prompts(ModelArtifact(_required(answerer, role, ctx).local()).final, prompts, where,
                                    own_template=named[role].startswith(NAMED_MODEL_PREFIX))
               for role, answerer in answerers.items()}
    return [{"prompt": p, "chosen": [{"role": "assistant", "content": s}],
             "rejected": [{"role": "assistant", "content": w}]}
            for p, s, w in zip(prompts, answers["strong"], answers["weak"], strict=True) if s and w and s != w]


def verifier_problems(root: Path, easiest_first: bool, limit: int | None, step: str) -> list[dict[str, str]]:
    """The problems verifier pairs sample answers for: training problems, the easiest first if asked."""
    problems = training_arithmetic(root)
    if easiest_first:
        problems = sorted(problems, key=lambda p: (len(p["answer"].lstrip("-")), len(p["question"])))  # stable
    return fenced(problems[:limit] if limit else problems, root, f"the verifier pairs of {step}")


def grpo_problems(root: Path, limit: int | None, step: str) -> list[dict[str, str]]:
    """GRPO's prompts: the first `limit` training problems (all of the training half without a limit)."""
    return fenced(training_arithmetic(root, limit), root, f"grpo {step}")


def build_pairs(ctx: StepContext[PreferenceConfig], tokenizer) -> list[dict[str, Any]]:
    """The step's preference pairs: from the dataset, strong versus weak, or graded on-policy samples."""
    from compass.tasks.post_training.pairs import dataset_pairs, on_policy_pairs

    cfg = ctx.config
    pairs_spec = cfg.pairs
    if pairs_spec is not None and pairs_spec.kind == "strong_vs_weak":
        pairs = preference_pairs(ctx, tokenizer)
        why = "the strong and weak checkpoints answered every prompt identically; pick checkpoints further apart"
    elif pairs_spec is not None:  # verifier
        root, _ = dataset_root(cfg.dataset, ctx.runtime.base_dir)
        problems = verifier_problems(root, pairs_spec.easiest_first, cfg.max_samples, ctx.name)
        pairs = on_policy_pairs(ModelArtifact(ctx.given(PostTrainInputs).previous.local(FINAL)).final, problems,
                                pairs_spec.samples_per_prompt,
                                pairs_spec.verifier, 32, PAIR_SEED, device_for(ctx.runtime.how))
        why = (f"no problem got both a right and a wrong answer among {pairs_spec.samples_per_prompt} "
               "samples; sample more per prompt, or start from a stronger checkpoint")
    else:
        root, _ = dataset_root(cfg.dataset, ctx.runtime.base_dir)
        pairs = dataset_pairs(root, cfg.max_samples)
        why = (f"{cfg.dataset} has no JSONL lines with prompt, chosen and rejected; name a pairs dataset or "
               "set pairs: {kind: strong_vs_weak, ...} or {kind: verifier}")
        if not pairs:
            raise DataError(f"post_training {ctx.name}: no preference pairs: {why}")
    if not pairs:
        raise ValueError(f"post_training {ctx.name}: no preference pairs: {why}")
    return pairs


def preference_rows(ctx: StepContext[PreferenceConfig], model, tokenizer) -> tuple[list[dict[str, Any]], dict]:
    pairs = build_pairs(ctx, tokenizer)
    with open(ModelArtifact(ctx.out).pairs, "w") as f:
        f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)
    return pairs, {"pairs": len(pairs)}


def grpo_rows(ctx: StepContext[GrpoConfig], model, tokenizer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cfg = ctx.config
    root, _ = dataset_root(cfg.dataset, ctx.runtime.base_dir)
    problems = grpo_problems(root, cfg.max_samples, ctx.name)
    if not problems:
        raise ValueError(f"post_training {ctx.name}: no problems with checkable answers in {cfg.dataset}")
    rows = [{"prompt": [{"role": "user", "content": p["question"]}], **p} for p in problems]
    return rows, {"problems": len(problems)}


def distill_rows(ctx: StepContext[DistillConfig], model, tokenizer) -> tuple[list[dict[str, Any]], dict]:
    """The student (the previous model, shrunk to `student_layers` if asked) distils on the dataset's prompts."""
    cfg = ctx.config
    if cfg.teacher.startswith(NAMED_MODEL_PREFIX):
        teacher = _required(ctx.given(PostTrainInputs).teacher, "teacher", ctx)
        same_vocabulary(ModelArtifact(teacher.local()).final, tokenizer, f"distill {ctx.name}")
    if cfg.student_layers:
        total = model.config.num_hidden_layers
        kept = keep_layers(model, cfg.student_layers)
        ctx.log.info("distill %s: student keeps layers %s of %d", ctx.name, kept, total)
    rows = [{"messages": m} for m in _conversations(ctx, seed=DISTILL_SEED, limit=cfg.max_samples)]
    return rows, {"examples": len(rows), "student_layers": model.config.num_hidden_layers,
                  "student_parameters": sum(p.numel() for p in model.parameters())}


def same_vocabulary(teacher: Path, tokenizer, step: str) -> None:
    """GKD compares the teacher's and the student's distributions token by token: a teacher from outside the run
    must share the student's vocabulary (ChatML's tokens are added to both as they load)."""
    from transformers import AutoTokenizer


    theirs = AutoTokenizer.from_pretrained(str(teacher))
    if IM_END not in theirs.get_vocab():
        theirs.add_tokens([IM_START, IM_END], special_tokens=True)
    if theirs.get_vocab() != tokenizer.get_vocab():
        differ = len(set(theirs.get_vocab().items()) ^ set(tokenizer.get_vocab().items()))
        raise ValueError(f"{step}: the teacher {teacher} has another vocabulary than the student ({len(theirs)} vs "
                         f"{len(tokenizer)} tokens, {differ} entries differ); distil from a model with the "
                         "student's tokenizer, or build preference pairs from it instead (pairs: strong_vs_weak)")


def keep_layers(model, keep: int) -> list[int]:
    """Shrink a decoder in place to `keep` of its layers, evenly spaced, first and last included; per-layer
    config lists (RoPE/NoPE pattern, layer types) follow. Returns the kept layer indices."""
    import torch

    layers = model.model.layers
    total = len(layers)
    kept = [0] if keep == 1 else sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})
    model.model.layers = torch.nn.ModuleList([layers[i] for i in kept])
    for new_index, layer in enumerate(model.model.layers):
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_index  # the KV cache is indexed by position in the stack
    config = model.config
    for name, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == total and name != "architectures":
            setattr(config, name, [value[i] for i in kept])
    config.num_hidden_layers = len(kept)
    return kept


ROWS: dict[type, Callable[..., tuple[list[dict[str, Any]], dict[str, Any]]]] = {
    Sft: sft_rows, Preference: preference_rows, Grpo: grpo_rows, Distillation: distill_rows}  # by section model


def _required(artifact: InputArtifact | None, role: str, ctx: StepContext) -> InputArtifact:
    """An input the step's method needs (the pairs' answerers, the teacher) that its builder gives it."""
    if artifact is None:
        raise ValueError(f"post_training {ctx.name}: the plan gave no {role} model to a {ctx.config.method} step")
    return artifact


def _fenced_rows(fence: InputArtifact, rows: list[dict[str, Any]], problems: bool
                 ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The rows that match no benchmark item of the fence (GRPO's problems compared item for item), and how many
    each benchmark took out: prompts, references and generated answers alike."""
    from compass.tasks.data.decontamination import Fence, Matcher

    matcher = Matcher(Fence.read(fence.local() / INDEX_FOLDER))
    kept, removed = [], {}
    for row in rows:
        hit = matcher.match_problem(row["question"]) if problems else matcher.match(row_text(row))
        if hit is None:
            kept.append(row)
        else:
            removed[hit.benchmark] = removed.get(hit.benchmark, 0) + 1
    return kept, removed


def row_text(value: Any) -> str:
    """Every message's content in a row (conversations, pairs), one per line: what the fence matches."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return "\n".join(row_text(v) for k, v in value.items() if k != "role")
    if isinstance(value, list):
        return "\n".join(row_text(v) for v in value)
    return value if isinstance(value, str) else ""


def run_post_train(ctx: StepContext[PostTrainConfig]) -> StepResult:
    """Build the method's rows here (conversations, pairs, problems), train on the step's ranks (this process for
    one, torchrun or srun for several; resuming from the newest complete checkpoint of an earlier attempt), then
    export the weights with the tokenizer, continue the metrics history and answer the vibe prompts."""
    from compass.tasks.post_training.trl_ranks import prepared_by_rank, train, write_rows

    started = time.time()  # one rank trains in this process: its attempt starts with the step
    cfg = ctx.config
    method, record = cfg.method, method_of(cfg)
    given = ctx.given(PostTrainInputs)
    previous = ModelArtifact(given.previous.local(*CONTINUED_PARTS))
    out = ModelArtifact(ctx.out)
    work = WorkFolder(ctx.workdir)
    work.root.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_chat_model(previous.final)
    rows, facts = ROWS[record.section](ctx, model, tokenizer)
    if given.fence is not None:  # `remove`: what matches a benchmark evaluated is left out, and said
        rows, facts["decontaminated"] = _fenced_rows(given.fence, rows, problems=isinstance(cfg, Grpo))
    if not rows:  # TRL would stop at its first batch with a bare StopIteration, and the step be retried
        shapes = PAIR_SHAPES if record.paired else CONVERSATION_SHAPES
        raise DataError(f"post_training {ctx.name}: {cfg.dataset} gives no example to train on: its JSONL lines "
                        f"are read in the shapes {shapes}")
    where = device_for(ctx.runtime.how)
    shape = ctx.runtime.placement.shape
    world = shape.ranks if shape else 1
    job = TrlJob(step=f"{ctx.kind}:{ctx.name}", section=cfg.model_dump(exclude={"seed", "vibe_prompts"}),
                 seed=cfg.seed, how=ctx.runtime.how, work=work.root, world=world, device=where.device, bf16=where.bf16,
                 teacher=ModelArtifact(given.teacher.local()).final if given.teacher is not None else None,
                 tensorboard=_tensorboard_run(ctx), trackers=tracker_run_of(ctx), prometheus=_endpoint(ctx))
    if cfg.peft is not None or world > 1:  # the ranks' start (and the base an adapter merges into)
        model.save_pretrained(str(work.trl_start), safe_serialization=True)
        tokenizer.save_pretrained(str(work.trl_start))
    work.trl_result.unlink(missing_ok=True)
    shutil.rmtree(work.trl_prepared, ignore_errors=True)  # what this attempt's ranks prepare
    write_rows(work.trl_rows, rows)  # the ranks' on-disk dataset (trl_ranks.rows_dataset)
    if world == 1:
        trainer, result = train(job, model, tokenizer, rows, started)
        trained = None if cfg.peft is not None else trainer.model
        del trainer
    else:
        trained = None
        job.write(work.trl_job)
        from compass.tasks.common.training import run_module_ranks

        run_module_ranks(TRL_RANKS_MODULE, work.trl_job, world, shape, ctx.runtime, ctx.log)
        from compass.tasks.post_training.trl_checkpoints import newest_complete  # (imports transformers)

        if not work.trl_result.exists() and work.stop_file.exists() and newest_complete(work.trl_checkpoints):
            raise StopRequested(int(newest_complete(work.trl_checkpoints).name.rsplit("-", 1)[1]))  # requeued
        result = TrlResult.read(work.trl_result)
    del model
    facts |= {k: v for k, v in result.facts.items() if k != "sft_samples"}
    facts["rows_prepared"] = prepared_by_rank(work)  # by rank: datasets' maps computed here, or loaded
    if samples := result.facts.get("sft_samples"):  # what SFT trained on, to compare with the template
        with open(out.sft_samples, "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
    exported = _export(ctx, work, out, cfg.peft is not None, trained)
    tokenizer.save_pretrained(str(out.final))
    before = tokens_seen(previous.root) or 0
    logs = [h for h in result.log_history if "loss" in h]
    metric_rows = [MetricsRow(step=i + 1, stage=ctx.name, stage_step=h.get("step", i + 1), loss=h["loss"],
                              tokens=before + int(h.get("num_input_tokens_seen", h.get("num_tokens", 0))),
                              method=method)  # GRPO logs its count as num_tokens
                   for i, h in enumerate(logs)]
    write_metrics(out.metrics, read_metrics(previous.metrics) + metric_rows)
    plot_loss(out.metrics, out.loss_plot, f"{ctx.name} ({method}): loss over all stages so far")
    vibe = _vibe_check(ctx, exported, tokenizer)
    if isinstance(cfg, Grpo):
        facts |= _reward_facts([h["reward"] for h in result.log_history if "reward" in h], ctx)
    metrics = {"method": method, "steps": result.global_step, "first_loss": logs[0]["loss"] if logs else None,
               "final_loss": logs[-1]["loss"] if logs else None,
               "tokens": metric_rows[-1].tokens - before if metric_rows else 0, "ranks": world,
               "resumed_from_step": result.resumed_from, "setup": setup_of(ctx.runtime.how), **facts,
               "goodput": result.goodput.model_dump(mode="json") if result.goodput else None}
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
                      if k not in ("setup", "goodput", "rows_prepared"))
    summary = (f"### {method} `{ctx.name}`\n\n{shown}" + (f"; {result.goodput.line()}" if result.goodput else "")
               + (f"\n\n{vibe}" if vibe else ""))
    table = [{"step": r.stage_step, "loss": round(r.loss, 4)} for r in metric_rows[:: max(1, len(metric_rows) // 20)]]
    return StepResult(metrics=metrics, summary=summary, tables={"loss": table, **goodput_table(result.goodput)})


TRL_RANKS_MODULE = "compass.tasks.post_training.trl_ranks"


def _reward_facts(rewards: list[float], ctx: StepContext[PostTrainConfig]) -> dict[str, Any]:
    """GRPO's rewards, first, last and best: a run whose verifier never rewarded a completion (every mean reward 0,
    or below it from the length penalty alone) learnt nothing of the task, which a final reward of 0 alone does not
    tell (said in the metrics and the log)."""
    facts: dict[str, Any] = {"first_reward": rewards[0] if rewards else None,
                             "final_reward": rewards[-1] if rewards else None,
                             "max_reward": max(rewards) if rewards else None}
    if not rewards or max(rewards) <= 0:  # at best 0, or only the length penalty's negative rewards
        facts["learnt_nothing"] = (f"no completion was ever rewarded ({len(rewards)} logged steps, the best mean "
                                   f"reward {max(rewards, default=0):.3g}): GRPO had no signal from its verifier; "
                                   "start from a model that solves some problems (SFT on the task first), or "
                                   "sample more completions per prompt")
        ctx.log.warning("post_train %s: %s", ctx.name, facts["learnt_nothing"])
    return facts


def _export(ctx: StepContext[PostTrainConfig], work: WorkFolder, out: ModelArtifact, lora: bool,
            trained: Any = None) -> Any:
    """The trained weights as the artifact's Hugging Face folder: `trained` (one rank trained here), the weights
    rank 0 saved, or with LoRA the adapter merged into the start model (the adapter kept beside it). Non-finite
    weights fail the step before anything is committed."""
    import torch
    from transformers import AutoModelForCausalLM

    if lora:

        exported = export_merged(work.trl_final, work.trl_start, out.final, out.adapter)
    elif trained is not None:
        exported = trained
    else:
        exported = AutoModelForCausalLM.from_pretrained(str(work.trl_final), dtype=torch.float32)
    broken = [n for n, p in exported.named_parameters() if not p.detach().isfinite().all()]
    if broken:
        raise FloatingPointError(f"post_training {ctx.name}: {ctx.config.method} left non-finite weights ({broken[0]} "
                                 f"and {len(broken) - 1} more); lower lr or check the data; nothing was committed")
    exported.config.use_cache = False
    exported.save_pretrained(str(out.final), safe_serialization=True)
    return exported


def _vibe_check(ctx: StepContext[TrlConfig], model, tokenizer) -> str:
    """Fixed prompts answered by this checkpoint, kept in the artifact and shown as markdown."""
    prompts = ctx.config.vibe_prompts
    if not prompts:
        return ""
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    if system := _system_prompt(ctx.config):
        conversations = [[{"role": "system", "content": system}, *c] for c in conversations]
    modes = [""]
    if "/no_think" in (tokenizer.chat_template or ""):  # a hybrid reasoner answers every prompt in both modes

        modes = [THINK, NO_THINK]
    asked = [(p, mode, with_mode(c, mode) if mode else c) for mode in modes for p, c in zip(prompts, conversations,
                                                                                            strict=True)]

    model = on_device(model, device_for(ctx.runtime.how))  # generate on the step's GPU when it has one
    answers = generate(model, tokenizer, [c for _, _, c in asked], max_new_tokens=48)
    text = "#### vibe check\n\n" + "\n\n".join(f"**{p}**{f' ({mode})' if mode else ''}\n\n> {a or '(empty)'}"
                                                 for (p, mode, _), a in zip(asked, answers, strict=True))
    out = ModelArtifact(ctx.out)
    out.vibe_check.write_text(text + "\n")
    out.vibe_answers.write_text(json.dumps([{"prompt": p, "mode": mode or None, "answer": a}
                                                         for (p, mode, _), a in zip(asked, answers, strict=True)],
                                                        indent=1))
    return text


def check_machine(spec: TrainingSpec, base_dir: Path) -> Iterator[Issue]:
    """Each local dataset of a TRL step holds the conversations (or preference pairs) the step reads, before any
    step runs: a wrong path or a line shape compass does not read used to fail the step after every earlier one.
    Packaged and S3 datasets are fetched when their step runs, and checked there."""
    for i, step in enumerate(spec.what.post_training):
        if isinstance(step, Sft | Distillation) or (isinstance(step, Preference) and
                                                    (step.pairs is None or step.pairs.kind == "strong_vs_weak")):
            pairs = isinstance(step, Preference) and step.pairs is None
            uri = parse_source_uri(step.dataset)
            if uri.scheme != "file":
                continue
            problem = dataset_problem((base_dir / uri.path).expanduser(), pairs, step.max_samples or 1)
            if problem:
                yield Issue(("what", "post_training", i, "dataset"), problem,
                            f"{step.method} reads JSONL lines shaped {PAIR_SHAPES if pairs else CONVERSATION_SHAPES}")


# 4: a loss plot in every post-training artifact
KIND = StepKind("post_train", PostTrainConfig, run_post_train, build, version="4",
                resources=phase("post_training"), trains=True, reads_how=TRL_HOW,
                imports=TRANSFORMERS, check_machine=check_machine, inputs=PostTrainInputs,
                after=("mid_training", "tokenizer", "base_model", "model"), after_models=True,
                evaluated=True, advances_model=True,
                headline=("final_loss", "final_reward", "tokens"))
STEP_KINDS = (KIND,)
