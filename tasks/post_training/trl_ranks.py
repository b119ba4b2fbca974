"""Every rank of a TRL step: the start model, the step's rows, the TRL trainer of its method (its record in
specs/post_training_methods.py names TRL's classes), checkpoints at the spec's cadence and resume from the newest
complete one. One rank runs `train` in the step's process; several are
started with `python -m compass.tasks.post_training.trl_ranks JOB` under torchrun or srun, and accelerate (inside
the Trainer) joins them in one data-parallel group: gloo on CPU, NCCL on GPUs."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from compass.infra.die_with_parent import die_with_parent
from compass.infra.disk_full import full_disk_met, note_full_disk
from compass.infra.environment import prepare_environment
from compass.infra.errors import StopRequested
from compass.infra.exits import broken_collective, failed_device
from compass.infra.layout import WorkFolder
from compass.model import attention
from compass.model.training.goodput import process_start
from compass.specs.post_training import Distillation, Grpo, Preference, Sft
from compass.specs.post_training_methods import PostTrainingMethod, method_of
from compass.tasks.common.arithmetic import arithmetic_reward, exact_answer_reward, length_penalty
from compass.tasks.common.devices import Device, hf_attention, require_vllm
from compass.tasks.post_training.adapters import with_adapters
from compass.tasks.post_training.chat import load_chat_model
from compass.tasks.post_training.reasoning import system_prompts_kept, trained_rows
from compass.tasks.post_training.trl_checkpoints import CompleteCheckpoints, StopAndSave, newest_complete
from compass.tasks.post_training.trl_goodput import TrlGoodput
from compass.tasks.post_training.trl_job import TrlJob, TrlResult
from compass.tasks.post_training.trl_prometheus import TrlPrometheus
from compass.tasks.post_training.trl_trackers import tracker_callback

Rows = list[dict[str, Any]]  # a step's training rows: conversations, pairs or prompts
SFT_SAMPLES = 8  # rows of what SFT trained on, kept with the artifact to compare with the template


def read_rows(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def write_rows(path: Path, rows: Rows) -> None:
    """The step's rows for its ranks, one JSON line each; a file already holding them is left as it is, so that an
    attempt after a requeue finds the rows it prepared before (the datasets cache is keyed by the file's time)."""
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    if path.is_file() and path.stat().st_size == len(body) and path.read_bytes() == body:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(body)
    tmp.replace(path)


def rows_dataset(job: TrlJob, rows: Rows) -> Any:
    """The step's rows as an on-disk dataset: Arrow files in the work folder that every rank memory-maps, with
    TRL's tokenized and packed forms of them cached beside them. TRL prepares a dataset in the global main process
    first, then in the others (trl.trainer.utils.global_then_local_main_first); on disk, the others load what it
    cached, so the rows are tokenized and packed once per step instead of once per rank (a 64k-token SFT set on
    each of 8 ranks, one core each), and an attempt after a requeue loads them again. Loaded main process first
    too: the ranks must not build the same Arrow files at once. `rows` are the file's (written where it holds
    others: a trainer built in this process, by the step or a test)."""
    from datasets import load_dataset
    from trl.trainer.utils import global_then_local_main_first

    work = WorkFolder(job.work)
    with global_then_local_main_first():
        work.root.mkdir(parents=True, exist_ok=True)
        write_rows(work.trl_rows, rows)
        return load_dataset("json", data_files=str(work.trl_rows), split="train", cache_dir=str(work.trl_datasets))


class PreparedCount(logging.Handler):
    """What the datasets library says while a rank prepares its dataset: each map's result computed (and cached)
    here, or loaded as another process cached it."""

    LOGGER = "datasets.arrow_dataset"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.computed = self.loaded = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Caching processed dataset"):
            self.computed += 1
        elif message.startswith("Loading cached processed dataset"):
            self.loaded += 1

    @contextmanager
    def counting(self) -> Iterator[PreparedCount]:
        logger = logging.getLogger(self.LOGGER)
        level, propagate = logger.level, logger.propagate
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # counted, not printed
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)
            logger.propagate = propagate

    def write(self, work: WorkFolder, rank: int) -> None:
        work.trl_prepared.mkdir(parents=True, exist_ok=True)
        (work.trl_prepared / f"rank-{rank}.json").write_text(json.dumps({"computed": self.computed,
                                                                          "loaded": self.loaded}))


def prepared_by_rank(work: WorkFolder) -> dict[str, dict[str, int]]:
    """Each rank's PreparedCount of this attempt, by rank."""
    folder = work.trl_prepared
    return {p.stem.removeprefix("rank-"): json.loads(p.read_text())
            for p in sorted(folder.glob("rank-*.json"))} if folder.is_dir() else {}


def common_args(job: TrlJob, tokens: bool = True) -> dict[str, Any]:
    """TrainingArguments every method shares. `batch_size` is the global batch: each rank takes its share, in passes
    of `micro_batch_size` rows that accumulate."""
    section, how = job.section, job.how
    share = per_rank_batch(section.batch_size, job.world)
    micro = min(section.micro_batch_size or share, share)
    args = dict(output_dir=str(WorkFolder(job.work).trl_checkpoints), learning_rate=section.lr,
                num_train_epochs=section.epochs, per_device_train_batch_size=micro,
                gradient_accumulation_steps=share // micro,
                use_cpu=job.device == "cpu", bf16=job.bf16, report_to="none", save_strategy="steps",
                save_steps=how.checkpoints.every_steps, save_total_limit=None, logging_steps=1, seed=job.seed,
                disable_tqdm=True, lr_scheduler_type="linear", warmup_steps=0,
                activation_checkpointing=how.parallelism.activation_checkpointing,
                use_liger_kernel=uses_liger(how, job.device), torch_compile=how.compile)
    if job.world > 1:  # one rank opens no group (a backend named here would make accelerate look for one)
        args["ddp_backend"] = "nccl" if job.device == "cuda" else "gloo"
        if zero := zero_stage(how, job.world):
            args["deepspeed"] = deepspeed_config(zero, "bf16" if job.bf16 else "fp32", how.reduce_precision)
            if job.device == "cpu":
                from compass.model.training.engines import keep_deepspeed_off_the_cpu_shm_op

                keep_deepspeed_off_the_cpu_shm_op()  # its JIT build's lock, left by a killed rank, hangs later starts
    if tokens:
        args["include_num_input_tokens_seen"] = "non_padding"  # tokens trained on: the same on any number of ranks
    return args


def zero_stage(how: Any, world: int) -> int:
    """The ZeRO stage a TRL step's ranks shard with: the spec's, through DeepSpeed (0: plain data parallel; one
    rank has nothing to shard)."""
    par = how.parallelism
    return par.zero_stage if par.deepspeed and world > 1 else 0


def deepspeed_config(stage: int, precision: str = "fp32", reduce_precision: str = "fp32") -> dict[str, Any]:
    """DeepSpeed's config for the HF Trainer inside TRL: ZeRO at `stage`; batch sizes, clipping and precision
    filled in by the Trainer from the TrainingArguments ("auto"), and the Trainer's own AdamW and schedule kept, so
    the curve is the one of plain data parallel. At stage 3 the weights are gathered for the final save. Gradients
    of bf16 training are summed and reduced in how.reduce_precision, as compass's own trainer does."""
    from compass.model.training.engines import gradient_dtypes

    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_allow_untested_optimizer": True, **gradient_dtypes(precision, reduce_precision, stage)}


def uses_liger(how: Any, device: str) -> bool:
    """Liger's fused kernels when the spec names them, or with `auto` on a GPU where Liger is installed (as the
    pretraining loss picks them). A GPU spec's rank on the CPU (a rehearsal on CPU ranks) takes TRL's own loss, as
    the trainer takes the chunked one: Liger's kernels need CUDA."""

    if how.loss == "liger":
        if device != "cuda":
            print("loss liger -> TRL's own loss on this CPU rank (Liger's fused kernels need CUDA)", file=sys.stderr)
        return device == "cuda"
    return how.loss == "auto" and device == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def per_rank_batch(batch_size: int, world: int) -> int:
    """Each rank's share of the global batch (validation refuses a batch the ranks cannot split evenly)."""
    return max(1, batch_size // world)


def _callbacks(job: TrlJob, ledger: TrlGoodput) -> list[Any]:
    # the ledger after CompleteCheckpoints: its barriers are part of the checkpoint's time
    stop_file = os.environ.get("COMPASS_STOP_FILE")  # under Slurm: touched near the time limit (infra/slurm.py)
    minutes = job.how.checkpoints.every_minutes
    out: list[Any] = [StopAndSave(Path(stop_file) if stop_file else None, minutes * 60 if minutes else None),
                      CompleteCheckpoints(WorkFolder(job.work).trl_checkpoints, job.how.checkpoints.keep_last), ledger]
    if job.tensorboard is not None and _rank() == 0:
        from torch.utils.tensorboard import SummaryWriter
        from transformers.integrations import TensorBoardCallback

        out.append(TensorBoardCallback(SummaryWriter(str(job.tensorboard))))
    if job.trackers is not None and _rank() == 0:

        out.append(tracker_callback(job.trackers))
    if job.prometheus is not None:  # after the ledger: the goodput it serves includes this step
        out.append(TrlPrometheus(job.prometheus, ledger, cuda=job.device == "cuda"))
    return out


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def trl_classes(method: PostTrainingMethod) -> tuple[type, type]:
    """TRL's config and trainer classes a method's record names (`module:Class`)."""
    if method.trl_trainer.startswith("trl.experimental"):
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns on importing its experimental trainers
    return _imported(method.trl_config), _imported(method.trl_trainer)


def _imported(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def packed_attention(job: TrlJob, model: Any) -> str:
    """The attention of packed SFT rows: compass's document attention, as pretraining's (model/attention.py: flash
    or torch's varlen kernels on CUDA, per-document SDPA elsewhere), which keeps each conversation to itself from
    the position ids and cumulative lengths TRL's padding-free collator passes. transformers' own SDPA builds a
    dense [L, L] mask from them on every call (4-8 GiB at 64k tokens), which the memory estimate would have to
    hold."""
    attention.register()
    dropout = bool(getattr(model.config, "attention_dropout", 0.0))
    return attention.implementation(job.how.attention, job.device == "cuda", dropout=dropout)


def sft_trainer(job: TrlJob, model: Any, tokenizer: Any, rows: Rows, ledger: TrlGoodput) -> tuple[Any, dict]:
    section: Sft = job.section
    config, trainer_class = trl_classes(method_of(section))
    if section.packing:  # (a LoRA model's base holds the attention)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.set_attn_implementation(packed_attention(job, base))
    args = config(**common_args(job), max_length=section.max_length, packing=section.packing,
                  assistant_only_loss=section.assistant_only_loss, dataset_num_proc=None)
    trainer = trainer_class(model=model, args=args, train_dataset=rows_dataset(job, rows), processing_class=tokenizer,
                            callbacks=_callbacks(job, ledger))
    facts: dict[str, Any] = {}
    if not section.packing:  # one row per conversation: the template's tokens, every system prompt in them

        conversations = [r["messages"] for r in rows]
        trained = trained_rows(conversations, [list(r) for r in trainer.train_dataset["input_ids"]], tokenizer)
        system_prompts_kept([c for c, _ in trained], [r for _, r in trained], tokenizer)
        facts["left_out_too_long"] = len(conversations) - len(trained)
        facts["sft_samples"] = [{"messages": c, "input_ids": r} for c, r in trained[:SFT_SAMPLES]]
    return trainer, facts


def preference_trainer(job: TrlJob, model: Any, tokenizer: Any, rows: Rows, ledger: TrlGoodput) -> tuple[Any, dict]:
    """The preference method's TRL trainer as its record says: its classes, the arguments it fixes and the fields of
    its own it reads, a frozen reference model only where it has one (what the planner counts), KTO's pairs split
    into a desirable and an undesirable completion."""
    from datasets import Dataset

    section: Preference = job.section
    method = method_of(section)
    config, trainer_class = trl_classes(method)
    own = {name: value for name in method.reads if (value := getattr(section, name)) is not None}
    args = config(**common_args(job), **method.fixed, **own, beta=section.beta, max_length=section.max_length)
    if method.splits_pairs:  # the chosen answers desirable, the rejected ones not
        rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                for p in rows for side in ("chosen", "rejected")]
    reference = {"ref_model": _reference(model)} if method.reference_model else {}
    dataset = Dataset.from_list(rows) if method.splits_pairs else rows_dataset(job, rows)
    trainer = trainer_class(model=model, **reference, args=args, train_dataset=dataset,
                            processing_class=tokenizer, callbacks=_callbacks(job, ledger))
    return trainer, {}


def _reference(model: Any) -> Any:
    """The frozen reference: the start model as this rank holds it. Left to itself TRL reloads it from the
    folder the model came from, which lacks the ChatML rows compass adds to a base's embeddings (a base from
    what.model going straight to DPO indexed past them); with adapters TRL disables them instead."""

    from peft import PeftModel

    return None if isinstance(model, PeftModel) else copy.deepcopy(model).eval()


def reward_functions(verifier: str, tokenizer: Any, per_token: float, target: int | None) -> list:
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


def grpo_trainer(job: TrlJob, model: Any, tokenizer: Any, rows: Rows, ledger: TrlGoodput) -> tuple[Any, dict]:
    from datasets import Dataset

    section: Grpo = job.section
    config, trainer_class = trl_classes(method_of(section))  # TRL's beta left at 0.0: no reference model
    groups = section.num_generations
    batch = max(groups, section.batch_size // groups * groups)  # whole groups of completions per optimizer step
    common = {**common_args(job, tokens=False), "per_device_train_batch_size": per_rank_batch(batch, job.world),
              "gradient_accumulation_steps": 1}
    vllm = job.how.generation == "vllm"
    if vllm:
        require_vllm(job.step)
    args = config(**common, num_generations=groups, max_completion_length=section.max_completion_length,
                  use_vllm=vllm, vllm_mode="colocate", log_completions=False)
    rewards = reward_functions(section.verifier, tokenizer, section.length_penalty, section.target_length)
    trainer = trainer_class(model=model, reward_funcs=rewards, args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=tokenizer, callbacks=_callbacks(job, ledger))
    return trainer, {}


def distill_trainer(job: TrlJob, model: Any, tokenizer: Any, rows: Rows, ledger: TrlGoodput) -> tuple[Any, dict]:
    from datasets import Dataset

    section: Distillation = job.section
    config, trainer_class = trl_classes(method_of(section))
    teacher, _ = load_chat_model(job.teacher)
    args = config(**common_args(job), lmbda=section.lmbda, max_length=section.max_length, dataset_num_proc=None)
    trainer = trainer_class(model=model, teacher_model=teacher, args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=tokenizer, callbacks=_callbacks(job, ledger))
    return trainer, {"teacher_layers": teacher.config.num_hidden_layers,
                     "teacher_parameters": sum(p.numel() for p in teacher.parameters())}


TrainerBuilder = Callable[[TrlJob, Any, Any, Rows, TrlGoodput], tuple[Any, dict]]
TRAINERS: dict[type, TrainerBuilder] = {Sft: sft_trainer, Preference: preference_trainer, Grpo: grpo_trainer,
                                        Distillation: distill_trainer}  # by the section model of a method's record


def build_trainer(job: TrlJob, model: Any, tokenizer: Any, rows: Rows, ledger: TrlGoodput) -> tuple[Any, dict]:
    """The TRL trainer of the job's method, and facts for the step's manifest."""
    return TRAINERS[method_of(job.section).section](job, model, tokenizer, rows, ledger)


def train(job: TrlJob, model: Any, tokenizer: Any, rows: Rows, started_at: float) -> tuple[Any, TrlResult]:
    """Train on this rank (resuming from the newest complete checkpoint of an earlier attempt); with several ranks or
    LoRA rank 0 saves the weights (the adapter) for the step to export; rank 0 writes the result, with where the
    step's time went since `started_at` (this attempt's start; trl_goodput.py). Returns (the trainer, the
    result)."""

    work = WorkFolder(job.work)
    if attention := hf_attention(job.how, job.device):
        model.set_attn_implementation(attention)
    if job.section.peft is not None:

        model = with_adapters(model, job.section.peft, work.trl_start, Device(job.device, job.bf16))
        trainable, total = model.get_nb_trainable_parameters()
        adapters = {"peft": job.section.peft.kind, "trainable_parameters": trainable, "total_parameters": total}
    else:
        adapters = {}
    rank = int(os.environ.get("RANK", "0"))
    ledger = TrlGoodput(work.goodput, started_at, rank)
    with PreparedCount().counting() as prepared:
        trainer, facts = build_trainer(job, model, tokenizer, rows, ledger)
    prepared.write(work, rank)
    facts |= adapters
    if not isinstance(job.section, Grpo):  # GRPO batches whole groups of completions itself
        # every step is the whole global batch on any number of ranks (a short last batch would be padded with
        # repeated rows across ranks), unless the data is shorter than one batch
        global_batch = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps * job.world
        trainer.args.dataloader_drop_last = len(trainer.train_dataset) >= global_batch
    resume = newest_complete(work.trl_checkpoints)
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        stopper = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StopAndSave))
        if stopper.stopped_at is not None:  # saved before the time limit: the requeued job resumes from it
            raise StopRequested(stopper.stopped_at)
    except StopRequested:
        raise
    except BaseException:
        ledger.failed()
        for callback in trainer.callback_handler.callbacks:  # the tracker runs end as failed, the endpoint goes
            if hasattr(callback, "close_trackers"):
                callback.close_trackers(failed=True)
            if isinstance(callback, TrlPrometheus):
                callback.close()
        raise
    if trainer.is_deepspeed_enabled:  # the stage and precision DeepSpeed's engine ran (what the spec asked, or not)
        engine = trainer.model_wrapped
        facts["zero_stage"] = engine.zero_optimization_stage()
        facts["engine_precision"] = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    facts["weights_dtype"] = str(next(trainer.model_wrapped.parameters()).dtype).removeprefix("torch.")
    if job.world > 1 or job.section.peft is not None:  # one full-weight rank: the step exports trainer.model
        trainer.save_model(str(work.trl_final))  # every rank calls it: DeepSpeed/FSDP gather the weights for rank 0
    result = TrlResult(log_history=trainer.state.log_history, global_step=trainer.state.global_step,
                       resumed_from=int(resume.name.split("-")[-1]) if resume else None, facts=facts,
                       goodput=ledger.finish())
    if trainer.is_world_process_zero():
        result.write(work.trl_result)
    return trainer, result


def _stop_requested(signum: int, frame: Any) -> None:
    StopAndSave.signalled = True


def main(job_path: str) -> int:
    """One TRL rank (`python -m compass.tasks.post_training.trl_ranks JOB.json`); its exit code: RETRIABLE_EXIT when
    a collective broke (a peer lost), so the step's Slurm job requeues itself as a trainer's does."""

    # torchrun starts ranks in sessions of their own: a killed launcher must not leave them training
    die_with_parent(never_a_child_of_init=True)
    prepare_environment()
    job = TrlJob.read(Path(job_path))
    work = WorkFolder(job.work)
    model, tokenizer = load_chat_model(work.trl_start)
    from compass.model.training import collectives

    signal.signal(signal.SIGUSR1, _stop_requested)
    try:
        train(job, model, tokenizer, read_rows(work.trl_rows), process_start())
    except StopRequested as stopped:  # no result: the step sees the stop and the job is requeued, resuming from it
        print(f"{job.step}: {stopped}", file=sys.stderr)
        collectives.leave()
        return 0
    except Exception as failed:  # a full disk named for the step that launched the ranks (infra/disk_full.py)
        if collectives.broke_a_collective(failed):  # a peer lost or a collective broken (NCCL, gloo): retriable
            return broken_collective(work.root, collectives.rank_env()[0], failed)
        if (code := failed_device(work.root, collectives.rank_env()[0], failed)) is not None:  # ECC, Xid: retriable
            return code
        if (full := full_disk_met(failed, work.root)) is not None:
            note_full_disk(work.root, f"rank-{os.environ.get('RANK', '0')}", full)
        raise
    collectives.leave()
    return 0


if __name__ == "__main__":
    from compass.model.training import collectives

    collectives.exit_process(main(sys.argv[1]))
