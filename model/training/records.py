"""What training reports, typed: one metrics line per optimizer step (`metrics.jsonl`) and the stage's result
(`result.json`, written by rank 0). Writers and every reader (the step that exports, live progress, Prometheus
and TensorBoard, evaluation curves, the next stage's token count) share these models."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

PHASES = ("data_wait", "forward_backward", "sync", "optimizer", "checkpoint")  # the parts of a step, timed


class MetricsRow(BaseModel):
    """One optimizer step. `step` and `tokens` count over every stage so far; `stage_step` within the stage.
    Post-training rows (TRL) carry loss and tokens only, with their `method`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int
    stage: str
    stage_step: int | None = None
    stage_steps: int | None = None
    loss: float
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int
    tokens_per_s: float | None = None
    mfu: float | None = None
    data_wait_s: float | None = None
    forward_backward_s: float | None = None
    sync_s: float | None = None
    optimizer_s: float | None = None
    checkpoint_s: float | None = None
    rss_mb: float | None = None
    gpu_mem_mb: float | None = None
    method: str | None = None

    def seconds(self, phase: str) -> float:
        """Seconds this step spent in one of PHASES (0 when not measured)."""
        return float(getattr(self, f"{phase}_s") or 0.0)

    def line(self) -> str:
        return self.model_dump_json(exclude_none=True) + "\n"


def read_metrics(path: Path) -> list[MetricsRow]:
    """Every row of a metrics file (none when it does not exist)."""
    if not path.exists():
        return []
    return [MetricsRow.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]


def write_metrics(path: Path, rows: list[MetricsRow]) -> None:
    path.write_text("".join(row.line() for row in rows))


class MonitorEvent(BaseModel):
    """A training monitor's event (loss spike, divergence, throughput drop), with its likely cause and remedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    step: int
    action: str
    detail: str
    cause: str
    remedy: str
    phase: str | None = None


class TrainingSetup(BaseModel):
    """How a stage ran: the kernels and engine chosen for it and where its data was read from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention: str
    loss: str
    compile: bool
    precision: str
    engine: str
    sharding: str = ""  # how the engine spreads the states: "" (none), "ZeRO-2 over 4 ranks", "HSDP: 2 x 2", ...
    gradients: str = ""  # the dtypes the engine sums and reduces gradients in: "accumulated in float32, reduced in ..."
    prefetch: int
    async_checkpoints: bool
    data_from: str  # "store", or the node-local cache the sources were staged into
    substituted: list[str] = []  # CUDA-only kernels a GPU spec's CPU rank (a rehearsal) replaced by their reference


class RankPlace(BaseModel):
    """Where one rank ran: its node, the CPUs it may use (its affinity) and its device. A node's ranks that share
    one CPU show here before they show as slow steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    node: str
    cpus: list[int]
    device: str  # what it computes on, and the GPU it opens (or would open, on CPU ranks: a rehearsal)
    local_rank: int = 0
    gpu: str | None = None  # that GPU as its node names it (CUDA_VISIBLE_DEVICES' entry)
    visible: list[str] | None = None  # the GPUs the rank could open (CUDA_VISIBLE_DEVICES); None: unset, every GPU


class CompileReport(BaseModel):
    """What torch.compile did on a rank (torch._dynamo's counters): the graphs it compiled and the graph breaks,
    each of which runs the code around it eagerly between compiled regions (slow on a GPU)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    graphs: int
    graph_breaks: int
    break_reasons: list[str] = []  # the first few, as dynamo words them

    @classmethod
    def since(cls, start: DynamoCounts) -> CompileReport:
        """What was compiled after `start` (dynamo's counters are per process: in-process runs add up)."""
        now = DynamoCounts.read()
        breaks = now.breaks - start.breaks
        return cls(graphs=now.graphs - start.graphs, graph_breaks=sum(breaks.values()),
                   break_reasons=[reason[:200] for reason in list(breaks)[:5]])


@dataclass(frozen=True)
class DynamoCounts:
    """torch._dynamo's process-wide counters at one moment: graphs compiled, graph breaks by reason."""

    graphs: int
    breaks: Counter[str]

    @classmethod
    def read(cls) -> DynamoCounts:
        from torch._dynamo.utils import counters

        return cls(graphs=counters["stats"]["unique_graphs"], breaks=Counter(counters["graph_break"]))


CAUSES = ("startup", "data_wait", "checkpoint", "evaluation", "restart", "redone", "other")  # badput, by cause


def cause_label(cause: str) -> str:
    """A badput cause as the summaries print it: `start-up`, `data wait`, ..."""
    return cause.replace("_", " ").replace("startup", "start-up")


class GoodputSplit(BaseModel):
    """A stage's wall time, first attempt's start to the end, by cause; `compute_s` is the goodput."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    total_s: float
    compute_s: float
    startup_s: float
    data_wait_s: float
    checkpoint_s: float
    evaluation_s: float
    restart_s: float
    redone_s: float
    other_s: float
    attempts: int
    redone_steps: int = 0  # optimizer steps computed again after resumes (the seconds hold a restart's warm-up)

    @property
    def goodput(self) -> float:
        return self.compute_s / self.total_s if self.total_s > 0 else 0.0

    def line(self) -> str:
        """`goodput 91% (start-up 4%, checkpoint 2%, restart 2%, ...), 2 attempts`: the causes over 0.5%."""
        shares = [(c, getattr(self, f"{c}_s") / self.total_s) for c in CAUSES] if self.total_s > 0 else []
        causes = ", ".join(f"{cause_label(c)} {s:.0%}"
                           for c, s in sorted(shares, key=lambda x: -x[1]) if s >= 0.005)
        return (f"goodput {self.goodput:.0%}" + (f" (badput: {causes})" if causes else "")
                + f", {self.attempts} attempt{'s' * (self.attempts != 1)}")

    def row(self) -> dict[str, float | int]:
        """The split as one table row (the step's `goodput` table artifact, which `compass status` reads)."""
        return {"goodput": round(self.goodput, 4), **{k: round(v, 2) if isinstance(v, float) else v
                                                      for k, v in self.model_dump().items()}}


def summed(splits: list[GoodputSplit]) -> GoodputSplit | None:
    """Several steps' splits as one (a run's): their seconds by cause, added."""
    if not splits:
        return None
    fields = [f for f in GoodputSplit.model_fields if f != "attempts"]
    return GoodputSplit(**{f: sum(getattr(s, f) for s in splits) for f in fields},
                        attempts=sum(s.attempts for s in splits))


GOODPUT_TABLE = "goodput"  # the table artifact of a step's split, in the UI and read by `compass status`


def goodput_table(split: GoodputSplit | None) -> dict[str, list[dict[str, float | int]]]:
    """A step's tables entry for its split (none without one)."""
    return {GOODPUT_TABLE: [split.row()]} if split is not None else {}


class TrainResult(BaseModel):
    """A finished stage: steps, tokens, final training loss, validation loss per source, where it resumed from,
    the ranks' consistency check, the monitors' events and how it ran (attention, loss kernel, engine, ...)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int
    tokens: int
    final_loss: float
    val_loss: dict[str, float]
    resumed_from: int | None
    rank_check: str = "single process"
    events: list[MonitorEvent] = []
    setup: TrainingSetup
    ranks: list[RankPlace] = []
    compiled: CompileReport | None = None  # with compile on
    goodput: GoodputSplit | None = None  # where the stage's wall time went, over every attempt (model/training/goodput)

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path) -> TrainResult:
        return cls.model_validate_json(path.read_text())
