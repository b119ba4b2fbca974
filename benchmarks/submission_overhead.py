"""What the production path costs over `compass run`: the same data steps of the minimal spec run three ways,
each on a fresh store so every step executes.

  baseline   `compass run` in Prefect's embedded mode (the demo's way; includes the temporary server's start)
  server     `compass run` against a running local Prefect server
  submitted  `compass submit --watch` to a deployment, run by a process worker on that server

Prints wall time and the ratio to the baseline, and the peak RSS of the client command (for `submitted`, of
the worker and the flow run it started too, sampled).

    python benchmarks/submission_overhead.py [--rounds 3] [--until ingest curate ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import Run, report

from compass.infra.net import free_port, wait_for_http

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DATA_STEPS = ["ingest", "curate", "tokenizer", "tokenize"]


def env_for(home: Path, api: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"})
    if api:
        env["PREFECT_API_URL"] = api
    return env


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants, from /proc."""
    total, todo = 0, [pid]
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        todo.extend(children.get(p, []))
    return total / 2**20


class PeakSampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, tree_rss_mib(self.pid))


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--until", nargs="+", default=DATA_STEPS,
                        help="step kinds to run (default: the data steps; the tests run ingest only)")
    args = parser.parse_args()
    until = [a for kind in args.until for a in ("--until", kind)]
    work = Path(tempfile.mkdtemp(prefix="compass-bench-submit-"))
    spec = work / "spec.yaml"
    spec.write_text((REPO / "tests" / "specs" / "minimal.yaml").read_text()
                    .replace("../fixtures/", f"{REPO}/tests/fixtures/"))
    compass = str(BIN / "compass")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    server = subprocess.Popen([compass, "server", "--port", str(port)], env=env_for(work / "server", None),
                              cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    worker = None
    times: dict[str, list[float]] = {"baseline": [], "server": [], "submitted": []}
    peaks: list[float] = []
    try:
        wait_for_http(f"{api}/health", server)
        client = env_for(work / "client", api)
        subprocess.run([compass, "deploy"], env=client, cwd=work, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        allowed = client | {"COMPASS_ALLOWED_ROOTS": f"{REPO}/tests/fixtures"}  # the spec's local sources
        worker = subprocess.Popen([compass, "worker"], env=allowed, cwd=work, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(5)  # the worker polls its pool
        for i in range(args.rounds):  # interleaved: baseline, server, submitted, baseline, ...
            times["baseline"].append(timed([compass, "run", str(spec), "--store", str(work / f"s0-{i}"),
                                            *until], env_for(work / f"embedded-{i}", None), work))
            times["server"].append(timed([compass, "run", str(spec), "--store", str(work / f"s1-{i}"), *until],
                                         client, work))
            sampler = PeakSampler(worker.pid)
            sampler.start()
            times["submitted"].append(timed([compass, "submit", str(spec), "--store", str(work / f"s2-{i}"),
                                             "--watch", *until], client, work))
            sampler.done.set()
            peaks.append(sampler.peak)
        client_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    finally:
        for proc in (worker, server):
            if proc is not None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    labels = {"baseline": "compass run, embedded", "server": "compass run, local server",
              "submitted": "compass submit --watch, worker"}
    peak = {"baseline": client_rss, "server": client_rss, "submitted": statistics.median(peaks)}
    results = {labels[key]: [Run(seconds, peak[key]) for seconds in xs] for key, xs in times.items()}
    report(f"submission overhead: minimal spec, steps up to {', '.join(args.until)}, fresh store each time",
           results, labels["baseline"], "s", higher_is_better=False,
           notes=[f"peak memory: the worker and the flow run it started (sampled) for submit; the largest client "
                  f"command ({client_rss:,.0f} MiB) for the others"])


if __name__ == "__main__":
    main()
