"""Overhead of a fully cached re-run: the lifecycle flow (Prefect tasks, artifacts, store checks) when every
step is committed, against the first full run and against checking the store directly without Prefect.

Runs on the test fixtures' minimal spec (local synthetic corpus) in Prefect's embedded mode; a warm-up flow
run starts the temporary server first so its start-up is not counted.

    python benchmarks/cached_rerun.py
"""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    from compass.infra.environment import prepare_environment

    work = Path(tempfile.mkdtemp(prefix="compass-bench-"))
    prepare_environment(work / ".compass")
    from compass.flows.compiler import compile_spec
    from compass.flows.lifecycle import lifecycle
    from compass.infra.store import Store
    from compass.specs import load_spec

    spec_path = REPO / "tests" / "specs" / "minimal.yaml"
    loaded = load_spec(spec_path)
    store = str(work / "store")

    def run(until=None) -> float:
        start = time.perf_counter()
        lifecycle(spec_yaml=loaded.text, spec_path=str(spec_path), base_dir=str(loaded.base_dir),
                  store_root=store, until=until)
        return time.perf_counter() - start

    run(until=["none"])  # warm-up: start the embedded server, import everything
    full = run()
    cached = min(run() for _ in range(3))

    plan = compile_spec(loaded.spec)
    direct_store = Store(store)
    start = time.perf_counter()
    for _ in range(3):
        assert all(direct_store.is_committed(direct_store.uri(s.kind, s.name, plan.fingerprints[s.id]))
                   for s in plan.steps)
    direct = (time.perf_counter() - start) / 3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n = len(plan.steps)
    print(f"minimal spec, {n} steps, embedded Prefect (server start excluded)")
    print(f"  full run              {full:7.2f} s")
    print(f"  cached re-run         {cached:7.2f} s   ratio vs full run {cached / full:.3f}")
    print(f"  direct store check    {direct * 1000:7.2f} ms  cached re-run / direct check {cached / direct:.0f}x "
          f"({(cached - direct) / n * 1000:.0f} ms of orchestration per step)")
    print(f"  peak RSS of this process {rss:.0f} MiB")


if __name__ == "__main__":
    main()
