"""The suite's order on its workers: longest files first, and each file's time and CPU printed at the end.

`make test` gives pytest-xdist one file at a time per worker (`--dist loadfile`). The suite ends when the last
file ends, so a 7-minute file started last keeps one core busy alone for 7 minutes: the longest files go first
(the longest-processing-time rule), and the rest keep their order. The list holds the files' measured totals
from the last full run (printed by this plugin as "slowest files"); update it when they change.
"""

from __future__ import annotations

import resource
from collections import defaultdict

import pytest

# The "slowest files" table of the last full run (`bash .ci/run` of 7e4ec59 in a clean clone, four workers on 2
# cores: 7856 s of tests in 2005 s), longest first.
LONGEST_FIRST = (
    "test_production.py", "test_rehearsal_faults.py", "test_placement_slurm.py", "test_post_training_scale.py",
    "test_fsdp2.py", "test_benchmarks_flows.py", "test_team_server.py", "test_data_scale_slurm.py",
    "test_benchmarks.py", "test_post_training_scale_slurm.py", "test_ray.py", "test_benchmarks_training.py",
    "test_observability_events.py", "test_training_core.py", "test_slurm.py", "test_s3_store.py",
    "test_scheduled_eval.py", "test_training.py", "test_rehearsal_partitions.py", "test_rehearsal_cluster.py",
    "test_field_walk.py", "test_chaos.py", "test_post_training.py", "test_gpu_path_zero.py",
    "test_newcomer_tutorial.py", "test_lifecycle.py", "test_decontamination.py", "test_data_scale_s3.py",
    "test_planner.py", "test_tensor_parallel.py",
)

_seconds: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = defaultdict(float)
CPU_KEY = "cpu_s"
_START = pytest.StashKey[float]()  # a test's CPU reading when its setup begins


def cpu_now() -> float:
    """CPU seconds of this process and of every process it (or they) started and waited for: a test's processes
    (ranks, servers, commands) count once they end. With the machine busy, CPU and not wall time says what a test
    costs the suite."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_START] = cpu_now()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    if call.when == "teardown" and _START in item.stash:  # the report travels to xdist's controller with its CPU
        outcome.get_result().user_properties.append((CPU_KEY, cpu_now() - item.stash[_START]))



def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    _seconds[path] += report.duration  # setup, call and teardown
    _cpu[path] += sum(value for key, value in report.user_properties if key == CPU_KEY)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    terminalreporter.write_sep("=", "slowest files (setup + call + teardown; CPU of the worker and what it waited for)")
    for path, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1])[:30]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {_cpu[path]:8.1f}s CPU  {path}")
    terminalreporter.write_line(f"{sum(_seconds.values()):8.1f}s  {sum(_cpu.values()):8.1f}s CPU  in all test files")
