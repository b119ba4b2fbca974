"""Which flow runs of a store are alive, so that a killed one does not stay "Running" forever.

A SIGKILL (the OOM killer, `kill -9`, a node lost) reaches no handler: nothing in the killed process reports, and
its flow run and step stay Running in Prefect's database. So every run holds a record in its store while it runs,
a heartbeat lock named after its flow run, and each run starts by ending the flow runs whose record belongs to a
dead process (on this machine at once, elsewhere once the heartbeat is stale): Crashed, with the reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from compass.infra.interrupt import end_flow_run
from compass.infra.locks import StepLock, holder_of, holder_stale
from compass.infra.store import Store

RECORDS = "runs"  # under the store's .locks/


@dataclass(frozen=True)
class DeadRun:
    flow_run_id: str
    host: str
    pid: int


@contextmanager
def run_record(store: Store, flow_run_id: str) -> Iterator[None]:
    """Held for the flow run's lifetime; removed when it ends, however it ends short of a kill."""
    lock = StepLock(store, f"{RECORDS}/{flow_run_id}")
    held = lock.acquire(timeout_s=0)
    if held:
        lock.annotate(store=store.root)  # a record copied or planted into another store ends nothing there
    try:
        yield
    finally:
        if held:
            lock.release()


def dead_runs(store: Store, stale_after_s: float = 60.0) -> list[tuple[str, DeadRun]]:
    """The records of flow runs whose process is gone: (record path, run)."""
    found = []
    for path in store.fs.glob(f"{store.root_path}/.locks/{RECORDS}/*.lock"):
        try:
            with store.fs.open(path, "r") as f:
                holder = holder_of(json.loads(f.read()))
        except (FileNotFoundError, OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue  # being written or just removed
        if holder is None or holder.get("store") != store.root:
            continue  # malformed, another store's or none's (planted, or still being annotated): never acted on
        if holder_stale(holder, lambda at=path: _age_s(store, at), stale_after_s):
            run_id = str(path).rsplit("/", 1)[-1].removesuffix(".lock")
            found.append((str(path), DeadRun(run_id, str(holder.get("host")), int(holder.get("pid") or -1))))
    return found


def _age_s(store: Store, path: str) -> float:
    try:
        return time.time() - store.fs.modified(path).timestamp()
    except (FileNotFoundError, OSError, NotImplementedError):
        return 0.0


def end_dead_runs(store: Store) -> list[DeadRun]:
    """Mark the flow runs of dead processes Crashed (with their running steps) and drop their records; a record
    whose flow run this Prefect server does not know (another server's) is dropped too."""
    found = dead_runs(store)
    if not found:
        return []
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound


    ended = []
    with get_client(sync_client=True) as client:
        for path, run in found:
            try:
                state = client.read_flow_run(run.flow_run_id).state
            except ObjectNotFound:
                state = None
            if state is not None and not state.is_final():
                end_flow_run(client, run.flow_run_id, f"its process ({run.host} pid {run.pid}) is gone, killed "
                             "without a chance to report; committed steps are kept and the next run resumes")
                ended.append(run)
            with suppress(FileNotFoundError):
                store.fs.rm(path)
    return ended
