"""The planner's arithmetic: parameters, FLOPs, GPU-hours, memory per GPU and KV-cache size.

Conventions (stated so a reader can redo them by hand):
- parameters follow the transformers Llama/Qwen3/SmolLM3 layout: no biases, SwiGLU FFN (3 matrices),
  two RMSNorms per layer, a final norm, optional q/k norms, an output head counted once when tied;
- training FLOPs per token = 6 * N_matmul + 12 * L * H * Q * T (PaLM, appendix B), where N_matmul is the
  non-embedding parameters plus the output projection (V * d; it is a matmul even when tied), H heads,
  Q head dim, T sequence length; for MoE, N_matmul counts active experts only;
- memory uses mixed-precision Adam (bf16/fp16: 2 bytes weights, 2 grads, 12 optimizer = fp32 master, m, v;
  fp32: 4, 4, 8) partitioned by ZeRO over data-parallel ranks and by tensor parallelism;
- activations per layer per sequence: T * d * 34 bytes (Korthikanti et al., flash attention, 16-bit),
  divided by TP; with activation checkpointing only each layer's input (2 * T * d bytes) is kept;
- logits: the chunked loss holds LOSS_CHUNK_BYTES of fp32 logits at a time, not the whole batch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil

from compass.specs.architecture import Architecture
from compass.specs.how import MEMORY_GIB, How, Phase
from compass.specs.post_training import Distillation, Grpo, MidTraining
from compass.specs.post_training_methods import method_of
from compass.specs.spec import TrainingSpec
from compass.specs.starting_model import NAMED_MODEL_PREFIX

GIB = 1024**3
LOSS_CHUNK_BYTES = 256 * 1024**2  # fp32 logits the chunked loss holds at once (model/loss.py)


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the chunked loss: as many as fit LOSS_CHUNK_BYTES of fp32 logits."""
    return max(16, LOSS_CHUNK_BYTES // (4 * vocab))


@dataclass(frozen=True)
class ParamCount:
    embedding: int          # input embedding
    non_embedding: int      # transformer blocks, final norm and an untied output head
    lm_head: int            # untied output head (0 when tied), included in non_embedding
    active_non_embedding: int  # MoE: with only the routed top-k (+ shared) experts

    @property
    def total(self) -> int:
        return self.embedding + self.non_embedding


def planning_vocab(spec: TrainingSpec) -> int:
    """The vocabulary size the plan assumes: fixed in the architecture, or the largest candidate."""
    if spec.what.architecture.vocab_size:
        return spec.what.architecture.vocab_size
    sizes = [c.vocab_size for c in spec.what.tokenizer.candidates if c.kind in ("bpe", "hub")]
    return max(sizes) if sizes else 32_000


def count_parameters(arch: Architecture, vocab: int) -> ParamCount:
    d, hd, L = arch.hidden_size, arch.resolved_head_dim, arch.num_layers
    attn = d * arch.num_heads * hd * 2 + d * arch.num_kv_heads * hd * 2
    norms = 2 * d + (2 * hd if arch.qk_norm else 0)
    if arch.family == "moe" and arch.moe:
        m = arch.moe
        expert = 3 * d * m.expert_ffn_size
        shared = m.shared_experts * expert + (d if m.shared_experts else 0)  # shared experts and their gate
        ffn = d * m.num_experts + m.num_experts * expert + shared
        active_ffn = d * m.num_experts + m.experts_per_token * expert + shared
    else:
        ffn = active_ffn = 3 * d * arch.ffn_size
    embedding = vocab * d
    lm_head = 0 if arch.tied_embeddings else vocab * d
    non_embedding = L * (attn + ffn + norms) + d + lm_head
    active = L * (attn + active_ffn + norms) + d + lm_head
    return ParamCount(embedding, non_embedding, lm_head, active)


def flops_per_token(arch: Architecture, vocab: int, seq_len: int) -> float:
    p = count_parameters(arch, vocab)
    n_matmul = p.active_non_embedding - p.lm_head + vocab * arch.hidden_size - _norm_params(arch)
    attention = 12 * arch.num_layers * arch.num_heads * arch.resolved_head_dim * seq_len
    return 6 * n_matmul + attention


def _norm_params(arch: Architecture) -> int:
    per_layer = 2 * arch.hidden_size + (2 * arch.resolved_head_dim if arch.qk_norm else 0)
    return arch.num_layers * per_layer + arch.hidden_size


def gpu_hours(flops: float, how: How) -> float:
    return flops / (how.hardware.peak * 1e12 * how.hardware.assumed_mfu) / 3600


@dataclass(frozen=True)
class StageCost:
    section: str
    name: str
    tokens: float
    seq_len: int
    flops: float
    gpu_hours: float
    gpus: int  # its phase's devices (how.resources)
    wall_days: float


PHASE_OF_SECTION: dict[str, Phase] = {"pretrain": "pretraining", "long_context": "long_context",
                                      "mid_training": "mid_training"}


def reached_context(spec: TrainingSpec) -> int:
    """The context the model has after pretraining and long context: where mid-training trains."""
    return max([spec.what.trained_length, *(s.sequence_length for s in spec.what.long_context.stages)])


def stage_costs(spec: TrainingSpec) -> list[StageCost]:
    arch, how, vocab = spec.what.architecture, spec.how, planning_vocab(spec)
    stages = [("pretrain", s.name, s.tokens, s.sequence_length) for s in spec.what.pretraining.stages]
    stages += [("long_context", s.name, s.tokens, s.sequence_length) for s in spec.what.long_context.stages]
    context = reached_context(spec)
    stages += [("mid_training", s.name, s.tokens, context) for s in spec.what.post_training
               if isinstance(s, MidTraining)]  # the pretraining engine, at the context reached
    out = []
    for section, name, tokens, seq in stages:
        flops = flops_per_token(arch, vocab, seq) * tokens
        hours = gpu_hours(flops, how)
        gpus = how.shape(PHASE_OF_SECTION[section]).ranks
        out.append(StageCost(section, name, tokens, seq, flops, hours, gpus, hours / max(1, gpus) / 24))
    return out


@dataclass(frozen=True)
class AblationCost:
    runs: int
    params: int
    tokens_per_run: float
    flops: float
    gpu_hours: float
    share_of_main: float
    gpus: int  # of one run (how.resources.ablation)
    wall_days: float  # the runs one after another


def ablation_cost(spec: TrainingSpec) -> AblationCost | None:
    abl = spec.what.ablations
    if abl is None:
        return None
    proxy = Architecture.model_validate({**spec.what.architecture.model_dump(), **abl.baseline.architecture})
    vocab = planning_vocab(spec)
    runs = (len(abl.variants) + 1) * len(abl.seeds)
    flops = runs * flops_per_token(proxy, vocab, abl.baseline.sequence_length) * abl.baseline.tokens
    hours = gpu_hours(flops, spec.how)
    main = sum(s.gpu_hours for s in stage_costs(spec))
    gpus = spec.how.shape("ablation").ranks
    return AblationCost(runs, count_parameters(proxy, vocab).total, abl.baseline.tokens, flops, hours,
                        hours / main if main else 0.0, gpus, hours / max(1, gpus) / 24)


@dataclass(frozen=True)
class MemoryEstimate:
    zero_stage: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits


def gradient_bytes(how: How, zero_stage: int) -> int:
    """Bytes per parameter a rank holds for gradients of bf16/fp16 training. Summed in fp32 (how.reduce_precision):
    below ZeRO-2 a whole fp32 accumulator beside the 16-bit gradients (DeepSpeed's BF16_Optimizer), from ZeRO-2 up
    (and FSDP2) fp32 partitions only; summed in 16 bits, the weights' own gradients."""
    if how.reduce_precision != "fp32":
        return 2
    return 4 if zero_stage >= 2 else 6


def memory_per_gpu(spec: TrainingSpec, zero_stage: int, seq_len: int | None = None,
                   micro_batch: int | None = None, phase: Phase = "pretraining") -> MemoryEstimate:
    """Bytes per GPU for one training micro-step of `phase` (its data parallelism shards ZeRO's states) at
    `seq_len` (default: the longest pretraining stage) and `micro_batch` sequences (default:
    how.parallelism.micro_batch_size)."""
    arch, how = spec.what.architecture, spec.how
    par = how.parallelism
    vocab = planning_vocab(spec)
    n = count_parameters(arch, vocab).total
    tp = par.tensor_parallel
    dp = par.data_parallel if phase == "pretraining" else how.data_parallel(phase)
    w_bytes, g_bytes, o_bytes = (4, 4, 8) if how.precision == "fp32" else (2, gradient_bytes(how, zero_stage), 12)
    if zero_stage == 3 and par.engine_name == "fsdp2":
        dp = par.shard_ranks(dp)  # HSDP: one copy of the states per shard group
    weights = n * w_bytes / tp / (dp if zero_stage >= 3 else 1)
    grads = n * g_bytes / tp / (dp if zero_stage >= 2 else 1)
    optim = n * o_bytes / tp / (dp if zero_stage >= 1 else 1)
    seq = seq_len or max((s.sequence_length for s in spec.what.pretraining.stages), default=spec.what.trained_length)
    b, d, L = micro_batch or par.micro_batch_size, arch.hidden_size, arch.num_layers
    act_scale = 2 if how.precision == "fp32" else 1
    # a layer keeps 34 s*b*h bytes (Korthikanti et al.); tensor parallelism without sequence parallelism (AutoTP,
    # FSDP2's plans here) splits the 24 of attention and MLP, the 10 of norms, residuals and dropout stay whole
    layer = (10 + 24 / tp) * seq * b * d
    kept = L * 2 * seq * b * d + layer if par.activation_checkpointing else L * layer  # inputs + one layer, or all
    acts = kept * act_scale
    logits = min(seq * b, loss_chunk_tokens(vocab)) * vocab * 4 / tp  # fp32 logits of one loss chunk at a time
    return MemoryEstimate(zero_stage, weights, grads, optim, acts, logits)


def device_memory_bytes(how: How) -> float:
    """A GPU's memory by its kind; on CPU the ranks share this machine's memory, read from it."""
    if how.hardware.accelerator == "cpu":

        return float(psutil.virtual_memory().total)
    return MEMORY_GIB[how.hardware.accelerator] * GIB


def training_memory(spec: TrainingSpec) -> list[tuple[tuple[str | int, ...], int, MemoryEstimate]]:
    """(spec location, sequence length, memory per GPU) of every training stage at the spec's ZeRO stage, with the
    micro-batch each stage trains with."""
    par = spec.how.parallelism
    out = [(("what", "pretraining", "stages", i, "sequence_length"), s.sequence_length,
            memory_per_gpu(spec, par.sharding_stage, s.sequence_length))
           for i, s in enumerate(spec.what.pretraining.stages)]
    out += [(("what", "long_context", "stages", i, "sequence_length"), s.sequence_length,
             memory_per_gpu(spec, par.sharding_stage, s.sequence_length, s.micro_batch_size, "long_context"))
            for i, s in enumerate(spec.what.long_context.stages)]
    context = reached_context(spec)
    out += [(("what", "post_training", i, "method"), context,
             memory_per_gpu(spec, par.sharding_stage, context, phase="mid_training"))
            for i, s in enumerate(spec.what.post_training) if isinstance(s, MidTraining)]
    return out


@dataclass(frozen=True)
class LibraryStepMemory:
    """Bytes per GPU of a TRL or evaluation step: what its ranks hold, and the batch each rank takes."""

    step: str
    ranks: int
    global_batch: int
    per_rank: int
    micro_batch: int  # rows per forward pass; per_rank / micro_batch passes accumulate
    length: int
    weights: float  # trained weights with their gradients and AdamW states, plus any frozen model beside them
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.weights + self.activations + self.logits


ANSWER_BATCH = 16  # prompts a pair answerer generates for at once (tasks/post_training/chat.generate)


def named_parameters(spec: TrainingSpec, ref: str, default: int) -> int:
    """Parameters of a checkpoint a step names: a model of what.models as counted from its config, else
    `default` (a checkpoint of this run)."""
    if not ref.startswith(NAMED_MODEL_PREFIX):
        return default
    model = spec.what.models.get(ref.removeprefix(NAMED_MODEL_PREFIX))
    resolved = model.resolved if model else None
    return resolved.parameters if resolved and resolved.parameters else default


def library_step_memory(spec: TrainingSpec) -> list[LibraryStepMemory]:
    """Each TRL step's memory per GPU (its share of the global batch at `max_length`; fp32 master weights, gradients
    and AdamW moments for full fine-tuning, sharded by the spec's ZeRO stage over the step's ranks, frozen weights
    for LoRA, the frozen models its method's trainer holds beside them (a reference model, GKD's teacher), full-
    vocabulary logits in fp32: specs/post_training_methods.py) and, with long-context stages, passkey's (weights,
    the KV cache at the longest length and one layer's activations at a time: no logits beyond the answer)."""
    arch, how = spec.what.architecture, spec.how
    vocab = planning_vocab(spec)
    n = count_parameters(arch, vocab).total
    d, L, f = arch.hidden_size, arch.num_layers, arch.ffn_size
    half = how.precision != "fp32" and how.hardware.accelerator != "cpu"
    act_bytes = 2 if half else 4
    ranks = how.shape("post_training").ranks
    out = []
    for post in spec.what.post_training:
        if isinstance(post, MidTraining):
            continue
        method = method_of(post)
        batch = post.batch_size
        if isinstance(post, Grpo):
            batch = max(post.num_generations, batch // post.num_generations * post.num_generations)
        per_rank = max(1, batch // ranks)
        micro = min(post.micro_batch_size or per_rank, per_rank)
        rows = micro * method.sequences_per_row
        lora = post.peft is not None
        zero = how.parallelism.zero_stage if how.parallelism.deepspeed and ranks > 1 else 0
        if lora:
            weights = n * (0.5 if post.peft.kind == "qlora" else 4)
        else:  # fp32 weights, gradients and AdamW's two moments; ZeRO shards the moments, then gradients, weights
            weights = n * (4 / (ranks if zero >= 3 else 1) + 4 / (ranks if zero >= 2 else 1) +
                           8 / (ranks if zero >= 1 else 1))
        frozen = 4 / (ranks if zero >= 3 else 1)  # TRL shards a frozen model beside the trained one at ZeRO-3 too
        weights += method.frozen_models(lora) * n * frozen  # the reference model
        if method.teacher and isinstance(post, Distillation):
            weights += named_parameters(spec, post.teacher, n) * frozen  # the teacher: a checkpoint of this run is
            # at most the student's size; one of what.models is counted from its config
        seq = post.max_length
        per_layer = 34 * seq * rows * d * act_bytes / 2
        acts = (2 * L * seq * rows * d * act_bytes + per_layer) if how.parallelism.activation_checkpointing \
            else L * per_layer
        acts += dense_mask_bytes(how.attention, packed=getattr(post, "packing", False), rows=rows, length=seq,
                                 act_bytes=act_bytes)
        logits = (fused_logits(rows * seq, vocab, d) if how.loss == "liger" and method.fused_loss else
                  rows * seq * vocab * 4 * method.logits_copies)
        out.append(LibraryStepMemory(f"post_train:{post.name}", ranks, batch, per_rank, micro, seq, weights, acts,
                                     logits))
        pairs = getattr(post, "pairs", None)
        if pairs is not None and pairs.kind == "strong_vs_weak":
            for ref in (pairs.strong, pairs.weak):  # each answers the prompts alone on one GPU, before training
                if ref.startswith(NAMED_MODEL_PREFIX):
                    out.append(LibraryStepMemory(f"post_train:{post.name} answers by {ref}", 1, ANSWER_BATCH,
                                                 ANSWER_BATCH, ANSWER_BATCH, seq, named_parameters(spec, ref, n) *
                                                 act_bytes, 0.0, ANSWER_BATCH * vocab * 4))
    stages = spec.what.long_context.stages
    if stages:
        longest = max(s.sequence_length for s in stages)
        kv = 2 * L * arch.num_kv_heads * arch.resolved_head_dim * act_bytes * longest
        one_layer = longest * (3 * f + 4 * d) * act_bytes
        out.append(LibraryStepMemory("evaluate: passkey", 1, 1, 1, 1, longest, n * act_bytes, kv + one_layer, 0.0))
    return out


def dense_mask_bytes(attention: str, packed: bool, rows: int, length: int, act_bytes: int) -> float:
    """The [rows, 1, L, L] mask transformers builds for a library step's forward where its attention takes one:
    padded rows on SDPA (a bool a pair) or eager (a float a pair), packed rows on eager only (packed SFT runs
    compass's document attention: tasks/post_training/trl_ranks.packed_attention); flash and FlexAttention (a
    block mask) build none. At 64k tokens a row's is 4 GiB."""
    if attention in ("flash", "flex") or (packed and attention != "eager"):
        return 0.0
    return float(rows * length * length * (act_bytes if attention == "eager" else 1))


def fused_logits(tokens: int, vocab: int, hidden: int) -> float:
    """Bytes of fp32 logits Liger's fused linear cross-entropy holds at once: it walks the tokens in chunks of the
    power of two nearest tokens / ceil(vocab / hidden), never the whole batch's logits."""
    chunks = math.ceil(vocab / hidden)
    chunk = 2 ** math.ceil(math.log2(max(1, math.ceil(tokens / chunks))))
    return min(chunk, tokens) * vocab * 4


@dataclass(frozen=True)
class KvCache:
    seq_len: int
    bytes_gqa: float
    bytes_mha: float


def kv_cache(spec: TrainingSpec, bytes_per_value: int = 2) -> list[KvCache]:
    """KV cache per sequence = 2 (K and V) * layers * kv_heads * head_dim * bytes * length."""
    arch = spec.what.architecture
    lengths = sorted({s.sequence_length for s in spec.what.pretraining.stages}
                     | {s.sequence_length for s in spec.what.long_context.stages} | {spec.what.trained_length})
    per_token_gqa = 2 * arch.num_layers * arch.num_kv_heads * arch.resolved_head_dim * bytes_per_value
    per_token_mha = 2 * arch.num_layers * arch.num_heads * arch.resolved_head_dim * bytes_per_value
    return [KvCache(n, per_token_gqa * n, per_token_mha * n) for n in lengths]
