"""A lock per step with a heartbeat, so two runs never compute one step at once; stale locks are taken over."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psutil

from compass.infra.process_identity import identity_of, recorded_alive
from compass.infra.store import Store


class LockTimeout(TimeoutError):
    pass


class StepLock:
    """Held while a step computes. The holder rewrites the lock file every `heartbeat_s`; a lock whose
    heartbeat is older than `stale_after_s` belongs to a dead process and is taken over."""

    def __init__(self, store: Store, key: str, heartbeat_s: float = 5.0, stale_after_s: float = 60.0,
                 on_wait: Callable[[dict], None] = lambda holder: None,
                 on_take_over: Callable[[dict | None], None] = lambda holder: None):
        self.store = store
        self.on_wait = on_wait  # told once, when the lock is found held by a live process
        self.on_take_over = on_take_over  # told when a dead holder's lock is removed
        self.path = f"{store.root_path}/.locks/{key}.lock"
        self.token = uuid.uuid4().hex
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.facts: dict[str, str] = {}  # what the holder says it is doing (the Slurm job computing the step)

    def _body(self) -> str:
        me = identity_of(os.getpid())
        return json.dumps({"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                           "started": _process_start(os.getpid()), "heartbeat": time.time(),
                           **(me.as_record() if me else {}), **self.facts})

    def annotate(self, **facts: str) -> None:
        """Record facts with the lock (a waiting run shows them); written at once and kept with each heartbeat."""
        self.facts.update(facts)
        self._write_whole(self._body())

    def _read(self) -> dict | None:
        """The holder, or None when there is none or the file does not read as one (being written, left empty by a
        crash, or malformed: then broken, and taken over once the file is older than `stale_after_s`)."""
        try:
            with self.store.fs.open(self.path, "r") as f:
                return holder_of(json.loads(f.read()))
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None

    def _write_whole(self, body: str) -> None:
        """Readers must never see a half-written lock: replace locally, single PUT on object stores."""
        if self.store.is_remote:
            with self.store.fs.open(self.path, "w") as f:
                f.write(body)
            return
        tmp = f"{self.path}.{self.token}.tmp"
        with open(tmp, "w") as f:
            f.write(body)
        os.replace(tmp, self.path)

    def _try_create(self) -> bool:
        fs = self.store.fs
        if not self.store.is_remote:
            locks = os.path.dirname(self.path)
            os.makedirs(locks, mode=0o700, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(self._body())
            return True
        if fs.exists(self.path):
            return False
        with fs.open(self.path, "w") as f:  # object stores: write, then check we won the race
            f.write(self._body())
        time.sleep(0.2)
        current = self._read()
        return bool(current and current.get("token") == self.token)

    def acquire(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Take the lock; returns False if `should_stop()` turned true while waiting (e.g. step committed)."""
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            if self._try_create():
                self._start_heartbeat()
                return True
            if should_stop():
                return False
            holder = self._read()
            if holder is None:  # being written, just released, or left empty by a crash mid-create
                if self._age_s() > self.stale_after_s:
                    self._break_stale(None)
                else:
                    time.sleep(0.05)
                continue
            if holder_stale(holder, self._age_s, self.stale_after_s):
                if self._break_stale(holder):  # a dead holder on this machine is known at once: no heartbeat wait
                    self.on_take_over(holder)
                continue
            if not waited:
                waited = True
                self.on_wait(holder)
            if time.monotonic() > deadline:
                raise LockTimeout(f"{self.path} is held by {holder.get('host')} pid {holder.get('pid')}")
            time.sleep(min(1.0, self.heartbeat_s))

    def _age_s(self) -> float:
        try:
            modified = self.store.fs.modified(self.path)
        except (FileNotFoundError, OSError, NotImplementedError):
            return 0.0
        return time.time() - modified.timestamp()

    def _break_stale(self, holder: dict | None) -> bool:
        again = self._read()
        if again == holder:  # unchanged since we judged it stale
            with suppress(FileNotFoundError):
                self.store.fs.rm(self.path)
            return True
        return False

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                current = self._read()
                if current and current.get("token") != self.token:
                    return  # taken over: we were judged dead
                self._write_whole(self._body())

        self._thread = threading.Thread(target=beat, name="compass-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        current = self._read()
        if current and current.get("token") == self.token:
            self.store.fs.rm(self.path)


def _process_start(pid: int) -> float | None:

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def holder_of(value: Any) -> dict | None:
    """A lock file's content as a holder: a JSON object whose heartbeat and start time are numbers and whose pid is
    an integer, where given; anything else (`[]`, a string heartbeat, `{"pid": "five"}`) is None: broken."""
    def number(key: str, kinds: type | tuple[type, ...]) -> bool:
        given = value.get(key)
        return given is None or (isinstance(given, kinds) and not isinstance(given, bool))

    if not isinstance(value, dict):
        return None
    return value if number("heartbeat", (int, float)) and number("started", (int, float)) and number("pid", int) \
        else None


def holder_alive_here(holder: dict) -> bool | None:
    """On this machine: whether the holder's process is alive, by its boot id and start ticks
    (infra/process_identity.py: what a stepped clock cannot move, and a reused pid does not have). A record of an
    older compass (its wall-clock start time alone) is judged by that. None: it ran elsewhere, or recorded too
    little to tell (then its heartbeat decides)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return None
    by_ticks = recorded_alive(holder)
    if by_ticks is not None:
        return by_ticks
    recorded = holder.get("started")
    if recorded is None:
        return None
    started = _process_start(holder["pid"])
    return started is not None and abs(started - recorded) <= 1e-3


def holder_stale(holder: dict, file_age_s: Callable[[], float], stale_after_s: float) -> bool:
    """Whether a holder is gone. On this machine its process decides, whatever its heartbeat (a run paused with
    SIGSTOP is alive); elsewhere its heartbeat older than `stale_after_s`, or one in the future (another machine's
    clock) once the file itself is that old."""
    alive = holder_alive_here(holder)
    if alive is not None:
        return not alive
    beat = float(holder.get("heartbeat", 0))
    now = time.time()
    # a heartbeat in the future is no proof of life: broken once the file itself is that old
    return now - beat > stale_after_s or (beat > now and file_age_s() > stale_after_s)


@contextmanager
def step_lock(store: Store, key: str, timeout_s: float = 24 * 3600,
              should_stop: Callable[[], bool] = lambda: False,
              on_wait: Callable[[dict], None] = lambda holder: None,
              on_take_over: Callable[[dict | None], None] = lambda holder: None) -> Iterator[StepLock | None]:
    """Yields the held lock, or None when `should_stop` made waiting pointless."""
    lock = StepLock(store, key, on_wait=on_wait, on_take_over=on_take_over)
    held = lock.acquire(timeout_s, should_stop)
    try:
        yield lock if held else None
    finally:
        if held:
            lock.release()
