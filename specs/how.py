"""`how`: hardware, parallelism, precision, storage, orchestration and cadences."""

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from compass.specs.base import Issue, Loc, SpecModel, unused
from compass.specs.limits import MAX_PARALLEL, MAX_RETRIES

# What a byte of input costs a data pass that runs content filters, language id or MinHash signatures, against a
# pass that reads and writes it (measured on books_en's 3.4 MiB of shards: a copy 0.06 s/MiB, filters and language
# id 10 s/MiB, MinHash signatures 3.8 s/MiB): such a pass is worth a pool of workers from a few dozen KiB up
# (`in_process_below_mib`; tasks/kinds/curate.py weighs its passes by it).
CONTENT_BYTE_COST = 100

# What a `how` field does to a step's artifact, declared beside each field (every model below lists all of its own):
# results: it changes what the step produces (precision, kernels, compile, micro-batch, checkpoint cadence), so it
#   enters the fingerprint of the steps whose kind reads it (StepKind.reads_how); a change re-runs them;
# numerics: where the step runs, and with it the order of floating-point reductions (devices, ranks, ZeRO stage,
#   TP): never in the fingerprint, but the manifest records it and the plan says when a reused artifact was made
#   under another value;
# placement: where and how a step runs and is watched (nodes' addresses, paths, retries, monitoring), nothing more.
Identity = Literal["results", "numerics", "placement"]

Accelerator = Literal["cpu", "h100", "h200", "a100", "l40s"]
Precision = Literal["fp32", "bf16", "fp16"]

# Dense bf16 peak TFLOP/s per device, used for GPU-hours and MFU (CPU: measured at run time instead).
PEAK_TFLOPS: dict[str, float] = {"h100": 989.0, "h200": 989.0, "a100": 312.0, "l40s": 362.0, "cpu": 0.5}
MEMORY_GIB: dict[str, float] = {"h100": 80.0, "h200": 141.0, "a100": 80.0, "l40s": 48.0}  # cpu: this machine's


class Hardware(SpecModel):
    """The machines the run trains on, and the numbers the planner estimates time and cost with."""

    field_identity: ClassVar[dict[str, Identity]] = {
        "accelerator": "numerics", "devices_per_node": "numerics", "nodes": "numerics", "peak_tflops": "placement",
        "assumed_mfu": "placement", "hosts": "placement", "launcher": "placement", "cpus_per_node": "placement",
        "rendezvous_port": "placement", "internode_busbw_gbps": "placement", "target_days": "placement",
        "checkpoint_write_gbps": "placement", "node_failures_per_day": "placement", "requeue_s": "placement",
        "startup_s": "placement"}

    accelerator: Accelerator = Field(
        default="cpu", description="cpu, or the GPU model: steps then use CUDA, and the plan its peak TFLOP/s and "
                                   "memory.")
    devices_per_node: PositiveInt = Field(default=1, description="GPUs per node (ranks per node on CPU).")
    nodes: PositiveInt = Field(default=1, description="Nodes; pretraining, long context and mid-training use all of "
                                                      "them unless how.resources says otherwise.")
    peak_tflops: PositiveFloat | None = Field(default=None, description="Overrides the accelerator's table value.")
    assumed_mfu: float = Field(default=0.3, gt=0, le=1, description="Model FLOPs utilisation for cost estimates.")
    hosts: list[str] = Field(default_factory=list, description="One address per node; the first hosts the "
                             "rendezvous. Nodes share the code and the work folder at the same paths.")
    launcher: Literal["torchrun", "deepspeed"] = Field(
        default="torchrun", description="torchrun: compass starts one launcher per node (over ssh when remote); "
                                        "deepspeed: DeepSpeed's launcher on the first host with a hostfile (pdsh).")
    cpus_per_node: PositiveInt | None = Field(
        default=None, description="CPUs of a node a job may use (e.g. 88 of 96, the rest left to the system): the "
                                  "default of every phase's cpus_per_node. None: a job that takes every device of a "
                                  "node takes the whole node (--exclusive), others Slurm's default.")
    rendezvous_port: int = Field(default=29500, ge=1024, le=65535,
                                 description="Port of the ranks' rendezvous on the first host when a job spans "
                                             "several nodes (a single node takes a free port).")
    internode_busbw_gbps: PositiveFloat = Field(
        default=100.0, description="All-reduce bus bandwidth across nodes, GB/s (compass preflight measures it; "
                                   "~100 on 8x400 Gb/s InfiniBand or EFA): the planner's communication estimate.")
    target_days: PositiveFloat | None = Field(
        default=None, description="Wall time the run must fit in: `compass plan` says how many GPUs that takes.")
    checkpoint_write_gbps: PositiveFloat = Field(
        default=5.0, description="Write bandwidth of a node to the checkpoint storage, GB/s: the planner's checkpoint "
                                 "stalls (its predicted goodput).")
    node_failures_per_day: NonNegativeFloat = Field(
        default=0.004, description="Interruptions per node and day the planner expects (Llama 3's pretraining: 419 "
                                   "in 54 days on 2,048 nodes, ~0.004): its predicted restarts and redone work.")
    requeue_s: NonNegativeFloat = Field(
        default=600.0, description="Seconds from an interruption to the job running again (Slurm's requeue, a node "
                                   "replaced), for the predicted goodput.")
    startup_s: NonNegativeFloat | None = Field(
        default=None, description="Seconds from a job's start to its first step (imports, the process group, "
                                  "loading the checkpoint), for the predicted goodput. None: 180 on GPU nodes, 10 "
                                  "on CPU.")

    @property
    def total_devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def startup_estimate_s(self) -> float:
        if self.startup_s is not None:
            return self.startup_s
        return 10.0 if self.accelerator == "cpu" else 180.0

    @property
    def peak(self) -> float:
        return self.peak_tflops or PEAK_TFLOPS[self.accelerator]


class Parallelism(SpecModel):
    """How training is spread over the devices: the engine, what it shards, and the parallel sizes."""

    field_identity: ClassVar[dict[str, Identity]] = {
        "engine": "results", "deepspeed": "results", "engine_name": "results",  # engine_name: what the two decide
        "zero_stage": "numerics", "shard_group": "numerics", "data_parallel": "numerics",
        "tensor_parallel": "numerics", "pipeline_parallel": "numerics", "micro_batch_size": "results",
        "activation_checkpointing": "placement", "reshard_after_forward": "placement"}

    engine: Literal["deepspeed", "ddp", "fsdp2"] | None = Field(
        default=None, description="What trains the pretraining-like phases: DeepSpeed (ZeRO 0-3, AutoTP), torch DDP, "
        "or FSDP2 (torch's fully_shard per transformer block: parameters, gradients and optimizer states sharded "
        "over the data-parallel ranks, checkpoints written by every rank with torch.distributed.checkpoint). "
        "Default: deepspeed when `deepspeed` is true, else ddp.")
    deepspeed: bool = Field(default=True, description="Train with DeepSpeed (false: torch DDP); set from engine "
                                                      "when engine is given.")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=0, description="DeepSpeed's ZeRO stage: 1 shards optimizer states over the data-parallel ranks, 2 "
                               "also gradients, 3 also weights; 0 shards nothing. Multi-rank TRL steps use it too.")
    shard_group: PositiveInt | None = Field(
        default=None, description="FSDP2 only: shard over groups of this many data-parallel ranks and replicate "
        "across the groups (HSDP on a 2-D device mesh: set it to the GPUs of one node, so that the per-layer "
        "gathers stay inside the node and only gradient all-reduces cross nodes). Default: shard over all ranks.")
    data_parallel: PositiveInt = Field(
        default=1, description="Data-parallel ranks of pretraining; data x tensor x pipeline parallel must equal its "
                               "devices (other phases derive theirs from their own devices).")
    tensor_parallel: PositiveInt = Field(
        default=1, description="Ranks each layer is split over (DeepSpeed AutoTP or FSDP2); must divide num_heads "
                               "and num_kv_heads.")
    pipeline_parallel: PositiveInt = Field(
        default=1, description="Pipeline stages; only 1 is supported (a larger value is refused).")
    micro_batch_size: PositiveInt = Field(
        default=1, description="Sequences per rank per forward pass; micro-batches accumulate up to the global batch.")
    activation_checkpointing: bool = Field(
        default=False, description="Recompute each layer's activations in the backward pass: less memory, more "
                                   "compute (TRL steps too).")

    reshard_after_forward: bool = Field(
        default=True, description="FSDP2 only: free each block's gathered weights after its forward and gather them "
        "again for the backward (less memory), or keep them until the backward (one gather less per block per "
        "step, the memory of the whole model's weights).")

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_follows_the_engine(cls, data: Any) -> Any:
        """`engine` decides `deepspeed` (what the rest of the spec reads); both written must agree."""
        if not isinstance(data, dict) or data.get("engine") is None:
            return data
        wants = data["engine"] == "deepspeed"
        if "deepspeed" in data and bool(data["deepspeed"]) != wants:
            raise ValueError(f"engine {data['engine']} and deepspeed: {data['deepspeed']} disagree: remove deepspeed "
                             "(the engine decides it)")
        return {**data, "deepspeed": wants}

    @property
    def engine_name(self) -> str:
        return self.engine or ("deepspeed" if self.deepspeed else "ddp")

    def shard_ranks(self, data_parallel: int) -> int:
        """How many ranks one copy of the sharded states is spread over."""
        return min(self.shard_group or data_parallel, data_parallel)

    @property
    def sharding_stage(self) -> int:
        """What is sharded over data-parallel ranks, in ZeRO's terms: FSDP2 shards all three (as ZeRO-3)."""
        return 3 if self.engine_name == "fsdp2" else self.zero_stage if self.deepspeed else 0


SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr")
# folders that hold others' folders: never written into themselves (a store at /home would put its kind folders
# beside the users' homes), though a folder of one's own under them may be
SHARED_PARENTS = ("/home", "/root", "/opt", "/srv", "/var", "/mnt", "/media", "/tmp", "/scratch")


def spec_folder(info: ValidationInfo) -> Path | None:
    """The folder of the spec being validated (the loader passes it as the validation's context): where a relative
    path in it starts, in its checks as at its writes."""
    context = info.context if isinstance(info.context, dict) else {}
    base = context.get("base_dir")
    return Path(base) if base is not None else None


def system_folder_problem(folder: str, writes: str, base: Path | None = None) -> str | None:
    """Why compass may not write into `folder` at all: it resolves (links, `//x`, `/./x`, `x/..`) to the file
    system's root or into a system folder. `writes`: what would be written there, for the message."""
    path = os.path.realpath(os.path.join(base or os.getcwd(), os.path.expanduser(folder.removeprefix("file://"))))
    if path == "/" or any(path == f or path.startswith(f + "/") for f in SYSTEM_FOLDERS):
        shown = folder if path == folder else f"{folder} (that is {path})"
        return (f"{shown} is {'the file system root' if path == '/' else 'a system folder'}: {writes}; give a "
                "folder of its own")
    return None


def write_root_problem(folder: str, what: str = "a store", base: Path | None = None) -> str | None:
    """The one rule for every local folder compass writes under (a store, `--store`, a submitted store root, the
    monitoring folder, a tracker's database, a cluster's shared root): never the file system's root or a system
    folder, nor a folder that holds others' (/home, /tmp). Judged on the folder as the write will reach it: links
    followed, `//x`, `/./x` and `x/..` resolved. None: it may write there."""
    if problem := system_folder_problem(folder, f"{what} writes and deletes folders under it", base):
        return problem
    path = os.path.realpath(os.path.join(base or os.getcwd(), os.path.expanduser(folder.removeprefix("file://"))))
    if path in SHARED_PARENTS:
        shown = folder if path == folder else f"{folder} (that is {path})"
        return (f"{shown} holds other folders than compass's: {what} writes and deletes folders under it; give a "
                f"folder of its own, e.g. {path}/compass")
    return None


def tracking_folder(uri: str | None) -> str | None:
    """The local folder an MLflow tracking URI writes under (a sqlite database's folder, a file store), as written;
    None for a server. SQLAlchemy's sqlite URLs with any driver (sqlite+pysqlite:///...) and any number of
    slashes."""
    local = re.match(r"^(?:sqlite(?:\+\w+)?:///|file://|file:)(/*[^?#]*)", uri or "")
    if not (local and local.group(1)):
        return None
    return str(Path(local.group(1)).parent) if uri.startswith("sqlite") else local.group(1)


class Storage(SpecModel):
    """Where the artifacts live and how they are checked before use."""

    def root_at(self, base_dir: Path) -> str:
        """The store's root as a URI or an absolute folder: a relative one starts at the spec's folder
        (`base_dir`), as its sources and datasets do, so every command finds the same store wherever it runs."""
        if "://" in self.root:
            return self.root
        return str((base_dir / Path(self.root).expanduser()).resolve())

    field_identity: ClassVar[dict[str, Identity]] = {
        "root": "placement", "credentials_block": "placement", "local_cache": "placement",
        "local_cache_gib": "placement", "verify": "placement", "shard_index_above": "placement",
        "on_damage": "placement", "input_stamps": "placement"}

    root: str = Field(default="store", description="Local folder or s3://bucket/prefix for every artifact. A "
                      "relative folder starts at the spec's folder, like every path in a spec (`store`: beside the "
                      "spec), wherever compass runs from.")
    credentials_block: str | None = Field(
        default=None, description="Prefect Secret block holding {aws_access_key_id, aws_secret_access_key, "
                                  "endpoint_url, region_name, aws_session_token}; otherwise the environment's.")
    local_cache: str | None = Field(
        default=None, description="A node-local folder (NVMe, /scratch): before training, each node copies the "
                                  "token shards its ranks' rows read (and every source's small files) there, "
                                  "verified against their manifests, and the "
                                  "trainer reads only from there (a shared file system evicting shards cannot "
                                  "stall it); a verified copy is reused.")
    local_cache_gib: PositiveFloat | None = Field(
        default=None, description="The capacity of each node's local_cache folder (GiB): validation refuses a "
                                  "step whose nodes would copy more (compass plan's staging table), and staging "
                                  "removes the least recently used earlier copies there to make room for a step's "
                                  "own, checking the disk's free space before it copies.")
    verify: Literal["sizes", "stamped", "full"] = Field(
        default="stamped",
        description="How a cached artifact or a step's input is checked against its manifest before use: "
                    "'stamped' hashes a file again only when its size, mtime or inode changed since it was last "
                    "hashed; 'full' hashes every file every time; 'sizes' compares the file list and sizes only.")
    shard_index_above: PositiveInt = Field(
        default=1000,
        description="A top-level folder of an artifact with more files than this (token or document shards) is "
                    "listed in a sidecar index, `<folder>.shards.jsonl` (path, size, sha256 per file), that the "
                    "manifest names with the folder's file count, bytes and the index's sha256: manifests stay "
                    "small at a million shards. Checks then compare every such file's size and hash a fresh random "
                    "sample of 32 per folder ('full' hashes them all).")
    input_stamps: Literal["listing", "content"] = Field(
        default="listing",
        description="How the files a spec names outside the store (local sources, post-training datasets, local "
                    "tokenizers) are stamped into the identity of the steps that read them: 'listing' by their "
                    "paths, sizes and modification times (a touched file runs its steps again); 'content' by their "
                    "sha256 (each file hashed again only when its size, mtime or inode changed), so a touched file "
                    "with the same bytes does not. Switching it stamps every such file anew: their steps run once "
                    "more. s3:// prefixes are stamped by their ETags either way.")
    on_damage: Literal["recompute", "stop"] = Field(
        default="recompute",
        description="A cached artifact altered after its commit is set aside and recomputed, or stops the run "
                    "(`compass run --no-recompute`) so it can be inspected first.")

    @field_validator("root")
    @classmethod
    def _not_a_system_folder(cls, root: str, info: ValidationInfo) -> str:
        """The store writes, locks and sets aside folders under its root: never `/` or the system's own folders."""
        if "://" in root and not root.startswith("file://"):
            return root
        problem = write_root_problem(root, base=spec_folder(info))
        if problem:
            raise ValueError(problem + " (e.g. store)")
        return root

    @field_validator("local_cache")
    @classmethod
    def _staging_not_a_system_folder(cls, folder: str | None, info: ValidationInfo) -> str | None:
        """Each node copies token shards into it and evicts copies from it: the write rule of every root."""
        problem = write_root_problem(folder, "node-local staging", base=spec_folder(info)) if folder else None
        if problem:
            raise ValueError(problem)
        return folder


SLURM_WORD = r"^[A-Za-z0-9_][A-Za-z0-9_.,:@%+=\[\]-]{0,200}$"  # one sbatch value: no spaces, no leading '-'
SLURM_TIME = r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$"  # sbatch --time: minutes, H:MM:SS or D-HH:MM:SS


def slurm_seconds(limit: str) -> float:
    """sbatch's --time in seconds: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes or days-hours:minutes:seconds (sbatch(1))."""
    days, _, clock = limit.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 3:
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]
    return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)


class SlurmCluster(SpecModel):
    """Every step that computes runs as a Slurm job of its phase's shape (how.resources); the orchestrating
    `compass run` only plans, submits, follows and commits. With `requeue`, a job is submitted with --requeue and a
    signal `signal_before_s` before its time limit: the trainer checkpoints and the job requeues itself; a
    requeued or node-failed job resumes from its newest checkpoint, and the step follows the same job id, also
    from a new `compass run` after the first one died."""

    field_identity: ClassVar[dict[str, Identity]] = {
        name: "placement" for name in ("kind", "shared_root", "launch", "partition", "account", "qos", "constraint",
                                       "exclude", "time_limit", "requeue", "signal_before_s", "poll_seconds",
                                       "probe_timeout_s", "probe_valid_hours")}

    kind: Literal["slurm"] = "slurm"
    shared_root: str | None = Field(
        default=None, description="A folder every node mounts at the same path (Lustre, GPFS, NFS, FSx): the "
                                  "steps' work folders (checkpoints, logs), staging and input copies live there. "
                                  "Required with a cluster; `compass plan` proves the nodes see it with a probe job.")
    launch: Literal["srun", "torchrun"] = Field(
        default="srun", description="How a job starts its ranks: srun, one Slurm task per rank bound to its GPU and "
                                    "an equal share of the node's CPUs; torchrun, one task per node that starts the "
                                    "node's ranks and shares the node's CPUs among them.")
    partition: str | None = Field(default=None, pattern=SLURM_WORD,
                                  description="Slurm partition of every job (None: the cluster's default).")
    account: str | None = Field(default=None, pattern=SLURM_WORD,
                                description="Slurm account jobs are charged to (None: the user's default).")
    qos: str | None = Field(default=None, pattern=SLURM_WORD,
                            description="Slurm quality of service of every job (None: the default).")
    constraint: str | None = Field(default=None, pattern=SLURM_WORD, description="Node features, e.g. h100.")
    exclude: list[str] = Field(default_factory=list, description="Nodes to avoid (compass preflight names them).")
    time_limit: str | None = Field(default=None, pattern=SLURM_TIME,
                                   description="Slurm's --time of every job (a phase's own time_limit wins): minutes, "
                                               "H:MM:SS or D-HH:MM:SS.")
    requeue: bool = Field(
        default=True, description="Submit with --requeue and a USR1 signal before the time limit, so a job "
                                  "checkpoints and requeues itself; false: --no-requeue.")
    signal_before_s: PositiveInt = Field(default=120, le=3600, description="USR1 this long before the time limit.")
    poll_seconds: PositiveFloat = Field(default=5, le=300, description="How often the step reads the job's state.")
    probe_timeout_s: PositiveInt = Field(
        default=120, le=3600, description="How long `compass plan` waits for its probe job to start on a compute node "
                                          "before it gives up (a busy queue).")
    probe_valid_hours: PositiveFloat = Field(
        default=24, le=24 * 30, description="How long a passed shared-root probe answers for the same question "
        "(cluster, partition, GPU, paths, Python); after that it is asked again, unless a job of this user is "
        "running on that partition from a work folder under shared_root: a live run is its own proof, so a "
        "compass run that comes back to follow it needs no free node.")

    @field_validator("shared_root")
    @classmethod
    def _a_folder_of_its_own(cls, root: str | None) -> str | None:
        """Every node mounts it at the same path: an absolute one, and never `/` or a system folder (work folders,
        staging and the probe's file are written under it)."""
        if root is None:
            return root
        if not os.path.isabs(os.path.expanduser(root)):
            raise ValueError(f"{root} is relative: every node must find it at the same path; give an absolute one "
                             "(e.g. /fsx/compass)")
        problem = write_root_problem(root, "a cluster's run")
        if problem:
            raise ValueError(problem)
        return root

    @field_validator("exclude")
    @classmethod
    def _node_names(cls, nodes: list[str]) -> list[str]:
        bad = [n for n in nodes if not re.fullmatch(SLURM_WORD, n)]
        if bad:
            raise ValueError(f"not node names: {bad} (letters, digits and ._-[], no spaces, no leading '-')")
        return nodes


Phase = Literal["data", "ablation", "pretraining", "long_context", "mid_training", "post_training", "evaluation"]
PHASES: tuple[Phase, ...] = ("data", "ablation", "pretraining", "long_context", "mid_training", "post_training",
                             "evaluation")
TRAINING_PHASES: tuple[Phase, ...] = ("pretraining", "long_context", "mid_training")  # they default to how.hardware


class PhaseShape(SpecModel):
    """Where one phase's steps run. Unset fields take their defaults from `how.hardware`: pretraining, long context
    and mid-training its nodes and devices; ablations one node of its devices; post-training and evaluation one
    device (TRL and lighteval run one process); the data phase no device."""

    field_identity: ClassVar[dict[str, Identity]] = {
        "nodes": "numerics", "devices_per_node": "numerics", "cpus_per_node": "placement", "memory_gb": "placement",
        "time_limit": "placement", "partition": "placement"}

    nodes: PositiveInt | None = Field(default=None, description="Nodes per job of the phase (default: "
                                      "how.hardware.nodes for pretraining, long context and mid-training, else 1).")
    devices_per_node: NonNegativeInt | None = Field(
        default=None, description="GPUs per node (ranks per node on CPU), each one rank of the phase's steps.")
    cpus_per_node: PositiveInt | None = Field(
        default=None, description="CPUs per node for the phase's jobs (default how.hardware.cpus_per_node); a data "
                                  "step's datatrove workers.")
    memory_gb: PositiveFloat | None = Field(default=None, description="Memory per node (Slurm's --mem).")
    time_limit: str | None = Field(default=None, pattern=SLURM_TIME,
                                   description="Slurm's --time for the phase's jobs (default cluster.time_limit).")
    partition: str | None = Field(
        default=None, pattern=SLURM_WORD,
        description="Slurm partition of the phase's jobs (default cluster.partition), e.g. a CPU partition for the "
                    "data phase where the GPU partition takes only jobs that ask for GPUs.")


class Resources(SpecModel):
    """Per-phase shapes, e.g. long context on 3 nodes while pretraining takes 48, ablations on 1, evaluation on
    one GPU."""

    data: PhaseShape = Field(
        default=PhaseShape(), description="Ingest, curation, tokenizer selection, tokenization and copies of "
                                          "starting models (no device).")
    ablation: PhaseShape = Field(default=PhaseShape(), description="Ablation runs (one node of how.hardware's "
                                                                   "devices).")
    pretraining: PhaseShape = Field(default=PhaseShape(), description="Pretraining stages (how.hardware).")
    long_context: PhaseShape = Field(default=PhaseShape(), description="Long-context stages (how.hardware).")
    mid_training: PhaseShape = Field(default=PhaseShape(), description="Mid-training steps (how.hardware).")
    post_training: PhaseShape = Field(default=PhaseShape(), description="TRL steps (one device unless set).")
    evaluation: PhaseShape = Field(default=PhaseShape(), description="Evaluations and gates (one device).")


@dataclass(frozen=True)
class Shape:
    """A phase's resolved shape: what one of its steps' jobs asks for, and how many ranks it trains on."""

    phase: Phase
    nodes: int
    devices_per_node: int  # GPUs (ranks on CPU); 0 for the data phase
    cpus_per_node: int | None  # None: the whole node when the job takes all of its devices, else Slurm's default
    memory_gb: float | None
    time_limit: str | None
    whole_nodes: bool  # the job takes every device of its nodes: ask Slurm for them exclusively
    partition: str | None = None  # the phase's Slurm partition (None: the cluster's default)

    @property
    def ranks(self) -> int:
        return self.nodes * self.devices_per_node


class Orchestration(SpecModel):
    """How the plan's steps run: retries and timeouts, the task runner, an optional Slurm cluster, and how many
    steps run at once."""

    field_identity: ClassVar[dict[str, Identity]] = {
        name: "placement" for name in ("retries", "retry_delay_seconds", "timeout_seconds", "step_timeouts",
                                       "task_runner", "ray_address", "ray_num_cpus", "workers", "in_process_below_mib",
                                       "max_parallel_steps", "max_parallel_gpu_steps")}

    retries: int = Field(default=1, ge=0, le=MAX_RETRIES, description="Times a failed step is retried (faults "
                         "only: a data or spec error fails at once); under a cluster with requeue, also the times a "
                         "job requeues itself for a retriable fault in any 24 hours of its life.")
    retry_delay_seconds: float = Field(default=10, ge=0, description="Seconds to wait before a retry.")
    timeout_seconds: PositiveFloat | None = Field(default=None, description="Per-step limit (none = no limit).")
    step_timeouts: dict[str, PositiveFloat] = Field(
        default_factory=dict, description="Per-kind overrides, e.g. {pretrain: 86400}."
    )
    task_runner: Literal["local", "ray"] = Field(
        default="local", description="local: steps run on threads of this process; ray: Prefect's Ray task runner "
                                     "(needs a Prefect server).")
    ray_address: str | None = Field(default=None, description="An existing Ray cluster (None = start one locally).")
    ray_num_cpus: PositiveInt | None = Field(default=None, description="CPUs of a locally started Ray (None = all).")
    workers: PositiveInt = Field(default=2, le=MAX_PARALLEL, description="Processes a data step may use.")
    in_process_below_mib: NonNegativeFloat = Field(
        default=4, description="A local data stage with less input than this runs its datatrove ranks one after "
                               "another in the step's own process: starting a pool of workers costs more than such "
                               "work. A byte read by content filters, language id or MinHash signatures counts "
                               f"{CONTENT_BYTE_COST} (curation's costly passes get a pool from a few dozen KiB). The "
                               "ranks and their shards are the same either way. 0: always a pool of `workers`.")
    max_parallel_steps: PositiveInt = Field(default=2, le=MAX_PARALLEL, description="Steps running at once.")
    cluster: SlurmCluster | None = Field(
        default=None, description="Run every step that computes as a Slurm job (None: on this machine, in this "
                                  "process or launched with torchrun/deepspeed per how.hardware).")

    @property
    def shared_root(self) -> str | None:
        """Where the steps' work folders live: the cluster's shared root (None: beside the store)."""
        return self.cluster.shared_root if self.cluster else None
    max_parallel_gpu_steps: PositiveInt = Field(
        default=1, le=MAX_PARALLEL, description="Steps that use the accelerator (training, evaluation) running at "
                                                "once in one process: they would compete for one device."
    )


class Checkpoints(SpecModel):
    """When training steps checkpoint, and how many checkpoints they keep."""

    field_identity: ClassVar[dict[str, Identity]] = {
        # the artifact of a training step holds its kept, exported checkpoints: what every-checkpoint evaluation scores
        "every_steps": "results", "keep_last": "results", "hf_export_every": "results", "asynchronous": "placement",
        "every_minutes": "placement"}

    every_steps: PositiveInt = Field(default=1000, description="Optimizer steps between checkpoints (a stage's last "
                                                               "step is always saved); TRL steps save at it too.")
    keep_last: PositiveInt = Field(default=2, description="Newest checkpoints kept in a step's work folder (a "
                                                          "stage's last is also kept). With "
                                                          "evaluation.every_checkpoint, an older one's training state "
                                                          "is deleted but its Hugging Face export is kept, in the "
                                                          "step's artifact, until it is evaluated.")
    every_minutes: PositiveFloat | None = Field(
        default=None, le=10080, description="TRL post-training steps also save whenever this long has passed since "
        "their last save (their checkpoints only resume the step: the artifact keeps the final weights), so a step "
        "whose optimizer steps are long saves before its job's time limit whatever every_steps says; a job asked "
        "to stop near its limit saves and requeues either way. None: by every_steps alone.")
    asynchronous: bool = Field(default=True, description="Copy the state to host memory and write it on a "
                               "background thread while training goes on (at most one write in flight).")
    hf_export_every: PositiveInt | None = Field(
        default=None, description="A Hugging Face export (rank 0 gathers the whole model) in every k-th checkpoint "
        "and the stage's last; the sharded training state is saved at every checkpoint. None: every checkpoint "
        "for models under 1B parameters, every 10th above (gathering 3B weights on one rank at every checkpoint "
        "stalls the step). Evaluations and checkpoint events see the exported checkpoints.")


class EvaluationCadence(SpecModel):
    """When checkpoints are evaluated besides each model step's final weights."""

    field_identity: ClassVar[dict[str, Identity]] = {
        "every_checkpoint": "results", "schedule_cron": "placement", "schedule_interval_seconds": "placement",
        "assumed_mfu": "placement"}

    every_checkpoint: bool = Field(
        default=True, description="Also evaluate every exported checkpoint of each evaluated training step (the "
                                  "evaluation curves against tokens): keep_last then never deletes an export before "
                                  "it is evaluated (the step's artifact keeps them all: one bf16 copy of the weights "
                                  "per export, see compass plan); with compass deploy and "
                                  "monitoring.checkpoint_events, each committed checkpoint as it comes.")
    schedule_cron: str | None = Field(
        default=None, description="Cron schedule on which compass evaluate-schedule (or compass deploy) evaluates new "
                                  "checkpoints in the store (None: none).")
    schedule_interval_seconds: PositiveInt | None = Field(
        default=None, description="The same schedule as an interval in seconds (set one of the two).")
    assumed_mfu: float = Field(
        default=0.15, gt=0, le=1, description="FLOPs utilisation of scoring, for the plan's evaluation times: "
        "lighteval's transformers backend runs padded log-likelihood batches of short requests, below "
        "training's utilisation. `compass plan` holds one checkpoint's predicted scoring against the evaluation "
        "phase's time limit and refuses a limit it cannot fit in.")


Tracker = Literal["tensorboard", "mlflow", "wandb", "trackio"]


class Monitoring(SpecModel):
    """Watching a run while it trains: a Prometheus endpoint on every training rank (registered for Prometheus's
    file service discovery), a run per step in each experiment tracker, and the Prefect UI's live progress and
    loss plot. `compass monitor SPEC` starts a Prometheus that reads the endpoints and the shipped alert rules."""

    field_identity: ClassVar[dict[str, Identity]] = {
        name: "placement" for name in ("prometheus", "listen", "port", "trackers", "mlflow_tracking_uri", "wandb_mode",
                                       "project", "progress_every_s", "plot_every_s", "checkpoint_events",
                                       "hang_timeout_s", "folder")}

    prometheus: bool = Field(default=True, description="Serve a Prometheus metrics endpoint on every training rank.")
    listen: str = Field(default="127.0.0.1", pattern=r"^[0-9a-fA-F.:]+$",
                        description="Address the ranks' endpoints bind (an IP; loopback unless set).")
    port: int | None = Field(default=None, ge=1024, le=65000,
                             description="Port of each node's first rank; rank r of a node uses port + r. None: a "
                                         "free port per rank (the service-discovery files say which).")
    trackers: list[Tracker] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers every training, post-training and evaluation step reports to: one run per "
                    "step, named after it and grouped by the spec's run (name and hash), with the step's config and "
                    "the spec hash as parameters and every metric against tokens seen. tensorboard: event files "
                    "under the monitoring folder; mlflow: the server at mlflow_tracking_uri; wandb: Weights & "
                    "Biases (wandb_mode); trackio: trackio's local database (TRACKIO_DIR).")
    mlflow_tracking_uri: str | None = Field(
        default=None, description="The MLflow tracking server (http://host:5000) when trackers lists mlflow; "
                                  "None: MLFLOW_TRACKING_URI of the environment the steps run in.")
    wandb_mode: Literal["offline", "online"] = Field(
        default="offline", description="offline: W&B run folders under the monitoring folder's wandb/, sent later "
                                       "with `wandb sync`; online: streamed live (needs WANDB_API_KEY).")
    project: str | None = Field(default=None, min_length=1, max_length=120, description="The trackers' project "
                                "(MLflow experiment, W&B and trackio project); None: the spec's name.")
    progress_every_s: PositiveFloat = Field(default=10, le=3600, description="How often a running training "
                                            "step logs its progress line and updates its Prefect progress "
                                            "artifact (reading only the metrics written since).")
    plot_every_s: PositiveFloat = Field(default=300, le=86400, description="How often a running training step "
                                        "publishes a new version of its live loss plot (a Prefect artifact, at "
                                        "most a few hundred points however long the run): a few minutes keeps a "
                                        "weeks-long run to a few thousand versions.")
    checkpoint_events: bool = Field(default=True, description="Emit a Prefect event for each committed "
                                    "checkpoint (compass deploy's automation evaluates it).")
    hang_timeout_s: float = Field(default=900, ge=10, le=86400, description="A training rank whose step has not "
                                  "ended for this long (a collective waiting on a stuck or dead peer) dumps every "
                                  "thread's stack to the step's log, naming its rank and node, and exits non-zero "
                                  "for a retry from the newest checkpoint; the first step after a start or a "
                                  "rollback gets 3x. The process group's own timeout is four times this.")
    folder: str | None = Field(default=None, description="Where targets/, tensorboard/, wandb/ and Prometheus's data "
                               "live (default: monitoring/<spec name> inside a local store, else under "
                               "~/.cache/compass).")

    @field_validator("trackers")
    @classmethod
    def _each_tracker_once(cls, trackers: list[str]) -> list[str]:
        twice = sorted({t for t in trackers if trackers.count(t) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed twice: name each tracker once")
        return trackers

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _mlflow_server(cls, uri: str | None, info: ValidationInfo) -> str | None:
        if uri is not None and not re.match(r"^(https?|databricks|sqlite|postgresql|mysql|file)[:+]", uri):
            raise ValueError(f"{uri!r} is not an MLflow tracking URI: give the server as http://host:5000")
        folder = tracking_folder(uri)
        problem = write_root_problem(folder, "MLflow", base=spec_folder(info)) if folder else None
        if problem:
            raise ValueError(problem)
        return uri

    @field_validator("folder")
    @classmethod
    def _monitoring_folder(cls, folder: str | None, info: ValidationInfo) -> str | None:
        problem = write_root_problem(folder, "monitoring", base=spec_folder(info)) if folder else None
        if problem:
            raise ValueError(problem)
        return folder


AttentionBackend = Literal["auto", "flash", "varlen", "flex", "sdpa", "eager"]
LossKernel = Literal["auto", "chunked", "liger"]


class How(SpecModel):
    """How the run executes: hardware, per-phase resources, parallelism, precision, storage, orchestration,
    checkpoints, evaluation cadence and monitoring."""

    field_identity: ClassVar[dict[str, Identity]] = {
        "precision": "results", "reduce_precision": "results", "attention": "results", "compile": "results",
        "loss": "results", "generation": "results"}  # its sections classify their own fields

    hardware: Hardware = Field(default=Hardware(), description="Accelerator, nodes and devices, and the launch.")
    resources: Resources = Field(default=Resources(), description="Per-phase nodes, devices, CPUs, memory and time "
                                                                  "limits.")
    parallelism: Parallelism = Field(default=Parallelism(), description="Training engine, sharding and parallel "
                                                                        "sizes.")
    precision: Precision = Field(
        default="fp32", description="Training precision: fp32, bf16 mixed precision, or fp16 (DeepSpeed); CPU trains "
                                    "in fp32 only.")
    reduce_precision: Precision = Field(
        default="fp32", description="Under bf16 or fp16 training, the dtype gradients are summed over micro-batches "
        "and reduced across data-parallel ranks in: fp32 (the SmolLM3 and nanotron recipe; DeepSpeed from ZeRO-1 up, "
        "FSDP2's reduce_dtype, DDP's own fp32 gradients), or the training precision itself (half the bytes on the "
        "wire, a rounding error per sum that grows with the data-parallel size). fp32 training reduces in fp32.")
    attention: AttentionBackend = Field(
        default="auto", description="Packed-document attention: flash (flash-attn varlen, CUDA), varlen (torch's "
        "own varlen Flash kernels on CUDA in bf16/fp16, a per-document reference elsewhere; compiles without graph "
        "breaks), flex (FlexAttention, CUDA for training), sdpa (compass's per-document SDPA, memory-linear), eager "
        "(reference); auto = flash where installed, else varlen on CUDA, else sdpa.")
    compile: bool = Field(default=False, description="torch.compile the model (inductor; CPU and CUDA).")
    loss: LossKernel = Field(
        default="auto", description="chunked (cross-entropy a chunk of tokens at a time, no full fp32 logits) or "
        "liger (Liger's fused linear cross-entropy, CUDA); auto = liger where installed, else chunked.")
    generation: Literal["transformers", "vllm"] = Field(
        default="transformers", description="What generates GRPO's rollouts and runs lighteval: transformers, or "
        "vLLM on GPU nodes (colocated with the trainer for GRPO; the vllm package on the nodes).")
    storage: Storage = Field(default=Storage(), description="Where artifacts are stored and how they are checked.")
    orchestration: Orchestration = Field(default=Orchestration(), description="Retries, timeouts, task runner, "
                                                                              "cluster and concurrency.")
    checkpoints: Checkpoints = Field(default=Checkpoints(), description="Checkpoint cadence and retention.")
    evaluation: EvaluationCadence = Field(default=EvaluationCadence(), description="When checkpoints are evaluated.")
    monitoring: Monitoring = Field(default=Monitoring(), description="Metrics endpoints, experiment trackers and "
                                                                     "progress reports.")

    @property
    def stop_lead_s(self) -> float:
        """How long before its time limit a job is asked to stop (cluster.signal_before_s; 0 without a cluster)."""
        cluster = self.orchestration.cluster
        return float(cluster.signal_before_s) if cluster is not None and cluster.requeue else 0.0

    def shape(self, phase: Phase) -> Shape:
        """The phase's shape with every default filled in (see PhaseShape)."""
        given: PhaseShape = getattr(self.resources, phase)
        hw = self.hardware
        nodes = given.nodes or (hw.nodes if phase in TRAINING_PHASES else 1)
        default_devices = {"data": 0, "post_training": 1, "evaluation": 1}.get(phase, hw.devices_per_node)
        devices = given.devices_per_node if given.devices_per_node is not None else default_devices
        cluster = self.orchestration.cluster
        cpus = given.cpus_per_node or hw.cpus_per_node or (self.orchestration.workers if phase == "data" else None)
        limit = cluster.time_limit if cluster else None
        return Shape(phase=phase, nodes=nodes, devices_per_node=devices, cpus_per_node=cpus,
                     memory_gb=given.memory_gb, time_limit=given.time_limit or limit,
                     whole_nodes=devices > 0 and devices >= hw.devices_per_node,
                     partition=given.partition or (cluster.partition if cluster else None))

    def data_parallel(self, phase: Phase) -> int:
        """Data-parallel ranks of a training phase: its ranks over tensor x pipeline parallelism."""
        par = self.parallelism
        return max(1, self.shape(phase).ranks // (par.tensor_parallel * par.pipeline_parallel))


def how_rules(how: How, at: Loc = ("how",)) -> Iterator[Issue]:
    """Rules inside `how` alone: fields that apply only to a task runner or a requeue, one evaluation schedule."""
    orch = how.orchestration
    where = (*at, "orchestration")
    ray = orch.task_runner == "ray"
    yield from unused(orch, "ray_address", where, ray, "only task_runner: ray joins a Ray cluster")
    yield from unused(orch, "ray_num_cpus", where, ray and orch.ray_address is None,
                       "only a Ray that compass starts itself takes a CPU count")
    if orch.cluster is not None:
        yield from unused(orch.cluster, "signal_before_s", (*where, "cluster"), orch.cluster.requeue,
                           "only a job that requeues itself is signalled before its time limit (requeue: false)")
    yield from unused(how.storage, "local_cache_gib", (*at, "storage"), how.storage.local_cache is not None,
                      "only a local_cache folder has a capacity to check")
    ev = how.evaluation
    if ev.schedule_cron and ev.schedule_interval_seconds:
        yield Issue((*at, "evaluation"), "both schedule_cron and schedule_interval_seconds are set",
                    "choose one schedule")
