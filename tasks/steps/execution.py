"""One step computed and committed where this code runs: a staging folder and scratch space, the kind's work, the
summary kept with the artifact, the manifest with its lineage, the commit (manifest last) and its stamp.

The same function runs in the orchestrating process (in_process, local_ranks, ray_tasks) and inside a Slurm job
(tasks/steps/step_job.py), so a step commits the same way wherever it ran; the caller holds the step's lock and
removes the work folder after reading what it needs from it.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compass.infra import resource_ledger
from compass.infra.disk_full import disk_full_named
from compass.infra.manifest import InputRef, Manifest, code_version, host_facts, library_versions
from compass.infra.store import Store, owned_prefix
from compass.infra.verify import stamp
from compass.specs.input_stamps import stamp_provenance
from compass.tasks.steps import registry
from compass.tasks.steps.backends import launcher_for
from compass.tasks.steps.context import InputArtifact, Runtime, StepContext, StepResult
from compass.tasks.steps.kind import StepKind
from compass.tasks.steps.step_config import StepConfig

SUMMARY_FILE = "summary.md"


@dataclass(frozen=True)
class StepRun:
    """Everything one execution of a step needs, resolved by the runner: what to compute, from which committed
    inputs, where to commit it, and how (the runtime, with this step's placement)."""

    kind: str
    name: str
    config: StepConfig
    fingerprint: str
    uri: str
    inputs: dict[str, InputArtifact]
    store: Store
    workdir: Path
    work_key: str
    runtime: Runtime
    spec_hash: str
    spec_name: str

    @property
    def step_id(self) -> str:
        return f"{self.kind}:{self.name}"


@contextmanager
def _default_grad_mode() -> Iterator[None]:
    """Steps run on reused worker threads, and torch's grad mode is per thread: a library that switches it off
    and never back (lighteval does) would leave the next step on that thread unable to train. A process that has
    not imported torch has nothing to restore (and an orchestrator under a cluster never imports it); nor has one
    whose torch another thread is still importing (a partially initialized module, without enable_grad yet)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch.__spec__, "_initializing", False):
        yield
        return
    with torch.enable_grad():
        yield


def execute(run: StepRun, log: logging.Logger | logging.LoggerAdapter) -> tuple[Manifest, StepResult]:
    """Compute the step into a staging folder and commit it; returns the committed manifest and what the step
    reported. Torch is imported only here, when a step runs in this process."""
    kind = registry.kind(run.kind)
    kind.import_names()  # one thread at a time, and only for steps that compute here
    started = time.time()
    ledger = resource_ledger.current()
    with nullcontext(ledger) if ledger is not None else resource_ledger.counting(resource_ledger.Ledger()) as counted:
        return _execute(run, kind, counted, started, log)


def _execute(run: StepRun, kind: StepKind, ledger: resource_ledger.Ledger, started: float,
             log: logging.Logger | logging.LoggerAdapter) -> tuple[Manifest, StepResult]:
    store = run.store
    cpu = resource_ledger.ThreadCpu()
    log.info("%s running; commits to %s", run.step_id, run.uri)
    with store.staging() as out, \
            tempfile.TemporaryDirectory(prefix=owned_prefix("scratch"), dir=out.parent) as scratch:
        sctx = StepContext(run.kind, run.name, run.config, run.inputs, out, Path(scratch), run.workdir, run.runtime,
                           log, store=store, work_key=run.work_key, spec_hash=run.spec_hash, uri=run.uri)
        with _default_grad_mode(), disk_full_named(run.step_id, out):
            result = kind.run(sctx)
            if result.summary:  # kept with the artifact: a cached re-run shows it again in the UI
                (out / SUMMARY_FILE).write_text(result.summary)
        manifest = Manifest(
            kind=run.kind, name=run.name, fingerprint=run.fingerprint, uri=run.uri, config=run.config.identity(),
            how=kind.how_read(run.config, run.runtime.how),
            inputs=[InputRef(role=r, step=a.step_id, uri=a.uri, fingerprint=a.manifest.fingerprint)
                    for r, a in run.inputs.items()],
            spec_hash=run.spec_hash, spec_name=run.spec_name, code_version=code_version(),
            phase_version=kind.version, libraries=library_versions(), **host_facts(),
            started_at=started, finished_at=time.time(), metrics=result.metrics,
            provenance=[*result.provenance, *stamp_provenance(run.config)],
            resources=ledger.snapshot().merged(resource_ledger.parts(run.workdir)).merged(
                resource_ledger.Resources(cpu_s=cpu.spent())),
            execution=launcher_for(run.runtime.placement).execution())
        with disk_full_named(run.step_id, Path(store.root_path) if not store.is_remote else out):
            manifest = store.commit(out, manifest, run.runtime.how.storage.shard_index_above, sctx.published)
        stamp(store, manifest)
    log.info("%s committed to %s in %.1fs%s", run.step_id, run.uri, manifest.duration_s,
             headline(kind.headline, manifest.metrics))
    return manifest, result


def headline(names: tuple[str, ...], metrics: dict[str, Any], most: int = 6) -> str:
    """`: final_loss 2.31, tokens_per_s 1,840`: the step's key numbers for its commit line; a name may be a
    pattern (`val_ppl:*`)."""

    shown = []
    for name in [m for pattern in names for m in fnmatch.filter(metrics, pattern)][:most]:
        value = metrics.get(name)
        if value is None or isinstance(value, dict | list):
            continue
        if isinstance(value, bool):
            text = "yes" if value else "no"
        elif isinstance(value, float):
            text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        elif isinstance(value, int):
            text = f"{value:,}"
        else:
            text = str(value)
        shown.append(f"{name} {text}")
    return f": {', '.join(shown)}" if shown else ""


def clear_work(run_store: Store, work_key: str, workdir: Path) -> None:
    """The step is committed: its work folder (checkpoints of every attempt, the job's log) and its recovery
    copies in a remote store are no longer needed."""
    shutil.rmtree(workdir, ignore_errors=True)
    if run_store.is_remote:
        from compass.infra.checkpoint_mirror import CheckpointMirror

        CheckpointMirror(run_store, work_key, workdir).clear()
