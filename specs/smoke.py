"""Smoke mode and rehearsals: the same DAG as a spec, every size shrunk so the whole lifecycle runs in minutes.

Smoke mode (`--smoke`) runs on a laptop CPU.

What it keeps: every step (sources, curation, tokenizer candidates, ablation variants, pretraining stages,
long-context stages, post-training methods, evaluation suite), the architecture's features at tiny width and
depth (GQA ratio, the NoPE layer pattern, tied embeddings, MoE with fewer experts, z-loss, document masking), the
schedule's shape, and the parallelism's kind (DeepSpeed or torch, the ZeRO stage, the tensor-parallel degree up
to 2, on CPU processes with gloo). What it cannot keep on a CPU it says: GPUs become CPU processes, bf16 becomes
fp32, data parallelism becomes one rank, several nodes become one, Ray and Slurm become this process. It writes to its
own store, next to the spec's (`<root>-smoke`), never among real artifacts.

A rehearsal (`--rehearse`) shrinks `what` the same way but keeps `how`: the accelerator, the engine and its ZeRO
stage, tensor parallelism (up to 2), the precision, the kernels, the Slurm cluster and its launch, requeue and probe,
node-local staging, retries and the per-phase shapes, with nodes and devices per node capped at 2, data parallelism
following from them and each stage's batch a whole number of micro-batches per rank (twice, so gradients
accumulate). It is the first thing to run on a new cluster: on GPU nodes it is the real launch at toy size; on CPU
ranks (an emulated cluster) every rank trains in the spec's precision and records the GPU it would open, and where a
CUDA-only kernel cannot run (flash-attn, Liger) the trainer takes the reference kernel through the same dispatch and
says so. It writes to `<root>-rehearsal`.

Pure: a TrainingSpec in, a TrainingSpec and the list of what changed out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from compass.specs.how import How, Phase
from compass.specs.spec import TrainingSpec

Size = Literal["full", "smoke", "rehearsal"]

STEPS = 4  # optimizer steps per training stage
SEQUENCE = 256  # the shortest trained length (benchmark prompts fit it); longer ones double it, in order
HEAD_DIM = 16
SAMPLES = 8  # post-training examples, evaluation samples
DOCUMENTS = 200  # documents read per source
HELDOUT = 0.2  # held-out share of those, so every source keeps some for perplexity
REHEARSAL_NODES = 2  # nodes per job at most in a rehearsal: what crosses nodes is exercised
REHEARSAL_DEVICES = 2  # and devices per node: what shares a node is exercised


@dataclass(frozen=True)
class Shrink:
    """One change smoke mode made: where (a spec section), what, from which value to which."""

    section: str
    field: str
    real: Any
    smoke: Any

    def __str__(self) -> str:
        return f"{self.field} {_short(self.real)} -> {_short(self.smoke)}"


def _short(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Shrinker:
    def __init__(self, spec: TrainingSpec, size: Size):
        self.spec = spec
        self.size = size
        self.data: dict[str, Any] = spec.model_dump(mode="json")
        self.changes: list[Shrink] = []
        how = spec.how
        self.tp = min(how.parallelism.tensor_parallel, 2)
        lengths = sorted({s.sequence_length for s in spec.what.pretraining.stages}
                         | {s.sequence_length for s in spec.what.long_context.stages} | {spec.what.trained_length})
        self.lengths = {n: SEQUENCE * 2**i for i, n in enumerate(lengths)}
        self.batch = 2  # smoke: two micro-batches of one row: gradient accumulation is exercised
        self.shaped: How | None = None  # a rehearsal's `how` once capped: each phase's data parallelism

    def set(self, section: str, node: dict[str, Any], key: str, value: Any, label: str | None = None) -> None:
        if node.get(key) != value:
            self.changes.append(Shrink(section, label or key, node.get(key), value))
            node[key] = value

    # --- the model ----------------------------------------------------------------------------------------
    def architecture(self, arch: dict[str, Any], section: str) -> None:
        positions = arch["positions"]
        period = positions.get("nope_every") or 2
        self.set(section, arch, "num_layers", max(2, period) if positions["kind"] == "rnope" else 2)
        heads, kv = arch["num_heads"], arch["num_kv_heads"]
        ratio = heads // kv
        small_kv = min(kv, max(2, self.tp))
        small_heads = small_kv * min(ratio, max(1, 8 // small_kv))
        self.set(section, arch, "num_kv_heads", small_kv)
        self.set(section, arch, "num_heads", small_heads)
        self.set(section, arch, "head_dim", HEAD_DIM)
        hidden = small_heads * HEAD_DIM
        ffn_ratio = arch["ffn_size"] / arch["hidden_size"]
        self.set(section, arch, "hidden_size", hidden)
        self.set(section, arch, "ffn_size", int(round(hidden * ffn_ratio / 16)) * 16)
        if arch.get("vocab_size") is not None:  # the chosen tokenizer's: the same for a hub tokenizer, smaller for BPE
            self.changes.append(Shrink(section, "vocab_size", arch["vocab_size"], "the chosen tokenizer's"))
            arch["vocab_size"] = None
        if arch.get("moe"):
            moe = arch["moe"]
            self.set(section, moe, "num_experts", min(moe["num_experts"], 4), "moe.num_experts")
            self.set(section, moe, "experts_per_token", min(moe["experts_per_token"], 2), "moe.experts_per_token")
            self.set(section, moe, "expert_ffn_size", 2 * hidden, "moe.expert_ffn_size")

    def scaled(self, field: str, value: Any, arch: dict[str, Any], real: dict[str, Any]) -> Any:
        """An ablation's architecture change at smoke size (the same relation to the shrunk model)."""
        if field == "num_kv_heads" and isinstance(value, int):
            return arch["num_heads"] if value == real["num_heads"] else max(1, min(value, arch["num_kv_heads"]))
        if field in ("num_heads", "hidden_size", "ffn_size", "num_layers", "head_dim") and isinstance(value, int):
            return max(1, round(value * arch[field] / real[field]))
        return value

    # --- phases -------------------------------------------------------------------------------------------
    def batch_of(self, phase: Phase, micro: int | None = None) -> int:
        """Rows per optimizer step: smoke's two, or in a rehearsal two micro-batches on every data-parallel rank."""
        if self.shaped is None:
            return self.batch
        micro = micro or self.shaped.parallelism.micro_batch_size
        return 2 * micro * self.shaped.data_parallel(phase)

    def stage(self, stage: dict[str, Any], section: str, phase: Phase) -> None:
        seq = self.lengths[stage["sequence_length"]]
        batch = self.batch_of(phase, stage.get("micro_batch_size"))
        self.set(section, stage, "sequence_length", seq)
        self.set(section, stage, "global_batch_size", batch)
        self.set(section, stage, "tokens", float(STEPS * batch * seq))

    def run(self) -> tuple[dict[str, Any], list[Shrink]]:
        d = self.data
        self.set("spec", d, "name", f"{self.spec.name}-{self.size}")
        what, how = d["what"], d["how"]
        if self.size == "rehearsal":  # first: the batches follow each phase's capped shape
            self.rehearsal_how(how)
        real_arch = dict(what["architecture"])
        if what.get("model") is None:  # a starting checkpoint is what it is: its shape and tokenizer stay
            self.architecture(what["architecture"], "what.architecture")
            tok = what["tokenizer"]
            self.set("what.tokenizer", tok, "train_chars", min(tok["train_chars"], 300_000))
            self.set("what.tokenizer", tok, "eval_chars", min(tok["eval_chars"], 50_000))
        for src in what["data"]["sources"]:
            self.set(f"what.data.sources.{src['name']}", src, "max_documents",
                     min(src.get("max_documents") or DOCUMENTS, DOCUMENTS))
            curation = src["curation"]
            if 0 < curation["heldout_fraction"] < HELDOUT:  # a few % of 200 documents can be none at all
                self.set(f"what.data.sources.{src['name']}", curation, "heldout_fraction", HELDOUT,
                         "curation.heldout_fraction")
        pt = what["pretraining"]
        for stage in pt["stages"]:
            self.stage(stage, f"what.pretraining.stages.{stage['name']}", "pretraining")
        schedule = pt["schedule"]
        self.set("what.pretraining.schedule", schedule, "warmup_steps", min(schedule["warmup_steps"], 1))
        lc = what["long_context"]
        for stage in lc["stages"]:
            if self.shaped is None:  # smoke: one row per micro-batch; a rehearsal keeps the stage's
                self.set(f"what.long_context.stages.{stage['name']}", stage, "micro_batch_size", 1)
            self.stage(stage, f"what.long_context.stages.{stage['name']}", "long_context")
            self.set(f"what.long_context.stages.{stage['name']}", stage, "warmup_steps", 0)
        if lc["stages"]:
            self.set("what.long_context", lc, "retrieval_samples", min(lc["retrieval_samples"], 2))
        for step in what["post_training"]:
            self.post_step(step)
        for task in what["evaluation"]["benchmarks"]:
            self.set(f"what.evaluation.benchmarks.{task['name']}", task, "limit", min(task.get("limit") or SAMPLES,
                                                                                 SAMPLES))
        if what.get("ablations"):
            self.ablations(what["ablations"], real_arch)
        if self.size == "smoke":
            self.how(how)
        return d, self.changes

    def post_step(self, step: dict[str, Any]) -> None:
        section = f"what.post_training.{step['name']}"
        if step["method"] == "mid_training":
            batch = self.batch_of("mid_training", step.get("micro_batch_size"))
            self.set(section, step, "batch_size", batch)
            self.set(section, step, "tokens", float(STEPS * batch * self.lengths[max(self.lengths)]))
            return
        self.set(section, step, "max_samples", min(step.get("max_samples") or SAMPLES, SAMPLES))
        self.set(section, step, "max_length", min(step["max_length"], 2 * SEQUENCE))
        self.set(section, step, "epochs", 1.0)
        self.set(section, step, "batch_size", min(step["batch_size"], 4))
        if step["method"] == "grpo":
            self.set(section, step, "num_generations", min(step["num_generations"], 2))
            self.set(section, step, "max_completion_length", min(step["max_completion_length"], 16))
            self.set(section, step, "batch_size", 2 * step["num_generations"])
        if (step.get("pairs") or {}).get("kind") == "verifier":
            pairs = step["pairs"]
            self.set(section, pairs, "samples_per_prompt", min(pairs["samples_per_prompt"], 4),
                     "pairs.samples_per_prompt")
        if step["method"] == "distill" and step.get("student_layers"):
            layers = self.data["what"]["architecture"]["num_layers"]
            self.set(section, step, "student_layers", max(1, min(step["student_layers"], layers - 1)))

    def ablations(self, abl: dict[str, Any], real_arch: dict[str, Any]) -> None:
        base = abl["baseline"]
        proxy_real = {**real_arch, **base["architecture"]}
        proxy = dict(proxy_real)
        self.architecture(proxy, "what.ablations.baseline.architecture")
        self.set("what.ablations.baseline", base, "architecture",
                 {k: v for k, v in proxy.items() if k in base["architecture"] or proxy[k] != real_arch.get(k)})
        seq = self.lengths.get(base["sequence_length"], SEQUENCE)
        self.set("what.ablations.baseline", base, "sequence_length", seq)
        batch = self.batch_of("ablation")
        self.set("what.ablations.baseline", base, "global_batch_size", batch)
        self.set("what.ablations.baseline", base, "tokens", float(STEPS * batch * seq))
        for variant in abl["variants"]:
            (path, value), = variant["change"].items()
            if path.startswith("architecture."):
                field = path.split(".", 1)[1]
                small = self.scaled(field, value, proxy, proxy_real)
                if small != value:
                    self.changes.append(Shrink(f"what.ablations.variants.{variant['name']}", path, value, small))
                    variant["change"] = {path: small}

    def how(self, how: dict[str, Any]) -> None:
        hw, par = how["hardware"], how["parallelism"]
        self.set("how.hardware", hw, "accelerator", "cpu")
        self.set("how.hardware", hw, "nodes", 1)
        self.set("how.hardware", hw, "hosts", [])
        self.set("how.hardware", hw, "launcher", "torchrun")
        self.set("how.hardware", hw, "devices_per_node", self.tp)
        self.set("how.hardware", hw, "peak_tflops", None)
        self.set("how.hardware", hw, "cpus_per_node", None)
        self.set("how.parallelism", par, "data_parallel", 1)
        self.set("how.parallelism", par, "tensor_parallel", self.tp)
        self.set("how.parallelism", par, "micro_batch_size", 1)
        self.set("how", how, "precision", "fp32")
        if "reduce_precision" in how:  # fp32 training's gradients are fp32
            self.set("how", how, "reduce_precision", "fp32")
        self.set("how", how, "attention", "auto")
        self.set("how", how, "loss", "auto")
        self.set("how", how, "compile", False)
        orch = how["orchestration"]
        self.set("how.orchestration", orch, "task_runner", "local")
        self.set("how.orchestration", orch, "ray_address", None)
        self.set("how.orchestration", orch, "ray_num_cpus", None)
        self.set("how.orchestration", orch, "cluster", None, "cluster (Slurm jobs -> this process)")
        self.set("how", how, "resources", {}, "resources (per-phase shapes -> this machine)")
        self.set("how.orchestration", orch, "retries", 0)
        self.set("how.checkpoints", how["checkpoints"], "every_steps", STEPS)  # one checkpoint a stage
        storage = how["storage"]
        self.set("how.storage", storage, "root", sized_root(storage["root"], "smoke"))
        self.set("how.storage", storage, "local_cache", None)  # a cluster's /scratch is not on this machine
        if "local_cache_gib" in storage:  # ... nor its capacity
            self.changes.append(Shrink("how.storage", "local_cache_gib", storage.pop("local_cache_gib"), None))


    def rehearsal_how(self, how: dict[str, Any]) -> None:
        """`how` kept, its shapes capped at REHEARSAL_NODES x REHEARSAL_DEVICES (see the module's docstring)."""
        hw, par = how["hardware"], how["parallelism"]
        nodes = min(hw["nodes"], REHEARSAL_NODES)
        self.set("how.hardware", hw, "nodes", nodes)
        self.set("how.hardware", hw, "hosts", hw["hosts"][:nodes])
        self.set("how.hardware", hw, "devices_per_node", min(hw["devices_per_node"], REHEARSAL_DEVICES))
        for phase, shape in how["resources"].items():
            if shape.get("nodes"):
                self.set(f"how.resources.{phase}", shape, "nodes", min(shape["nodes"], REHEARSAL_NODES))
            if shape.get("devices_per_node"):
                self.set(f"how.resources.{phase}", shape, "devices_per_node",
                         min(shape["devices_per_node"], REHEARSAL_DEVICES))
        self.set("how.parallelism", par, "tensor_parallel", self.tp)
        shaped = How.model_validate(how)
        data_parallel = shaped.data_parallel("pretraining")
        self.set("how.parallelism", par, "data_parallel", data_parallel)
        if par.get("shard_group"):
            self.set("how.parallelism", par, "shard_group", min(par["shard_group"], data_parallel))
        self.set("how.checkpoints", how["checkpoints"], "every_steps", STEPS // 2)  # a resume point mid-stage
        storage = how["storage"]
        self.set("how.storage", storage, "root", sized_root(storage["root"], "rehearsal"))
        self.shaped = How.model_validate(how)


def sized_root(root: str, size: str) -> str:
    """Where a smoke run or a rehearsal of the store at `root` writes: beside it (`<root>-smoke`), never among its
    artifacts; for a whole bucket (`s3://corp-data`), under a prefix of that bucket (`s3://corp-data/smoke`), never
    in a bucket of another name, which anyone may own."""
    bare = root.rstrip("/")
    scheme, sep, rest = bare.partition("://")
    if sep and scheme != "file" and "/" not in rest:
        return f"{bare}/{size}"
    return f"{bare}-{size}"


def smoke_spec(spec: TrainingSpec) -> tuple[TrainingSpec, list[Shrink]]:
    """The spec at smoke size, and every change made to get there."""
    return shrunk_spec(spec, "smoke")


def rehearsal_spec(spec: TrainingSpec) -> tuple[TrainingSpec, list[Shrink]]:
    """The spec at rehearsal size (its `how` kept, capped at 2 nodes x 2 devices), and every change made."""
    return shrunk_spec(spec, "rehearsal")


def shrunk_spec(spec: TrainingSpec, size: Size) -> tuple[TrainingSpec, list[Shrink]]:
    if size == "full":
        return spec, []
    data, changes = _Shrinker(spec, size).run()
    return TrainingSpec.model_validate(_without_unset_defaults(data, spec)), changes


def _without_unset_defaults(data: dict[str, Any], spec: TrainingSpec) -> dict[str, Any]:
    """A dump holds every field; the checks that refuse fields without effect look at the fields set. Keep only
    the fields the spec set, or smoke mode changed."""
    def prune(node: Any, model: Any) -> Any:
        if isinstance(node, dict) and hasattr(model, "model_fields_set"):
            keep = model.model_fields_set | {"method", "kind", "name", "reason"}
            return {k: prune(v, getattr(model, k, None)) for k, v in node.items()
                    if k in keep or v != _default(model, k)}
        if isinstance(node, list) and isinstance(model, list):
            return [prune(v, m) for v, m in zip(node, model, strict=False)] + node[len(model):]
        return node

    return prune(data, spec)


def _default(model: Any, key: str) -> Any:
    field = type(model).model_fields.get(key)
    if field is None:
        return object()
    value = field.get_default(call_default_factory=True)
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value
