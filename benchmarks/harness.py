"""The method every benchmark here follows.

- Each variant runs in its own process (`child`), so its peak memory is its own (max RSS of the process and what
  it waited for) and no variant warms a cache for the next.
- Variants are interleaved over rounds (A B C A B C ...), never run back to back, so a change in the machine's
  load over time spreads over all variants instead of favouring one.
- Every process pins its thread count (`THREADS`, default 2): torch, OpenMP and BLAS use the same number of
  threads in every variant.
- The report gives each variant's median and spread (min to max over rounds) and its ratio to the baseline
  measured in the same run, with peak memory. One pass says little on a shared 2-core machine: read the spread.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench_results import BenchResult, Measured, Row, Section

THREADS = int(os.environ.get("COMPASS_BENCH_THREADS", "2"))
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def pin_threads() -> None:
    """In a child: the same thread count for torch's intra-op pool and every native library."""
    for name in THREAD_VARIABLES:
        os.environ[name] = str(THREADS)
    import torch

    torch.set_num_threads(THREADS)


@dataclass
class Run:
    value: float  # the measured quantity (throughput, seconds, bytes...)
    peak_mib: float
    details: dict = field(default_factory=dict)


def child(script: str, args: Sequence[str], cwd: Path | None = None, timeout: float = 3600) -> Run:
    """Run `script --child ARGS OUT` in a fresh process; it writes {"value": ..., ...} to OUT. Peak memory is the
    max RSS of that process (or of the largest process it waited for)."""
    with tempfile.TemporaryDirectory(prefix="compass-bench-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, **{name: str(THREADS) for name in THREAD_VARIABLES}}
        log = Path(tmp) / "child.log"
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, script, "--child", *args, str(out)], cwd=cwd, env=env,
                                    stdout=f, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            raise SystemExit(f"{Path(script).name} --child {' '.join(args)} failed:\n{log.read_text()[-3000:]}")
        result = json.loads(out.read_text())
    return Run(result.pop("value"), result.pop("peak_mib", usage.ru_maxrss / 1024), result)


def interleave(variants: dict[str, Callable[[], Run]], rounds: int) -> dict[str, list[Run]]:
    """Run every variant once per round, in the same order each round: A B C A B C ..."""
    results: dict[str, list[Run]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            results[name].append(run())
    return results


def report(title: str, results: dict[str, list[Run]], baseline: str, unit: str, higher_is_better: bool = True,
           notes: Sequence[str] = ()) -> dict[str, float]:
    """Print median (spread) and the ratio of medians to the baseline, with peak memory, and record the comparison
    in this script's result file (bench_results.py); returns the ratios."""
    base = statistics.median(r.value for r in results[baseline])
    base_mem = statistics.median(r.peak_mib for r in results[baseline])
    rounds = len(results[baseline])
    print(f"{title} — {rounds} round(s) interleaved, {THREADS} threads; median (min-max); ratio of medians vs "
          f"{baseline}" + ("" if higher_is_better else " (lower is better)"))
    ratios, rows = {}, []
    for name, runs in results.items():
        values = [r.value for r in runs]
        median = statistics.median(values)
        mem = statistics.median(r.peak_mib for r in runs)
        ratios[name] = median / base if base else float("nan")
        rows.append(Row(variant=name, median=median, low=min(values), high=max(values), rounds=len(runs),
                        ratio=ratios[name], peak_mib=mem, memory_ratio=mem / base_mem if base_mem else float("nan")))
        print(f"  {name:28s} {median:12,.2f} {unit} ({min(values):,.2f}-{max(values):,.2f})  "
              f"ratio {ratios[name]:6.3f}  peak RSS {mem:8,.0f} MiB  memory ratio {mem / base_mem:5.2f}")
    _record(Section(title=title, unit=unit, baseline=baseline, higher_is_better=higher_is_better, rows=tuple(rows)))
    for line in notes:
        note(line)
    return ratios


def note(line: str) -> None:
    """Print a finding derived from the last comparison (a ratio of ratios, a goal) and record it with it."""
    print(f"  {line}")
    if _sections:
        _sections[-1] = _sections[-1].with_note(line)
        _write()


_sections: list[Section] = []
_name: list[str] = []


def name_results(name: str) -> None:
    """The result file's name for a script that `make bench` runs more than one way (default: the script's)."""
    _name[:] = [name]


def _record(section: Section) -> None:
    _sections.append(section)
    _write()


def _write() -> None:
    """This script's result file, rewritten after each comparison: a run stopped half-way keeps what it measured."""
    BenchResult(benchmark=(_name or [Path(sys.argv[0]).stem])[0], argv=tuple(sys.argv[1:]), measured=Measured.here(),
                sections=tuple(_sections)).write()


def write_result(out: str | Path, value: float, **details: object) -> None:
    """In a child: what the parent's `child()` reads back."""
    Path(out).write_text(json.dumps({"value": value, **details}))


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


SPECS = Path(__file__).resolve().parent.parent / "tests" / "specs"


def minimal_spec() -> str:
    """The tests' minimal spec with the fixtures' absolute paths, as the tests' own specs name them (so its steps'
    fingerprints are those of the suite's prepared store)."""
    return (SPECS / "minimal.yaml").read_text().replace("../fixtures/", f"{SPECS.parent / 'fixtures'}/")


def seeded(store: Path) -> Path:
    """`store`, holding a copy of COMPASS_BENCH_PREPARED_STORE's artifacts when that is set (the test suite's
    prepared store of the minimal spec: a step found committed there is not run again), else as it is."""
    import shutil

    prepared = os.environ.get("COMPASS_BENCH_PREPARED_STORE")
    if prepared and not store.exists():
        shutil.copytree(prepared, store, ignore=shutil.ignore_patterns(".*", "monitoring"))
    return store


def fixture_job(work: Path, *, steps: int, seq: int, batch: int, micro: int, architecture: dict, parallelism: dict,
                checkpoints: dict):
    """A pretraining job on the test fixtures' corpus (the minimal spec's data steps run for real, once per
    `work` folder: `seeded`), with the given architecture fields, steps, sequence length and `how` changes."""
    import logging

    from compass.flows.compiler import compile_spec
    from compass.flows.runner import run_in_process
    from compass.infra.store import Store
    from compass.specs.loader import load_spec_text
    from compass.tasks.common.training import build_job
    from compass.tasks.steps.context import InputArtifact, Runtime, StepContext

    loaded = load_spec_text(minimal_spec(), str(SPECS / "minimal.yaml"), base_dir=SPECS)
    plan = compile_spec(loaded.spec)
    store = Store(str(seeded(work / "store")))
    run_in_process(plan.restricted_to({"ingest", "curate", "tokenizer", "tokenize"}), store, loaded.spec_hash,
                   Runtime(how=loaded.spec.how, base_dir=loaded.base_dir), logging.getLogger("bench"))
    step = plan.step("pretrain:stage1")
    inputs = {}
    for role, dep in step.inputs.items():
        uri = store.uri(*dep.split(":"), plan.fingerprints[dep])
        inputs[role] = InputArtifact(role, dep, uri, store.read_manifest(uri), store)
    how = loaded.spec.how
    how = how.model_copy(update={
        "parallelism": how.parallelism.model_copy(update={"micro_batch_size": micro, **parallelism}),
        "checkpoints": how.checkpoints.model_copy(update=checkpoints)})
    config = step.config
    stage = config.stages[0].model_copy(update={"tokens": steps * seq * batch, "sequence_length": seq,
                                                "global_batch_size": batch})
    # validated, not copied: a nested field given as a dict (positions) becomes its model, as a spec's would
    arch = type(config.architecture).model_validate({**config.architecture.model_dump(), **architecture})
    recipe = config.model_copy(update={"architecture": arch,
                                       "stages": [stage],
                                       "monitors": config.monitors.model_copy(update={"throughput": None})})
    return build_job(StepContext("pretrain", "stage1", recipe, inputs, work, work, work / "job", Runtime(how=how),
                                 logging.getLogger("bench")), recipe)
