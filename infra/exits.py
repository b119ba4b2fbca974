"""Faults a retry may cure, told apart from the rest where a rank ends.

A rank whose collective hung (the hang watchdog) or broke (a peer lost: NCCL's or gloo's error) ends with
RETRIABLE_EXIT and writes why into its work folder's `retriable/`, one file per rank: srun reports only the highest
exit code of its tasks (143 once it has terminated the others), so the code alone does not reach the batch shell.
The step then exits RETRIABLE_EXIT too, and the batch shell requeues its job, under a budget, with no orchestrator
needed (infra/slurm.sbatch_script); a requeued job resumes from its newest checkpoint. Any other failure fails
the job: a bug or bad data would fail again.
"""

from __future__ import annotations

from pathlib import Path

from compass.infra.layout import WorkFolder

RETRIABLE_EXIT = 75  # EX_TEMPFAIL: a retry may well succeed


class RetriableRanksFailure(RuntimeError):
    """The ranks ended for faults a retry may cure (their reasons, one per rank that said so)."""

    def __init__(self, reasons: list[str]):
        self.reasons = reasons
        super().__init__("the ranks ended for faults a retry may cure: " + "; ".join(reasons))


def mark_retriable(workdir: Path, rank: int, why: str) -> None:
    folder = WorkFolder(workdir).retriable
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{rank}").write_text(why[:2000])


def retriable_reasons(workdir: Path) -> list[str]:
    folder = WorkFolder(workdir).retriable
    return [p.read_text() for p in sorted(folder.glob("rank-*"))] if folder.exists() else []


def clear_retriable(workdir: Path) -> None:
    for path in WorkFolder(workdir).retriable.glob("rank-*"):
        path.unlink(missing_ok=True)
