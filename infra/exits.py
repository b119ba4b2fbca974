"""Faults a retry may cure, told apart from the rest where a rank ends.

A rank whose collective hung (the hang watchdog) or broke (a peer lost: NCCL's or gloo's error), or whose device
failed (CUDA's ECC, Xid and NVLink errors: `device_fault`) ends with
RETRIABLE_EXIT and writes why into its work folder's `retriable/`, one file per rank: srun reports only the highest
exit code of its tasks (143 once it has terminated the others), so the code alone does not reach the batch shell.
srun that could not start the ranks on one of the job's nodes (its slurmd lost after the job began) writes its
note there too (`launch`): the ranks never ran, and a requeued job finds the node back or replaced.
The step then exits RETRIABLE_EXIT too, and the batch shell requeues its job, under a budget, with no orchestrator
needed (infra/slurm.sbatch_script); a requeued job resumes from its newest checkpoint. Any other failure fails
the job: a bug or bad data would fail again.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path

from compass.infra.layout import WorkFolder

log = logging.getLogger("compass.exits")

RETRIABLE_EXIT = 75  # EX_TEMPFAIL: a retry may well succeed


class RetriableRanksFailure(RuntimeError):
    """The ranks ended for faults a retry may cure (their reasons, one per rank that said so)."""

    def __init__(self, reasons: list[str]):
        self.reasons = reasons
        super().__init__("the ranks ended for faults a retry may cure: " + "; ".join(reasons))


def mark_retriable(workdir: Path, who: int | str, why: str, nodes: tuple[str, ...] = ()) -> None:
    """Say why the ranks' end is retriable: `who` is a rank (its number) or what launched them (`launch`); `nodes`:
    the Slurm nodes the fault was seen on, which the requeued job leaves out (infra/slurm.sbatch_script)."""
    work = WorkFolder(workdir)
    work.retriable.mkdir(parents=True, exist_ok=True)
    (work.retriable / (f"rank-{who}" if isinstance(who, int) else who)).write_text(why[:2000])
    named = [n for n in nodes if SLURM_NODE_NAME.fullmatch(n)]  # a name, never an option or a range to expand
    if named:
        with work.fault_nodes.open("a") as out:
            out.write("".join(f"{n}\n" for n in named))


SLURM_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def this_node() -> str:
    """The Slurm node this process runs on (SLURMD_NODENAME, which Slurm sets in every task), else the host."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def broken_collective(workdir: Path, rank: int, error: BaseException) -> int:
    """A rank's collective broke (a peer lost: model/training/collectives.broke_a_collective): say so for the step
    and return the exit code the rank ends with."""
    first = (str(error).splitlines() or [""])[0][:300]
    why = f"rank {rank}: a collective failed ({type(error).__name__}: {first})"
    log.error("%s; the job retries from its newest checkpoint", why)
    mark_retriable(workdir, rank, why)
    return RETRIABLE_EXIT


# what CUDA, the driver and NCCL say of a device that failed under a rank (Xid events, ECC, NVLink, a GPU off the
# bus): another attempt, on this node after a reset or on another, may well succeed. Errors a program causes
# (a device-side assert, an illegal address, out of memory) are not among them: they would fail again.
DEVICE_FAULTS = ("uncorrectable ECC error", "ECC error encountered", "cudaErrorECCUncorrectable", "Xid",
                 "uncorrectable NVLink error", "NVLink error", "GPU is lost", "fallen off the bus",
                 "unspecified launch failure", "busy or unavailable", "cudaErrorDevicesUnavailable",
                 "NVML_ERROR_GPU_IS_LOST", "CUDA error: unknown error")


def device_fault(error: BaseException) -> str | None:
    """The first line of a RuntimeError that names a failed device (DEVICE_FAULTS), else None."""
    text = str(error)
    if isinstance(error, RuntimeError) and any(sign in text for sign in DEVICE_FAULTS):
        return (text.splitlines() or [""])[0][:300]
    return None


def failed_device(workdir: Path, rank: int, error: BaseException) -> int | None:
    """A rank whose device failed (device_fault): say so for the step (the job requeues itself, infra/slurm.py)
    and return the exit code the rank ends with; None for any other error."""
    first = device_fault(error)
    if first is None:
        return None
    node = this_node()
    why = f"rank {rank} on {node}: its device failed ({first})"
    log.error("%s; the job retries from its newest checkpoint, without this node", why)
    mark_retriable(workdir, rank, why, nodes=(node,) if os.environ.get("SLURMD_NODENAME") else ())
    return RETRIABLE_EXIT


def trained_a_step(workdir: Path) -> bool:
    """Whether the ranks working in `workdir` made progress before they ended: a training step logged (the metrics
    file), or a checkpoint complete (compass's or TRL's)."""
    work = WorkFolder(workdir)
    metrics = work.metrics
    if metrics.exists() and metrics.stat().st_size > 0:
        return True
    return bool(work.complete_checkpoints()) or any(work.trl_checkpoints.glob("checkpoint-*/trainer_state.json"))


def retriable_reasons(workdir: Path) -> list[str]:
    folder = WorkFolder(workdir).retriable
    return [p.read_text() for p in sorted(folder.iterdir()) if p.is_file()] if folder.exists() else []


def raise_if_retriable(workdir: Path) -> None:
    """Raise RetriableRanksFailure when the ranks (or what launched them) said their end is retriable."""
    if reasons := retriable_reasons(workdir):  # a hung or broken collective, a lost node: the job requeues itself
        raise RetriableRanksFailure(reasons)


def clear_retriable(workdir: Path) -> None:
    folder = WorkFolder(workdir).retriable
    for path in folder.iterdir() if folder.exists() else ():
        path.unlink(missing_ok=True)
