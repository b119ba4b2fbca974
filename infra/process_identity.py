"""Which process a record names, by what cannot drift: the kernel's boot id and the process's start time in clock
ticks since that boot (/proc/<pid>/stat). psutil's create_time is the boot time plus those ticks, and the boot time
is wall-clock time: a VM whose clock is stepped moves it (17 s was seen here), so a record compared at 1 ms named a
live process (a run paused with SIGSTOP) dead, and a second run took its lock."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class ProcessIdentity:
    boot: str  # the kernel's boot id: another boot, another process whatever its pid
    pid: int
    ticks: int  # start time in clock ticks since boot: a reused pid has another

    def as_record(self) -> dict[str, str | int]:
        return {"boot": self.boot, "pid": self.pid, "ticks": self.ticks}


def identity_of(pid: int) -> ProcessIdentity | None:
    """The process `pid` of this machine now (None: none runs, or this is no Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses
    try:
        return ProcessIdentity(boot, pid, int(fields[19]))  # field 22 of stat: starttime
    except (IndexError, ValueError):
        return None


def recorded_alive(record: dict) -> bool | None:
    """Whether the process a record names (its `boot`, `pid` and `ticks`) runs on this machine now; None: the
    record names none this way (an older record, or one of another shape)."""
    boot, pid, ticks = record.get("boot"), record.get("pid"), record.get("ticks")
    if not (isinstance(boot, str) and isinstance(pid, int) and isinstance(ticks, int)) or isinstance(ticks, bool):
        return None
    now = identity_of(pid)
    return now is not None and now.boot == boot and now.ticks == ticks
