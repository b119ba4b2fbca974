"""The plan as tables (DAG with cache status, costs, memory, KV cache), rendered for a terminal or markdown."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape
from rich.table import Table

from compass.flows.compiler import Plan
from compass.flows.reports.phase_scale import orchestrator_note, phase_scales
from compass.flows.reports.plan_status import StepStatus
from compass.infra.resource_ledger import size_text
from compass.model.attention import DOCUMENT_SDPA, DOCUMENT_VARLEN, flash_kernel
from compass.specs import costs, scaling
from compass.specs.checks import phases_of, zero0_cannot_reduce_in_fp32
from compass.specs.goodput_plan import HOST_COPY_GBPS, predicted_splits
from compass.specs.how import CONTENT_BYTE_COST
from compass.specs.post_training_methods import with_reference_model
from compass.specs.scaling import step_shapes
from compass.specs.spec import TrainingSpec
from compass.specs.staging_costs import GIB, WINDOW_MARGIN, staging_costs, token_bytes
from compass.tasks.common.fence import fenced_post_training, needs_fence, trained_sources
from compass.tasks.evaluation.costs import evaluation_costs
from compass.tasks.steps.backends import backends_of, one_of_each


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)


def human(n: float, unit: str = "") -> str:
    for factor, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}" if float(n).is_integer() else f"{n:.3g}{unit}"


def hours(h: float) -> str:
    return f"{h:,.0f}" if h >= 100 else f"{h:.3g}"


def gib(n: float) -> str:
    return f"{n / costs.GIB:.2f} GiB" if n >= costs.GIB / 100 else f"{n / 1024**2:.1f} MiB"


def _deps(inputs: list[str]) -> str:
    deps = sorted(set(inputs))
    return ", ".join(deps) if len(deps) <= 2 else f"{deps[0]} +{len(deps) - 1} more"


def dag_section(plan: Plan, statuses: list[StepStatus], store_root: str, new_store: bool = False) -> Section:
    """The steps in run order with what would run and why; `new_store`: the store does not exist yet."""
    rows = []
    for step, st in zip(plan.steps, statuses, strict=True):
        rows.append([step.id, _deps(list(step.needs)) or "-", plan.fingerprints[step.id][:12],
                     st.state, st.reason, st.uri.removeprefix(store_root + "/")])
    counts = {s: sum(1 for x in statuses if x.state == s) for s in ("run", "cached", "unknown")}
    note = (f"{counts['run']} to run, {counts['cached']} cached"
            + (f", {counts['unknown']} unknown" if counts["unknown"] else "")
            + f"; outputs under {store_root}" + (" (a new store: the first run creates it)" if new_store else ""))
    return Section("DAG", ["step", "depends on", "fingerprint", "state", "why", "output"], rows, [note])


def scaling_section(spec: TrainingSpec, tflops_per_gpu: float | None = None) -> Section:
    """Wall time by GPU count, the GPUs the target needs, and where adding GPUs stops helping."""

    hw = spec.how.hardware
    points = scaling.scaling(spec, tflops_per_gpu)
    rows = [[p.gpus, f"{p.wall_days:.3g}", f"{p.exposed_comm_share:.0%}", f"{p.efficiency:.0%}",
             "global batch exhausted" if p.capped else ""] for p in points]
    per_gpu = tflops_per_gpu or hw.peak * hw.assumed_mfu
    notes = [f"{per_gpu:,.0f} TFLOP/s per GPU ({'measured by preflight' if tflops_per_gpu else 'peak x assumed MFU'}"
             f"), gradients all-reduced in {'fp32' if scaling.reduced_bytes(spec) == 4 else spec.how.precision} each "
             f"step over {scaling.INTRANODE_BUSBW_GBPS[hw.accelerator]:g} GB/s "
             f"within a node and {hw.internode_busbw_gbps:g} GB/s across nodes, hidden behind the backward pass up "
             "to its length"]
    knee = scaling.stops_helping(points)
    if knee:
        notes.append(f"adding GPUs stops helping at about {knee.gpus}: "
                     + ("every GPU already holds a single micro-batch of the global batch" if knee.capped else
                        f"parallel efficiency {knee.efficiency:.0%}, exposed communication "
                        f"{knee.exposed_comm_share:.0%} of the time"))
    if hw.target_days:
        need = scaling.gpus_for(spec, hw.target_days, tflops_per_gpu)
        notes.append(f"target {hw.target_days:g} days: " + (f"{need} GPUs ({need // hw.devices_per_node} nodes of "
                     f"{hw.devices_per_node})" if need else "no GPU count reaches it (the global batch or the "
                     "communication caps the speed-up): shorten the run or raise the batch"))
    return Section("GPUs and wall time", ["GPUs", "days", "exposed comm", "efficiency", ""], rows, notes)


def _sharding_rows(engine: str) -> list[tuple[int, str]]:
    """The memory table's rows in the engine's own words: DeepSpeed's ZeRO stages, or DDP against FSDP2 (what
    a torch engine can switch to)."""
    if engine == "deepspeed":
        return [(z, f"ZeRO-{z}") for z in range(4)]
    return [(0, "DDP (no sharding)"), (3, "FSDP2 (fully sharded)")]


def cost_sections(spec: TrainingSpec, tflops_per_gpu: float | None = None) -> list[Section]:
    arch, how = spec.what.architecture, spec.how
    vocab = costs.planning_vocab(spec)
    p = costs.count_parameters(arch, vocab)
    params_rows = [["embedding", f"{p.embedding:,}", human(p.embedding)],
                   ["non-embedding", f"{p.non_embedding:,}", human(p.non_embedding)],
                   ["total", f"{p.total:,}", human(p.total)]]
    if arch.family == "moe":
        params_rows.append(["active non-embedding", f"{p.active_non_embedding:,}", human(p.active_non_embedding)])
    params = Section("Parameters", ["part", "count", "~"], params_rows,
                     [f"vocabulary {vocab:,}" + ("" if arch.vocab_size else " (largest tokenizer candidate)")
                      + f"; tied embeddings: {arch.tied_embeddings}"])
    start = spec.what.model
    if start is not None and start.resolved is not None:
        params.notes.append(f"from the checkpoint {start.init_from} ({start.resolved.model_type}, revision "
                            f"{start.resolved.stamp}): architecture and tokenizer read from it")

    stages = costs.stage_costs(spec)
    hw = how.hardware
    unit = "GPU" if hw.accelerator != "cpu" else "rank"  # a CPU spec trains on ranks (processes), not GPUs
    stage_rows = [[f"{s.section}:{s.name}", human(s.tokens), s.seq_len, f"{s.flops:.3e}", hours(s.gpu_hours),
                   s.gpus, f"{s.wall_days:.3g}"] for s in stages]
    total_h = sum(s.gpu_hours for s in stages)
    stage_rows.append(["total", human(sum(s.tokens for s in stages)), "", f"{sum(s.flops for s in stages):.3e}",
                       hours(total_h), "", f"{sum(s.wall_days for s in stages):.3g}"])
    compute = Section("Training compute", ["stage", "tokens", "seq", "FLOPs", f"{unit}-hours", f"{unit}s", "days"],
                      stage_rows,
                      [f"6·N·D + attention (PaLM); {hw.accelerator} at {hw.peak:g} TFLOP/s per {unit}, assumed MFU "
                       f"{hw.assumed_mfu:.0%}; each phase on its own {unit}s (how.resources)"])
    sections = [params, placement_section(spec), orchestration_section(spec), compute, goodput_section(spec),
                training_core_section(spec)]
    if (staging := staging_section(spec)) is not None:
        sections.append(staging)
    if (evaluation := evaluation_section(spec)) is not None:
        sections.append(evaluation)
    if (scale := scale_section(spec)) is not None:
        sections.append(scale)
    if (fence := fence_section(spec)) is not None:
        sections.append(fence)

    if (hw.accelerator != "cpu" or hw.target_days) and step_shapes(spec):  # (nothing to scale: a fine-tune only)
        sections.append(scaling_section(spec, tflops_per_gpu))
    abl = costs.ablation_cost(spec)
    if abl:
        sections.append(Section("Ablations", ["runs", "proxy params", "tokens/run", "FLOPs", f"{unit}-hours",
                                              "vs main run", f"{unit}s/run", "days in a row"],
                                [[abl.runs, human(abl.params), human(abl.tokens_per_run), f"{abl.flops:.3e}",
                                  hours(abl.gpu_hours), f"{abl.share_of_main:.1%}", abl.gpus,
                                  f"{abl.wall_days:.3g}"]],
                                ["SmolLM3 spent 161,280 GPU-hours on ablations and debugging, over half its main run",
                                 *_one_seed_warning(spec)]))
    device = costs.device_memory_bytes(how)
    mem_rows = []
    for z, name in _sharding_rows(how.parallelism.engine_name):
        m = costs.memory_per_gpu(spec, z)
        mark = " (spec)" if z == how.parallelism.sharding_stage else ""
        fits = "yes" if m.total <= device else "NO"
        mem_rows.append([f"{name}{mark}", gib(m.weights), gib(m.gradients), gib(m.optimizer), gib(m.activations),
                         gib(m.logits), gib(m.total), fits])
    par = how.parallelism
    sections.append(Section(f"Memory per {unit}", ["sharding", "weights", "grads", "optimizer", "activations",
                                                  "logits", "total", f"fits {gib(device)}"], mem_rows,
                            [f"{how.precision}, DP={par.data_parallel}, TP={par.tensor_parallel}, micro-batch "
                             f"{par.micro_batch_size}, activation checkpointing {par.activation_checkpointing}",
                             sharding_advice(spec, device)]))
    library = costs.library_step_memory(spec)
    if library:
        rows = [[m.step, m.ranks, m.global_batch, f"{m.per_rank} = {m.micro_batch} x {m.per_rank // m.micro_batch}",
                 m.length, gib(m.weights), gib(m.activations), gib(m.logits), gib(m.total),
                 "yes" if m.total <= device else "NO"] for m in library]
        sections.append(Section(f"Post-training and evaluation memory per {unit}",
                                ["step", "ranks", "global batch", "per rank = micro x passes", "length",
                                 "weights and states",
                                 "activations", "logits", "total", f"fits {gib(device)}"], rows,
                                ["TRL: batch_size is the global batch, split evenly over how.resources.post_training, "
                                 "each share in micro_batch_size passes that accumulate; fp32 master weights, grads "
                                 "and AdamW moments (LoRA: frozen weights); the reference model of "
                                 f"{' and '.join(with_reference_model())} (not under LoRA) and GKD's teacher beside "
                                 "them",
                                 "activations hold the [L, L] attention mask transformers builds for padded rows on "
                                 "SDPA or eager (a bool or a float a pair); packed SFT rows run compass's document "
                                 "attention and build none",
                                 "passkey: the KV cache at the longest context and one layer at a time, no "
                                 "full-vocabulary logits"]))
    kv_rows = [[k.seq_len, gib(k.bytes_gqa), gib(k.bytes_mha), f"{k.bytes_mha / k.bytes_gqa:.0f}x"]
               for k in costs.kv_cache(spec)]
    sections.append(Section("KV cache per sequence (bf16)",
                            ["context", f"{arch.num_kv_heads} KV heads", f"MHA ({arch.num_heads})", "saving"],
                            kv_rows))
    return sections


def staging_section(spec: TrainingSpec) -> Section | None:
    """What each training step copies onto each of its nodes' local disk, against the disk's capacity."""
    rows = staging_costs(spec)
    if not rows:
        return None
    capacity = spec.how.storage.local_cache_gib
    limit = f"fits {capacity:,.0f} GiB" if capacity is not None else "fits (local_cache_gib not given)"
    return Section("Node-local staging", ["step", "tokens drawn", "nodes", "per node", limit],
                   [[c.step, human(c.tokens), c.nodes, gib(c.per_node),
                     "-" if capacity is None else ("yes" if c.per_node <= capacity * GIB else "NO")] for c in rows],
                   [f"each node copies its rows' share of the stage's window of every source (the tokens drawn x "
                    f"{WINDOW_MARGIN}, {token_bytes(costs.planning_vocab(spec))} bytes a token) into "
                    f"{spec.how.storage.local_cache}: an upper bound (a window never exceeds its source); earlier "
                    "copies there are removed, least recently used first, to make room; the step's resource ledger "
                    "counts what it copied (copied_by_node)"])


def scale_section(spec: TrainingSpec) -> Section | None:
    """Each training stage and evaluate step at the spec's size: the jobs it takes, what it copies, reads, writes,
    commits and uploads (for GPU specs and specs with a cluster: what grows with the run)."""
    how = spec.how
    if how.hardware.accelerator == "cpu" and how.shape("pretraining").time_limit is None:
        return None
    rows = phase_scales(spec)
    if not rows:
        return None

    def size(n: float) -> str:
        return size_text(n) if n else "-"

    table = [[p.step, p.jobs, rough_duration(p.wall_s), size(p.staged_per_node), size(p.read),
              size(p.checkpoint_bytes), size(p.artifact_bytes), size(p.uploaded), "yes" if p.fits_job else "NO"]
             for p in rows]
    return Section("Scale (per step, at full size)",
                   ["step", "jobs", "wall", "staged per node", "reads", "checkpoints write", "commits", "uploads",
                    "fits its jobs"], table,
                   ["jobs: one per time limit (its requeue) and per expected interruption; reads: the state and final "
                    "export a stage continues, or the exported weights and held-out samples an evaluation scores; "
                    "checkpoints write the whole training state each time; uploads: the checkpoint mirror and the "
                    "artifact on an S3 store; fits its jobs: a job holds a checkpoint interval (or a stop signal "
                    "saves one) and one checkpoint's scoring", orchestrator_note(spec),
                    "a run counts the same quantities in each step's resource ledger: compare with `compass status`"])


def evaluation_section(spec: TrainingSpec) -> Section | None:
    """Each evaluate step at the spec's size: checkpoints scored, one checkpoint's tokens and time, the jobs they
    take, against the evaluation phase's time limit (for GPU specs and specs whose evaluation jobs have a limit)."""
    how = spec.how
    limit = how.shape("evaluation").time_limit
    if how.hardware.accelerator == "cpu" and limit is None:
        return None
    rows = evaluation_costs(spec)
    if not rows:
        return None
    fits = f"fits {limit}" if limit else "fits (no time limit)"
    table = [[c.step, c.checkpoints, human(c.tokens), rough_duration(c.per_checkpoint_s), c.jobs,
              rough_duration(c.total_s), "yes" if c.fits else "NO"] for c in rows]
    notes = [f"forward FLOPs at {how.evaluation.assumed_mfu:.0%} of {how.hardware.peak:g} TFLOP/s "
             "(how.evaluation.assumed_mfu), the benchmarks over the evaluation phase's ranks; weights read at "
             f"{how.hardware.checkpoint_write_gbps:g} GB/s; {rough_duration(how.hardware.startup_estimate_s)} of "
             "start-up per job; each checkpoint's scores are kept as it is scored, so a job asked to stop ends "
             "between checkpoints and the next goes on"]
    if rows[0].unestimated:
        notes.append(f"not counted: {', '.join(rows[0].unestimated)} (lighteval's own tasks)")
    return Section("Evaluation (per evaluate step)", ["step", "checkpoints", "tokens each", "each", "jobs", "all",
                                                      fits], table, notes)


def placement_section(spec: TrainingSpec) -> Section:
    """Where each phase of the spec runs and on what: its shape (how.resources, defaults from how.hardware) and what
    its backend says it runs as."""

    how = spec.how
    placed = backends_of(how, phases_of(spec))
    rows = []
    for phase, backend in placed:
        shape = how.shape(phase)
        rows.append([phase.replace("_", " "), shape.nodes, shape.devices_per_node, shape.ranks,
                     shape.cpus_per_node or "-", f"{shape.memory_gb:g} GB" if shape.memory_gb else "-",
                     shape.time_limit or "-", backend.describe(how).runs_as])
    notes = [*dict.fromkeys(note for backend in one_of_each(placed) for note in backend.describe(how).notes),
             "steps that only read other steps' results (comparisons, curves, reports) run in the orchestrator"]
    devices = "GPUs" if how.hardware.accelerator != "cpu" else "ranks"
    return Section("Where each phase runs", ["phase", "nodes", f"{devices}/node", devices, "CPUs/node", "memory",
                                             "time limit", "runs as"], rows, notes)


def orchestration_section(spec: TrainingSpec) -> Section:
    """How the run treats its steps: how many at once, retries and time limits, the data steps' processes, and
    under a cluster what a job does near its time limit: settings that change no result, shown so that a run's
    behaviour under faults can be read before it starts."""
    orch = spec.how.orchestration
    limits = ", ".join(f"{kind} {seconds:,.0f} s" for kind, seconds in sorted(orch.step_timeouts.items()))
    default_limit = f"{orch.timeout_seconds:,.0f} s" if orch.timeout_seconds else "none"
    runner = ("Ray" + (f" at {orch.ray_address}" if orch.ray_address else ", started here")
              if orch.task_runner == "ray" else "threads of this process")
    described = [backend.describe(spec.how) for backend in one_of_each(backends_of(spec.how, phases_of(spec)))]
    placer = next((d.places_devices for d in described if d.places_devices), None)
    devices = (f"{placer} places the devices; `compass deploy` of this spec lets {orch.max_parallel_gpu_steps} "
               "device-holding steps run at once over all of a server's runs" if placer else
               f"{orch.max_parallel_gpu_steps} holding devices")
    rows = [["steps at once", f"{orch.max_parallel_steps} ({devices}), on {runner}"],
            ["retries", f"{orch.retries} per step, {orch.retry_delay_seconds:g} s apart (faults only: a data or "
                        "spec error fails at once)"],
            ["time limit per step", default_limit + (f"; {limits}" if limits else "")],
            ["data step processes", f"{orch.workers}" + (f" (a stage reading under {orch.in_process_below_mib:g} MiB, "
                                                          f"1/{CONTENT_BYTE_COST} of that for curation's filter and "
                                                          "MinHash passes, runs in its own process)"
                                                          if orch.in_process_below_mib else "")]]
    rows += [list(row) for row in dict.fromkeys(row for d in described for row in d.settings)]
    return Section("Orchestration", ["setting", "value"], rows, [])


def training_core_section(spec: TrainingSpec) -> Section:
    """How the training steps will run: attention kernel, loss kernel, compile, checkpoints, precision."""

    how = spec.how
    gpu = how.hardware.accelerator != "cpu"
    flash = flash_kernel()
    arch = spec.what.architecture
    fallback = DOCUMENT_SDPA if arch is not None and arch.dropout > 0 else \
        f"{DOCUMENT_VARLEN} (torch's varlen kernels)"  # varlen has no attention dropout
    if how.attention == "auto":
        attention = (f"{flash} (flash-attn installed here)" if gpu and flash else
                     f"flash-attention where flash-attn is installed on the GPU nodes, else {fallback}" if gpu
                     else DOCUMENT_SDPA)
    else:
        attention = {"flash": flash or "flash_attention_2 (flash-attn not installed here)",
                     "varlen": f"{DOCUMENT_VARLEN} (torch's varlen kernels on CUDA in bf16/fp16)",
                     "flex": "flex_attention", "sdpa": DOCUMENT_SDPA, "eager": "eager"}[how.attention]
    loss = {"auto": "liger fused linear cross-entropy where liger-kernel is installed on CUDA, else chunked"
                    if gpu else "chunked cross-entropy", "chunked": "chunked cross-entropy",
            "liger": "liger fused linear cross-entropy"}[how.loss]
    rows = [["attention", f"{how.attention}: {attention}"], ["loss", f"{how.loss}: {loss}"],
            ["compile", str(how.compile)], ["activation checkpointing", str(how.parallelism.activation_checkpointing)],
            ["precision", how.precision + (" (bf16 autocast on CUDA)" if how.precision == "bf16" else "")],
            ["gradients", "fp32" if how.precision == "fp32" else
             f"summed over micro-batches and reduced across ranks in {how.reduce_precision} (how.reduce_precision)"],
            ["checkpoints", f"every {how.checkpoints.every_steps} steps, keep {how.checkpoints.keep_last}, "
                            + ("written in the background" if how.checkpoints.asynchronous else "synchronous")
                            + ("; every export kept in the step's artifact until evaluated (evaluation."
                               "every_checkpoint): one copy of the weights each" if evaluates_every_export(spec)
                               else "")]]
    return Section("Training core", ["setting", "value"], rows,
                   ["packed documents are kept apart by position ids: no dense attention mask"])


def goodput_section(spec: TrainingSpec) -> Section:
    """Each training stage's predicted goodput: the causes a run's ledger measures (`compass status`, the step's
    manifest), predicted from the checkpoint cadence and how.hardware's reliability numbers."""

    hw = spec.how.hardware

    def share(seconds: float, total: float) -> str:
        return f"{rough_duration(seconds)} ({seconds / total:.1%})" if total > 0 else "-"

    rows = [[p.stage, rough_duration(p.compute_s), share(p.startup_s, p.total_s),
             f"{p.checkpoints:,}: " + share(p.checkpoint_s, p.total_s),
             f"{p.interruptions:.2g}" if p.interruptions >= 0.01 else "<0.01",
             share(p.restart_s, p.total_s), share(p.redone_s, p.total_s), f"{p.goodput:.1%}"]
            for p in predicted_splits(spec)]
    asynchronous = spec.how.checkpoints.asynchronous
    return Section("Goodput (predicted)", ["stage", "compute", "start-up", "checkpoints", "interruptions", "restarts",
                                           "redone", "goodput"], rows,
                   [(f"a checkpoint stalls for the copy of a rank's state to host memory (~{HOST_COPY_GBPS:g} GB/s)"
                     if asynchronous else "a checkpoint stalls for its whole write")
                    + f" at {hw.checkpoint_write_gbps:g} GB/s per node; {hw.node_failures_per_day:g} interruptions "
                    f"per node-day, each {rough_duration(hw.requeue_s)} to requeue, "
                    f"{rough_duration(hw.startup_estimate_s)} of start-up and half a checkpoint interval redone "
                    "(how.hardware); a run measures its own: `compass status`"])


def rough_duration(seconds: float) -> str:
    """An estimate's seconds in the largest unit that reads well: 45 s, 12 min, 3.2 h, 4.1 d (a run's measured
    times use flows/reports/progress.py's clock format)."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size * (2 if unit == "d" else 1):
            return f"{seconds / size:.2g} {unit}" if seconds / size < 100 else f"{seconds / size:,.0f} {unit}"
    return f"{seconds:.2g} s" if seconds >= 1 else "<1 s"


def evaluates_every_export(spec: TrainingSpec) -> bool:
    """Whether training steps keep their pruned checkpoints' exports for evaluation (tasks/common/training.py
    build_job's rule)."""
    return spec.how.evaluation.every_checkpoint


def fence_section(spec: TrainingSpec) -> Section | None:
    """The decontamination fence: what is indexed, what is scanned, and what a match does."""
    from compass.tasks.data.decontamination import SHORT_MIN

    if not needs_fence(spec):
        return None
    fence = spec.what.decontamination
    does = {"refuse": "a match stops the run before anything trains (every training step waits for the fence)",
            "remove": "matches are left out of the tokens and post-training examples, recorded in their lineage",
            "report": "matches are reported; training goes on"}[fence.policy]
    rows = [["benchmarks indexed", ", ".join(b.key for b in spec.what.evaluation.benchmarks)],
            ["n-grams", f"{fence.n_grams} words (shorter items whole, from {SHORT_MIN} words; problems item for item)"],
            ["sources scanned (train split)", ", ".join(trained_sources(spec)) or "none"],
            ["post-training scanned (what each step draws)",
             ", ".join(f"{p.name} ({p.dataset})" for p in fenced_post_training(spec)) or "none"],
            ["policy", f"{fence.policy}: {does}"]]
    return Section("Decontamination fence", ["what", "how"], rows, [])


def to_markdown(sections: list[Section]) -> str:
    out = []
    for s in sections:
        out.append(f"### {s.title}\n")
        out.append("| " + " | ".join(s.columns) + " |")
        out.append("|" + "---|" * len(s.columns))
        for row in s.rows:
            out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
        out.extend(f"\n_{n}_" for n in s.notes)
        out.append("")
    return "\n".join(out)


def print_sections(sections: list[Section], console: Any) -> None:
    """As rich tables; every value escaped (paths and names are data, never markup)."""

    for s in sections:
        table = Table(title=escape(s.title), title_justify="left", show_lines=False, header_style="bold")
        for c in s.columns:
            table.add_column(escape(c), overflow="fold")
        for row in s.rows:
            table.add_row(*[escape(str(c)) for c in row])
        console.print(table)
        for n in s.notes:
            console.print(f"  [dim]{escape(n)}[/dim]")
        console.print()


def sharding_advice(spec: TrainingSpec, device: float) -> str:
    """The playbook's rule (SmolLM3 kept ZeRO-0 at 384 GPUs: sharding costs throughput): the least sharding whose
    memory fits the device, and how the spec's choice compares. Never a stage validation refuses: DeepSpeed's ZeRO-0
    sums bf16 gradients in bf16, so with fp32 reduction (the recipe's) the least is ZeRO-1."""
    fitting = [z for z in range(4) if costs.memory_per_gpu(spec, z).total <= device]
    chosen = spec.how.parallelism.sharding_stage
    if not fitting:
        return ("no sharding fits: raise tensor_parallel, turn on activation_checkpointing or lower the micro-batch")
    least, why = fitting[0], ""
    if least == 0 and zero0_cannot_reduce_in_fp32(spec):  # less memory with more sharding: ZeRO-1 fits too
        precision = spec.how.precision
        least, why = 1, f" and reduces in fp32 (DeepSpeed's ZeRO-0 reduces {precision} gradients in {precision})"
    name = {0: "no sharding (ZeRO-0 / DDP)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 or FSDP2"}[least]
    if chosen == least:
        return f"recommended: {name}, the least sharding that fits{why}; the spec's choice"
    more = "more sharding than needed (costs throughput)" if chosen > least else "does not fit"
    return f"recommended: {name}, the least sharding that fits{why}; the spec's choice {more}"


def _one_seed_warning(spec: TrainingSpec) -> list[str]:
    """With one seed a comparison has no noise estimate: its verdicts say so rather than call a difference real."""
    ablations = spec.what.ablations
    if ablations is None or len(ablations.seeds) > 1:
        return []
    return [f"seeds: {ablations.seeds}: one seed gives no noise estimate, so no variant can be judged better or "
            "worse (its verdict says so); add seeds, e.g. [0, 1, 2], for a 95% interval paired by seed"]
