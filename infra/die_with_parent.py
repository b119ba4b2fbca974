"""Helper processes that die with the run that started them.

A run killed with SIGKILL cannot stop its helpers: datatrove's Manager process, its forkserver and pool workers
outlived it, and a worker kept writing (and holding open) files of a step nobody would commit. Linux can tie a
process to its parent (prctl PR_SET_PDEATHSIG, which fires when the parent *thread* ends). Two ways in:
`children_die_with_this_thread()` ties every os.fork() child made inside it (the Manager), and the module
`compass.infra.forkserver_preload`, imported by the forkserver when it starts, ties the forkserver and every
worker it forks. Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1
_inside = threading.local()
_tie_next_child = False
_registered = False


def die_with_parent(never_a_child_of_init: bool = False) -> None:
    """This process gets SIGKILL when the thread that forked it ends. `never_a_child_of_init`: its parent is a
    launcher (torchrun, slurmstepd), so init as its parent means it was adopted, its launcher already gone: it exits
    now. A rank arms this after seconds of imports, and a launcher killed meanwhile left it waiting in its
    rendezvous forever. (Not for the forkserver: `compass run` may be a container's init.)"""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if never_a_child_of_init and parent == 1:
        os._exit(1)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def parent_death_preexec() -> Callable[[], None]:
    """A subprocess preexec_fn that ties the child to the calling thread. libc's prctl is looked up here, in
    the parent, so the child (forked from a process with threads) only makes one foreign call before exec."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    sig = int(signal.SIGKILL)
    parent = os.getpid()

    def tie() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return tie


def _before_fork() -> None:
    global _tie_next_child
    _tie_next_child = getattr(_inside, "active", False)


def _after_fork_in_child() -> None:
    if _tie_next_child:
        die_with_parent()


@contextmanager
def children_die_with_this_thread() -> Iterator[None]:
    """Processes os.fork()ed by this thread while inside die with it (subprocess launches are not affected)."""
    global _registered
    if not _registered:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _registered = True
    _inside.active = True
    try:
        yield
    finally:
        _inside.active = False
