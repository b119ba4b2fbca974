"""Overhead of a fully cached re-run: the lifecycle flow (Prefect tasks, artifacts, store checks) when every
step is committed, against the first full run on a fresh store and against checking the store directly without
Prefect. Rounds alternate full run and cached re-run, each round on a fresh store.

Runs on the test fixtures' minimal spec (local synthetic corpus) in Prefect's embedded mode; a warm-up flow
run starts the temporary server first so its start-up is not counted.

    python benchmarks/cached_rerun.py [--rounds 3] [--until KIND ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from harness import Run, note, peak_rss_mib, report

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--until", action="append", help="only these steps and what they need (repeatable)")
    args = parser.parse_args()
    from compass.infra.environment import prepare_environment

    work = Path(tempfile.mkdtemp(prefix="compass-bench-"))
    prepare_environment(work / ".compass")
    from compass.flows.compiler import compile_spec
    from compass.flows.lifecycle import lifecycle
    from compass.infra.store import Store
    from compass.specs import load_spec

    spec_path = REPO / "tests" / "specs" / "minimal.yaml"
    loaded = load_spec(spec_path)
    plan = compile_spec(loaded.spec)
    plan = plan.up_to(args.until) if args.until else plan

    def run(store: Path, until: list[str] | None) -> float:
        start = time.perf_counter()
        lifecycle(spec_yaml=loaded.text, spec_path=str(spec_path), base_dir=str(loaded.base_dir),
                  store_root=str(store), until=until)
        return time.perf_counter() - start

    run(work / "warm-up", ["ingest:notes"])  # start the embedded server, import everything
    full, cached, direct = [], [], []
    for i in range(args.rounds):
        store = work / f"store-{i}"
        full.append(run(store, args.until))
        cached.append(run(store, args.until))
        checked = Store(str(store))
        start = time.perf_counter()
        assert all(checked.is_committed(checked.uri(s.kind, s.name, plan.fingerprints[s.id])) for s in plan.steps)
        direct.append(time.perf_counter() - start)
    n = len(plan.steps)

    peak = peak_rss_mib()  # one process runs both: its peak is each variant's
    ratios = report(f"cached re-run: minimal spec, {n} steps, embedded Prefect (server start excluded), each round "
                    "on a fresh store", {"full run": [Run(x, peak) for x in full],
                                          "cached re-run": [Run(x, peak) for x in cached]},
                    "full run", "s", higher_is_better=False)
    med_cached, med_direct = statistics.median(cached), statistics.median(direct)
    note(f"goal: cached re-run <= 0.2x the full run (now {ratios['cached re-run']:.3f}x); the store's own check of "
         f"every step takes {med_direct * 1000:.2f} ms, so {(med_cached - med_direct) / n * 1000:.0f} ms per step "
         "are orchestration")

if __name__ == "__main__":
    main()
