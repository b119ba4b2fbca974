"""Where things are: every file and folder name inside an artifact and inside a step's work folder, spelled
here and nowhere else (tests/test_architecture.py checks it). Readers and writers both go through these views,
so a layout change is one edit and a reader can never look for a name no writer uses."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

CHECKPOINT_PREFIX = "step-"
CHECKSUMS = "checksums.json"  # written last into a checkpoint folder: its commit marker
_CHECKPOINT_NAME = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)")
TRAIN, HELDOUT = "train", "heldout"  # the curated splits: what training reads, what evaluation holds out
SPLITS = (TRAIN, HELDOUT)
DOCUMENTS = "documents"  # an ingest artifact's folder of document shards
SHARD_SUFFIX = ".jsonl.zst"  # a document shard: JSONL compressed with zstd (tasks/data/curate_blocks.py ShardWriter)
FINAL = "final"  # the name of a model's final weights where a checkpoint name is expected (`final` in a spec)
# a Hugging Face tokenizer folder (the chat template is its own file in transformers 5)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
REQUIRED_TOKENIZER_FILES = TOKENIZER_FILES[:1]  # without it the export loads in nothing
COMPARISON = "comparison.json"  # a tokenizer selection's, or the ablations' comparison of variants
METRICS = "metrics.jsonl"  # a model artifact's (and a training work folder's) one line per optimizer step
CHECKPOINTS = "checkpoints"  # a model artifact's kept checkpoints, each a Hugging Face folder `step-<N>`
STATE = "state"  # a model artifact's full training state, what its next stage continues from
# what a phase that continues a model reads of its artifact: the training state, the final export (its config, the
# weights a post-training starts from and the rank checks compare with) and the history. Never the kept checkpoints
# and their exports: at SmolLM3's size ~1 TB per stage, copied whole from S3 at each stage transition before.
CONTINUED_PARTS = (STATE, FINAL, METRICS)
WEIGHTS = "model.safetensors"  # a Hugging Face folder's weights as compass exports them (one file)


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name (`step-00000120` -> 120); None for any other name."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class ModelArtifact:
    """A model step's artifact (base model, pretraining, long context, mid-training, post-training)."""

    root: Path

    @property
    def final(self) -> Path:
        """The Hugging Face folder of the final weights: config, safetensors, tokenizer."""
        return self.root / FINAL

    @property
    def state(self) -> Path:
        """The full training state (weights, optimizer, scheduler, data position) the next stage continues from."""
        return self.root / STATE

    @property
    def checkpoints(self) -> Path:
        """Every kept checkpoint, each a Hugging Face folder named `step-<N>`."""
        return self.root / CHECKPOINTS

    @property
    def metrics(self) -> Path:
        """One JSON line per optimizer step over every stage so far (model/training/records.py: MetricsRow)."""
        return self.root / METRICS

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def adapter(self) -> Path:
        """A LoRA/QLoRA adapter beside the merged weights."""
        return self.root / "adapter"

    @property
    def pairs(self) -> Path:
        return self.root / "pairs.jsonl"

    @property
    def sft_samples(self) -> Path:
        return self.root / "sft_samples.jsonl"

    @property
    def vibe_check(self) -> Path:
        return self.root / "vibe_check.md"

    @property
    def vibe_answers(self) -> Path:
        return self.root / "vibe_check.json"

    @property
    def tokenizer(self) -> Path:
        """A starting checkpoint's own tokenizer (the base model step keeps it where a tokenizer step would)."""
        return TokenizerArtifact(self.root).chosen

    @staticmethod
    def kept_weights(relative: str) -> str | None:
        """The checkpoint's name when `relative` (a file of the artifact) is the weights of a kept checkpoint."""
        parts = relative.split("/")
        if len(parts) == 3 and parts[0] == "checkpoints" and parts[2] == WEIGHTS and checkpoint_step(parts[1]):
            return parts[1]
        return None

    @staticmethod
    def holds_weights(relative: str) -> bool:
        """Whether `relative` (a file of the artifact) is the weights of a Hugging Face folder in it (`final/` or
        a kept checkpoint; the training state's are not)."""
        return relative.endswith(f"/{WEIGHTS}") and not relative.startswith("state/")

    def kept_checkpoints(self) -> list[Path]:
        """The kept checkpoints' folders, oldest first."""
        folder = self.checkpoints
        found = [p for p in folder.iterdir() if checkpoint_step(p.name) is not None] if folder.is_dir() else []
        return sorted(found, key=lambda p: checkpoint_step(p.name) or 0)

    def continues_from(self) -> tuple[Path | None, Path | None]:
        """(training state, weights) a next stage starts from: the state when the artifact has one, else the final
        weights (a starting checkpoint, a post-trained model)."""
        return (self.state, None) if self.state.exists() else (None, self.final)


@dataclass(frozen=True)
class TokenizerArtifact:
    root: Path

    @property
    def chosen(self) -> Path:
        """The chosen tokenizer, a Hugging Face tokenizer folder."""
        return self.root / "chosen"

    @property
    def candidates(self) -> Path:
        return self.root / "candidates"

    @property
    def comparison(self) -> Path:
        return self.root / COMPARISON


@dataclass(frozen=True)
class CuratedArtifact:
    """A curated source: gzipped JSONL shards per split, and curation statistics."""

    root: Path

    def split(self, name: str) -> Path:
        if name not in SPLITS:
            raise ValueError(f"no split '{name}' (splits: {', '.join(SPLITS)})")
        return self.root / name

    @property
    def stats(self) -> Path:
        return self.root / "stats.json"


@dataclass(frozen=True)
class CheckpointFolder:
    """One complete checkpoint in a work folder: the training state, its Hugging Face export in `hf/`, and the
    checksum file written last (the commit marker)."""

    root: Path

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def checksums(self) -> Path:
        return self.root / CHECKSUMS

    @property
    def weights(self) -> str:
        """The exported weights' path relative to the folder: their key in the checksum file."""
        return f"{self.hf.name}/{WEIGHTS}"

    @property
    def complete(self) -> bool:
        return self.checksums.exists()

    @property
    def exported(self) -> bool:
        """Whether this checkpoint holds a Hugging Face export (every k-th does: how.checkpoints.hf_export_every)."""
        return (self.root / self.weights).exists()

    def committed_sha256(self, rel: str) -> str | None:
        """A file's sha256 as the checksum file records it ({"size", "sha256"} per file; a bare digest before)."""

        entry = json.loads(self.checksums.read_text()).get(rel)
        return entry if entry is None or isinstance(entry, str) else entry["sha256"]

    @property
    def step(self) -> int:
        step = checkpoint_step(self.root.name)
        if step is None:
            raise ValueError(f"{self.root} is not a checkpoint folder ({CHECKPOINT_PREFIX}<step>)")
        return step


def complete_checkpoints(folder: Path) -> list[CheckpointFolder]:
    """The complete checkpoints in a folder of checkpoints, oldest first."""
    if not folder.is_dir():
        return []
    found = [CheckpointFolder(p) for p in folder.iterdir() if p.is_dir() and checkpoint_step(p.name) is not None]
    return sorted((c for c in found if c.complete), key=lambda c: c.step)


@dataclass(frozen=True)
class WorkFolder:
    """A step's work folder: it survives a crashed or killed attempt (checkpoints, the Slurm job's log and
    script, the trainer's job) and is removed once the step is committed. Under a cluster it lives on the
    shared root, where every node of a job sees it."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> CheckpointFolder:
        return CheckpointFolder(self.checkpoints / checkpoint_name(step))

    def complete_checkpoints(self) -> list[CheckpointFolder]:
        """Checkpoints whose checksum file is in place, oldest first (a `.tmp` folder being written is not one)."""
        return complete_checkpoints(self.checkpoints)

    @property
    def evaluation_pending(self) -> Path:
        """The Hugging Face exports of checkpoints keep_last pruned before every-checkpoint evaluation scored them,
        each `step-<N>/` with its `hf/` and the checksum file it was committed with (model/training/checkpoints.py:
        prune); the step's artifact keeps them among its checkpoints."""
        return self.root / "evaluation-pending"

    def pending_exports(self) -> list[CheckpointFolder]:
        """The exports kept for evaluation, oldest first."""
        return complete_checkpoints(self.evaluation_pending)

    def everything_to_evaluate(self) -> list[CheckpointFolder]:
        """Every exported checkpoint of the stage still on disk, kept or pending evaluation, oldest first."""
        kept = [c for c in self.complete_checkpoints() if c.exported]
        steps = {c.step for c in kept}
        return sorted(kept + [c for c in self.pending_exports() if c.step not in steps], key=lambda c: c.step)

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def events(self) -> Path:
        """The training monitors' events, one JSON line each."""
        return self.root / "events.jsonl"

    @property
    def train_job(self) -> Path:
        """The trainer's job (model/training/job.py: TrainJob), read by every rank."""
        return self.root / "job.json"

    @property
    def train_result(self) -> Path:
        """The trainer's result (model/training/records.py: TrainResult), written by rank 0 at the end."""
        return self.root / "result.json"

    @property
    def hostfile(self) -> Path:
        return self.root / "hostfile"

    @property
    def trl_job(self) -> Path:
        """A TRL step's job (tasks/post_training/trl_job.py: TrlJob), read by every rank."""
        return self.root / "trl-job.json"

    @property
    def trl_start(self) -> Path:
        """The model a TRL step starts from, chat-ready (and the base its LoRA adapters merge into)."""
        return self.root / "trl-start"

    @property
    def trl_rows(self) -> Path:
        """The TRL step's training rows (conversations, pairs or prompts), one JSON line each."""
        return self.root / "trl-rows.jsonl"

    @property
    def trl_datasets(self) -> Path:
        """The rows as Arrow files and TRL's tokenized and packed forms of them, cached by the datasets library: the
        ranks memory-map them, and prepare them once (tasks/post_training/trl_ranks.py: rows_dataset)."""
        return self.root / "trl-datasets"

    @property
    def trl_prepared(self) -> Path:
        """What each TRL rank prepared of the rows itself and what it loaded prepared (`rank-<r>.json`)."""
        return self.root / "trl-prepared"

    @property
    def trl_checkpoints(self) -> Path:
        """The TRL trainer's checkpoints (`checkpoint-<step>`), resumed from after a kill or a requeue."""
        return self.root / "trl-checkpoints"

    @property
    def trl_final(self) -> Path:
        """The trained weights (or the LoRA adapter) rank 0 saves at the end."""
        return self.root / "trl-final"

    @property
    def trl_result(self) -> Path:
        """What the TRL ranks report (TrlResult), written by rank 0 at the end."""
        return self.root / "trl-result.json"

    def launcher_log(self, node: int) -> Path:
        return self.root / f"launcher-{node}.log"

    @property
    def step_job(self) -> Path:
        """The whole step as a job (tasks/steps/step_job.py: StepJob)."""
        return self.root / "step-job.json"

    @property
    def step_result(self) -> Path:
        """What the step reported (StepResult), written by the job after it committed the artifact."""
        return self.root / "step-result.json"

    @property
    def job_record(self) -> Path:
        """The Slurm job running this step (its id, who submitted it, when): a new orchestrator follows it."""
        return self.root / "slurm-job.json"

    @property
    def batch_script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def slurm_log(self) -> Path:
        return self.root / "slurm.log"

    @property
    def goodput(self) -> Path:
        """Rank 0's record of each attempt at the stage: where its time went (model/training/goodput.py)."""
        return self.root / "goodput"

    @property
    def collective_ledger(self) -> Path:
        """Each rank's last collective and heartbeat (model/training/collective_ledger.py)."""
        return self.root / "collectives"

    @property
    def retriable(self) -> Path:
        """Why ranks ended for faults a retry may cure, a file per rank (infra/exits.py)."""
        return self.root / "retriable"

    @property
    def disk_full(self) -> Path:
        """The full disk a rank ended on, a file per rank that met one (infra/disk_full.py)."""
        return self.root / "disk-full"

    @property
    def failure_requeues(self) -> Path:
        """When the batch shell requeued the job for such faults, a Unix time per line (its budget:
        how.orchestration.retries in any 24 hours)."""
        return self.root / "failure-requeues"

    @property
    def fault_nodes(self) -> Path:
        """The nodes a retriable fault was seen on (a rank's failed device, the rank a signal ended first, a node
        srun could not start ranks on), a Slurm node name per line: the batch shell excludes them on the requeue."""
        return self.root / "fault-nodes"

    @property
    def stop_file(self) -> Path:
        """Touched by the batch shell when Slurm signals the time limit: the trainer checkpoints and stops."""
        return self.root / "stop-requested"


def pending_copy(hf: Path) -> Path:
    """Where the export `<work>/checkpoints/step-<N>/hf` is once pruned before its evaluation (WorkFolder's
    evaluation_pending)."""
    checkpoint = hf.parent
    return WorkFolder(checkpoint.parent.parent).evaluation_pending / checkpoint.name / hf.name
