"""Background mirroring of a step's checkpoints to a remote store, and their recovery on a fresh machine.

Training writes checkpoints to a local work folder (fast, and what the trainer resumes from). With an
s3:// store, a thread uploads every completed checkpoint to `<store>/.work/<kind>/<name>-<fp>/checkpoints/`
(its checksum file last, so a half-uploaded one is never used) without stalling training, and mirrors
pruning. A retried step on another machine downloads the newest complete one before training resumes.

The step's metrics file goes with each checkpoint, as append-only parts (the bytes written since the last part), so
the uploads of a weeks-long stage add up to the file once, not to the file at every pass of the thread; every byte
sent counts in the step's resource ledger.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

from compass.infra import resource_ledger
from compass.infra.layout import CHECKPOINT_PREFIX, CHECKSUMS, WorkFolder, checkpoint_step
from compass.infra.store import Store

METRIC_PARTS = "metrics.parts"  # the remote folder of the metrics file's parts, each named by its first byte

log = logging.getLogger("compass.mirror")


class CheckpointMirror:
    def __init__(self, store: Store, work_key: str, local: Path, interval_s: float = 2.0):
        self.store = store
        self.fs = store.fs
        self.remote = f"{store.root_path}/.work/{work_key}"
        self.remote_folder = f"{self.remote}/{local.name}"  # the work folder's layout, mirrored
        self.local = local
        self.interval_s = interval_s
        self.uploaded: set[str] = set()
        self.metrics_sent = 0  # bytes of the metrics file already in the remote parts
        self.mirrored: list[str] | None = None  # the local checkpoints the remote last matched
        self.ledger = resource_ledger.current()  # the step's: the thread counts its uploads there
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- recovery ---------------------------------------------------------------------------------------
    def remote_checkpoints(self) -> list[str]:
        """Names of complete remote checkpoints, oldest first."""
        self.fs.invalidate_cache(self.remote)
        names = []
        for path in self.fs.glob(f"{self.remote_folder}/{CHECKPOINT_PREFIX}*/{CHECKSUMS}"):
            names.append(path.rsplit("/", 2)[-2])
        return sorted(names)

    def restore(self) -> str | None:
        """Download the newest remote checkpoint when none is local; returns its name."""
        if any(self.local.glob(f"{CHECKPOINT_PREFIX}*/{CHECKSUMS}")):
            return None
        remote = self.remote_checkpoints()
        if not remote:
            return None
        self._download(remote[-1])
        return remote[-1]

    def restore_every(self) -> list[str]:
        """Download every remote checkpoint missing here (the exports waiting for their evaluation); their names."""
        missing = [name for name in self.remote_checkpoints() if not (self.local / name / CHECKSUMS).exists()]
        for name in missing:
            self._download(name)
        return missing

    def _download(self, name: str) -> None:
        tmp = self.local / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        prefix = f"{self.remote_folder}/{name}"
        files = [p for p in self.fs.find(prefix) if not p.endswith("/" + CHECKSUMS)]
        for path in files:
            target = tmp / path[len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(path, str(target))
        self.fs.get_file(f"{prefix}/{CHECKSUMS}", str(tmp / CHECKSUMS))
        tmp.rename(self.local / name)
        self.uploaded.add(name)
        self._restore_metrics()  # the trainer trims it back to the checkpoint's step
        log.info("restored checkpoint %s from %s", name, prefix)

    def _restore_metrics(self) -> None:
        local = WorkFolder(self.local.parent).metrics
        parts = sorted(self.fs.glob(f"{self.remote}/{METRIC_PARTS}/*"))
        if not parts:
            return
        with open(local, "wb") as f:
            for part in parts:
                f.write(self.fs.cat_file(part))
        self.metrics_sent = local.stat().st_size

    # --- mirroring --------------------------------------------------------------------------------------
    def sync_once(self, final: bool = False) -> None:
        """Upload the checkpoints completed since the last pass (then the metrics written since), and mirror the
        pruning of any; a pass that finds nothing new sends and lists nothing."""
        local = sorted(p.name for p in self.local.glob(f"{CHECKPOINT_PREFIX}*")
                       if (p / CHECKSUMS).exists() and checkpoint_step(p.name) is not None)
        new = False
        for name in local:
            if name in self.uploaded:
                continue
            folder = self.local / name
            prefix = f"{self.remote_folder}/{name}"
            try:
                for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS):
                    self._put(path, f"{prefix}/{path.relative_to(folder).as_posix()}")
                self._put(folder / CHECKSUMS, f"{prefix}/{CHECKSUMS}")
                self.uploaded.add(name)
                new = True
            except FileNotFoundError:  # pruned locally while uploading: drop the partial copy below
                continue
        if new or final:
            self._send_metrics()
        if local != self.mirrored:
            for name in set(self.remote_checkpoints()) - set(local):
                self.fs.rm(f"{self.remote_folder}/{name}", recursive=True)
                self.uploaded.discard(name)
            self.mirrored = local

    def _put(self, path: Path, remote: str) -> None:
        self._folder_of(remote)
        self.fs.put_file(str(path), remote)
        if self.ledger is not None:
            self.ledger.add(uploaded=path.stat().st_size)

    def _folder_of(self, remote: str) -> None:
        """An object store has no folders; a store on a file system (a test's, a shared mount) needs them made."""
        if not self.store.is_remote:
            Path(remote).parent.mkdir(parents=True, exist_ok=True)

    def _send_metrics(self) -> None:
        """The metrics written since the last part, as the next part (a file that shrank was rewritten by a
        resume: its parts start again)."""
        metrics = WorkFolder(self.local.parent).metrics
        if not metrics.exists():
            return
        size = metrics.stat().st_size
        folder = f"{self.remote}/{METRIC_PARTS}"
        if size < self.metrics_sent:
            if self.fs.exists(folder):
                self.fs.rm(folder, recursive=True)
            self.metrics_sent = 0
        if size == self.metrics_sent:
            return
        with open(metrics, "rb") as f:
            f.seek(self.metrics_sent)
            body = f.read(size - self.metrics_sent)
        end = body.rfind(b"\n") + 1  # whole lines: the next part starts where this one ends
        if end:
            self._folder_of(f"{folder}/{self.metrics_sent:016d}")
            self.fs.pipe_file(f"{folder}/{self.metrics_sent:016d}", body[:end])
            self.metrics_sent += end
            if self.ledger is not None:
                self.ledger.add(uploaded=end)

    def start(self) -> CheckpointMirror:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.sync_once()
                except Exception as exc:  # a flaky network must not kill training; the next pass retries
                    log.warning("checkpoint upload failed, will retry: %s", exc)

        self._thread = threading.Thread(target=loop, name="compass-checkpoint-mirror", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.sync_once(final=True)

    def clear(self) -> None:
        """The step is committed: its recovery copies are no longer needed."""
        if self.fs.exists(self.remote):
            self.fs.rm(self.remote, recursive=True)
