"""Post-training steps with TRL: SFT (assistant-only loss), preference optimisation (DPO and its loss types,
ORPO, KTO) on pairs the pipeline builds, RL with verifiable rewards (GRPO) and on-policy distillation (GKD).

Each step starts from the previous model step's final weights, exports a Hugging Face folder with its
tokenizer and chat template, continues the metrics history (tokens keep counting), and answers the spec's
vibe-check prompts so a person can read them in the UI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from compass.tasks.base import StepContext, StepResult
from compass.tasks.chat import generate, load_chat_model
from compass.tasks.post_data import (
    arithmetic_problems,
    arithmetic_reward,
    chat_examples,
    dataset_root,
    exact_answer_reward,
    length_penalty,
)

MAX_CHARS_PER_TOKEN = 3  # conversations longer than max_length * this many characters are left out


def _common_args(ctx: StepContext, tokens: bool = True) -> dict[str, Any]:
    cfg = ctx.config
    args = dict(output_dir=str(ctx.scratch / "trainer"), learning_rate=cfg["lr"], num_train_epochs=cfg["epochs"],
                per_device_train_batch_size=cfg["batch_size"], use_cpu=True, bf16=False, report_to="none",
                save_strategy="no", logging_steps=1, seed=cfg.get("seed", 0), disable_tqdm=True,
                lr_scheduler_type="linear", warmup_steps=0)
    if tokens:
        args["include_num_input_tokens_seen"] = "all"
    return args


def _conversations(ctx: StepContext, seed: int, limit: int | None) -> list[list[dict[str, str]]]:
    cfg = ctx.config
    root, _ = dataset_root(cfg["dataset"], ctx.runtime.base_dir)
    return chat_examples(root, limit, seed, cfg["max_length"] * MAX_CHARS_PER_TOKEN, cfg.get("system_prompt"))


def run_sft(ctx: StepContext, model, tokenizer) -> tuple[Any, dict[str, Any]]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg = ctx.config
    data = Dataset.from_list([{"messages": m} for m in _conversations(ctx, seed=0, limit=cfg["max_samples"])])
    args = SFTConfig(**_common_args(ctx), max_length=cfg["max_length"], packing=cfg["packing"],
                     assistant_only_loss=cfg["assistant_only_loss"], dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    return trainer, {"examples": len(data)}


PAIR_SEED = 17
PAIR_TOKENS = 48


def answer_prompts(model_dir: Path, prompts: list[list[dict[str, str]]]) -> list[str]:
    """One checkpoint's sampled answers to the preference prompts (seeded: the same answers every time)."""
    model, tokenizer = load_chat_model(model_dir)
    return generate(model, tokenizer, prompts, max_new_tokens=PAIR_TOKENS, seed=PAIR_SEED)


def fitting_prompts(prompts: list[list[dict[str, str]]], tokenizer, budget: int) -> list[list[dict[str, str]]]:
    """Prompts short enough to leave room for an answer within max_length: a truncated pair has no completion
    tokens left, and the preference losses turn into NaN."""
    return [p for p in prompts
            if len(tokenizer(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]) <= budget]


def preference_pairs(ctx: StepContext, tokenizer) -> list[dict[str, Any]]:
    """Strong-versus-weak pairs: held-back prompts answered by the strong and the weak checkpoint of this
    run; chosen = strong, rejected = weak. Pairs with identical answers, or an empty one (no completion tokens:
the preference losses would divide by zero), are dropped."""
    cfg = ctx.config
    conversations = _conversations(ctx, seed=1, limit=cfg["max_samples"])
    prompts = fitting_prompts([c[:-1] for c in conversations], tokenizer, cfg["max_length"] - PAIR_TOKENS)
    answers = {role: answer_prompts(ctx.inputs[role].local() / "final", prompts) for role in ("strong", "weak")}
    return [{"prompt": p, "chosen": [{"role": "assistant", "content": s}],
             "rejected": [{"role": "assistant", "content": w}]}
            for p, s, w in zip(prompts, answers["strong"], answers["weak"], strict=True) if s and w and s != w]


def build_pairs(ctx: StepContext, tokenizer) -> list[dict[str, Any]]:
    """The step's preference pairs: from the dataset, strong versus weak, or graded on-policy samples."""
    from compass.tasks.pairs import dataset_pairs, on_policy_pairs

    cfg = ctx.config
    kind = (cfg.get("pairs") or {}).get("kind")
    if kind == "strong_vs_weak":
        pairs = preference_pairs(ctx, tokenizer)
        why = "the strong and weak checkpoints answered every prompt identically; pick checkpoints further apart"
    elif kind == "verifier":
        root, _ = dataset_root(cfg["dataset"], ctx.runtime.base_dir)
        problems = arithmetic_problems(root, None, seed=0)
        if cfg["pairs"].get("easiest_first"):
            problems.sort(key=lambda p: (len(p["answer"].lstrip("-")), len(p["question"])))  # stable: seeded order
        problems = problems[:cfg["max_samples"]] if cfg["max_samples"] else problems
        pairs = on_policy_pairs(ctx.inputs["previous"].local() / "final", problems,
                                cfg["pairs"]["samples_per_prompt"], cfg["pairs"]["verifier"], 32, PAIR_SEED)
        why = (f"no problem got both a right and a wrong answer among {cfg['pairs']['samples_per_prompt']} "
               "samples; sample more per prompt, or start from a stronger checkpoint")
    else:
        root, _ = dataset_root(cfg["dataset"], ctx.runtime.base_dir)
        pairs = dataset_pairs(root, cfg["max_samples"])
        why = (f"{cfg['dataset']} has no JSONL lines with prompt, chosen and rejected; name a pairs dataset or "
               "set pairs: {kind: strong_vs_weak, ...} or {kind: verifier}")
    if not pairs:
        raise ValueError(f"post_training {ctx.name}: no preference pairs: {why}")
    return pairs


def run_preference(ctx: StepContext, model, tokenizer) -> tuple[Any, dict[str, Any]]:
    from datasets import Dataset

    cfg = ctx.config
    pairs = build_pairs(ctx, tokenizer)
    with open(ctx.out / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)
    common = _common_args(ctx)
    if cfg["method"] == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, loss_type=cfg["loss_type"], beta=cfg["beta"], max_length=cfg["max_length"])
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                             processing_class=tokenizer)
    elif cfg["method"] == "orpo":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(**common, beta=cfg["beta"], max_length=cfg["max_length"])
        trainer = ORPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                              processing_class=tokenizer)
    else:  # kto: unpaired, chosen answers desirable and rejected ones not
        from trl import KTOConfig, KTOTrainer

        rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                for p in pairs for side in ("chosen", "rejected")]
        args = KTOConfig(**common, beta=cfg["beta"], max_length=cfg["max_length"])
        trainer = KTOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer)
    trainer.train()
    return trainer, {"pairs": len(pairs)}


def reward_functions(verifier: str, tokenizer, per_token: float, target: int | None) -> list:
    """GRPO rewards: the verifier's 0/1 correctness, plus the overlong penalty when the spec asks for one."""

    def correct(completions, question, answer, **_: Any) -> list[float]:
        texts = [_text(c) for c in completions]
        if verifier == "arithmetic":
            return [arithmetic_reward(q, t) for q, t in zip(question, texts, strict=True)]
        return [exact_answer_reward(a, t) for a, t in zip(answer, texts, strict=True)]

    def overlong(completions, **_: Any) -> list[float]:
        return [length_penalty(len(tokenizer.encode(_text(c), add_special_tokens=False)), target, per_token)
                for c in completions]

    return [correct, overlong] if per_token else [correct]


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def run_grpo(ctx: StepContext, model, tokenizer) -> tuple[Any, dict[str, Any]]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    cfg = ctx.config
    root, _ = dataset_root(cfg["dataset"], ctx.runtime.base_dir)
    problems = arithmetic_problems(root, cfg["max_samples"], seed=0)
    if not problems:
        raise ValueError(f"post_training {ctx.name}: no problems with checkable answers in {cfg['dataset']}")
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p["question"]}], **p} for p in problems])
    groups = cfg["num_generations"]
    batch = max(groups, cfg["batch_size"] // groups * groups)
    args = GRPOConfig(**{**_common_args(ctx, tokens=False), "per_device_train_batch_size": batch},
                      num_generations=groups, max_completion_length=cfg["max_completion_length"], use_vllm=False,
                      log_completions=False)
    rewards = reward_functions(cfg["verifier"], tokenizer, cfg["length_penalty"], cfg.get("target_length"))
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=data,
                          processing_class=tokenizer)
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    return trainer, {"problems": len(problems), "first_reward": history[0]["reward"] if history else None,
                     "final_reward": history[-1]["reward"] if history else None}


def run_distill(ctx: StepContext, model, tokenizer) -> tuple[Any, dict[str, Any]]:
    from datasets import Dataset

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    cfg = ctx.config
    teacher, _ = load_chat_model(ctx.inputs["teacher"].local() / "final")
    if cfg.get("student_layers"):
        kept = keep_layers(model, cfg["student_layers"])
        ctx.log.info("distill %s: student keeps layers %s of %d", ctx.name, kept, teacher.config.num_hidden_layers)
    data = Dataset.from_list([{"messages": m} for m in _conversations(ctx, seed=2, limit=cfg["max_samples"])])
    args = GKDConfig(**_common_args(ctx), lmbda=cfg["lmbda"], max_length=cfg["max_length"], dataset_num_proc=None)
    trainer = GKDTrainer(model=model, teacher_model=teacher, args=args, train_dataset=data,
                         processing_class=tokenizer)
    trainer.train()
    return trainer, {"examples": len(data), "teacher_layers": teacher.config.num_hidden_layers,
                     "student_layers": model.config.num_hidden_layers,
                     "student_parameters": sum(p.numel() for p in model.parameters()),
                     "teacher_parameters": sum(p.numel() for p in teacher.parameters())}


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


METHODS = {"sft": run_sft, "dpo": run_preference, "orpo": run_preference, "kto": run_preference,
           "grpo": run_grpo, "distill": run_distill}


def run_post_train(ctx: StepContext) -> StepResult:
    from compass.tasks.evaluate import tokens_seen

    cfg = ctx.config
    method = cfg["method"]
    if method == "mid_training":
        from compass.tasks.mid_training import run_mid_training

        return run_mid_training(ctx)
    if method not in METHODS:
        raise NotImplementedError(f"post-training method '{method}' is not executed by this version; "
                                  f"available: {', '.join(sorted(METHODS))}")
    previous = ctx.inputs["previous"].local()
    model, tokenizer = load_chat_model(previous / "final")
    trainer, facts = METHODS[method](ctx, model, tokenizer)
    broken = [n for n, p in trainer.model.named_parameters() if not p.detach().isfinite().all()]
    if broken:
        raise FloatingPointError(f"post_training {ctx.name}: {method} left non-finite weights ({broken[0]} and "
                                 f"{len(broken) - 1} more); lower lr or check the data; nothing was committed")
    final = ctx.out / "final"
    trainer.model.config.use_cache = False
    trainer.model.save_pretrained(str(final), safe_serialization=True)
    tokenizer.save_pretrained(str(final))
    before = tokens_seen(previous) or 0
    history = (previous / "metrics.jsonl").read_text() if (previous / "metrics.jsonl").exists() else ""
    logs = [h for h in trainer.state.log_history if "loss" in h]
    rows = [{"step": i + 1, "stage": ctx.name, "stage_step": h.get("step", i + 1), "loss": h["loss"],
             "tokens": before + int(h.get("num_input_tokens_seen", 0)), "method": method}
            for i, h in enumerate(logs)]
    (ctx.out / "metrics.jsonl").write_text(history + "".join(json.dumps(r) + "\n" for r in rows))
    vibe = _vibe_check(ctx, trainer.model, tokenizer)
    shutil.rmtree(ctx.scratch / "trainer", ignore_errors=True)
    metrics = {"method": method, "steps": trainer.state.global_step, "first_loss": logs[0]["loss"] if logs else None,
               "final_loss": logs[-1]["loss"] if logs else None, "tokens": rows[-1]["tokens"] - before if rows else 0,
               **facts}
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
    summary = f"### {method} `{ctx.name}`\n\n{shown}" + (f"\n\n{vibe}" if vibe else "")
    table = [{"step": r["stage_step"], "loss": round(r["loss"], 4)} for r in rows[:: max(1, len(rows) // 20)]]
    return StepResult(metrics=metrics, summary=summary, tables={"loss": table})


def _vibe_check(ctx: StepContext, model, tokenizer) -> str:
    """Fixed prompts answered by this checkpoint, kept in the artifact and shown as markdown."""
    prompts = ctx.config.get("vibe_prompts") or []
    if not prompts:
        return ""
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    if ctx.config.get("system_prompt"):
        conversations = [[{"role": "system", "content": ctx.config["system_prompt"]}, *c] for c in conversations]
    answers = generate(model, tokenizer, conversations, max_new_tokens=48)
    text = "#### vibe check\n\n" + "\n\n".join(f"**{p}**\n\n> {a or '(empty)'}" for p, a in zip(prompts, answers,
                                                                                                strict=True))
    (ctx.out / "vibe_check.md").write_text(text + "\n")
    (ctx.out / "vibe_check.json").write_text(json.dumps([{"prompt": p, "answer": a}
                                                         for p, a in zip(prompts, answers, strict=True)], indent=1))
    return text
