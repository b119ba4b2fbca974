"""Errors that say the input is wrong, not that something failed on the way.

A retry helps a killed process or a server that went away; it cannot help a malformed JSONL line, a binary
file where text was promised, or a URI with nothing under it: those fail the same way every time. Such errors
derive from DataError, and the flow does not spend its retry budget (and the retry delay) on them. StopRequested
is neither: a job asked to stop (its time limit near) that checkpointed and ends on purpose, to be requeued.
"""

from __future__ import annotations


class DataError(Exception):
    """The data (or where the spec says it is) is wrong; running again will not change that."""


class MalformedData(DataError, ValueError):
    """A file that is not what its format says, located as precisely as the format allows (file:line)."""


class RootRefused(DataError, ValueError):
    """A place compass was asked to write (a submitted store_root) that it must not: `/`, a system folder, or outside
    the stores of the worker running it."""


class DiskFull(OSError, DataError):
    """No space left where a step writes: one message with the path and what is free, instead of a traceback
    from every layer the write went through. Retrying at once would fail the same way."""


class DamagedArtifact(DataError):
    """A committed artifact's files differ from its manifest: a retry of the same step would meet the same files;
    the next run sets it aside and recomputes it (or stops again, with --no-recompute)."""


class RunStopped(DataError):
    """A step decided that what follows must not run (the gate found an existing model that already meets the
    success criteria). Its artifact is committed; running again stops the same way until the spec changes."""


class StopRequested(Exception):
    """The scheduler asked the trainer to stop (a time limit near): the state is checkpointed at `step`. Raised by
    the trainer's StopWhenAsked callback, TRL's stop check and the evaluate step between checkpoints (`step`: the
    checkpoints it scored); the job's entry points end cleanly on it."""

    def __init__(self, step: int, said: str | None = None):
        super().__init__(said or f"stopped at step {step} on request; the checkpoint of step {step} is written")
        self.step = step
