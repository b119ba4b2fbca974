"""Every test file on its own, and the suite with its files shuffled: a file whose verdict depends on which files ran
before it in its worker (logging configured, a module imported, a setting left behind) fails one of the two.

    .venv/bin/python tests/tools/isolation.py [--alone] [--shuffled] [--seed N] [--jobs 2] [--files a.py b.py]

`--alone` runs `pytest FILE` once per file (`--jobs` at a time, each with its own --basetemp and no cache
provider), `--shuffled` runs the suite as `make test` does with the files in an order drawn from `--seed` (printed;
tests/tools/shuffle_files.py). With neither flag, both. A run also fails when its output says a Prefect log handler
outlived its server ("Error logging to API"). Logs go to --out (a folder), the report to stdout and report.json
there. Not part of `make test`: it runs the suite more than twice over (about an hour and a half on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
LEAKED_HANDLER = "Error logging to API"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu"]


@dataclass(frozen=True)
class FileRun:
    """One pytest run's verdict."""

    name: str
    passed: bool
    exit_code: int
    leaked_handler: bool
    seconds: float
    log: str
    summary: str


def suite_files() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


def _run(name: str, args: list[str], out: Path, env: dict[str, str], timeout: float) -> FileRun:
    log = out / f"{name}.log"
    start = time.monotonic()
    with open(log, "w") as sink:
        try:
            code = subprocess.run(args, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = -9
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if " passed" in line or " failed" in line or " error" in line]
    leaked = LEAKED_HANDLER in text
    # 5: no test selected (a file of gpu tests only)
    return FileRun(name, code in (0, 5) and not leaked, code, leaked, round(seconds, 1), str(log),
                   lines[-1].strip() if lines else f"exit {code}")


def _env() -> dict[str, str]:
    """As `make test` sets it; no PYTHONPATH (`python -m pytest` in the checkout finds tests.tools, and a test
    checks that the top-level folders do not import from elsewhere)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}


def alone(files: list[Path], out: Path, jobs: int) -> list[FileRun]:
    """`pytest FILE` for each file, `jobs` at a time."""
    folder = out / "alone"
    folder.mkdir(parents=True, exist_ok=True)

    def one(path: Path) -> FileRun:
        basetemp = Path(tempfile.mkdtemp(prefix=f"alone-{path.stem}-"))
        done = _run(path.stem, [*PYTEST, f"--basetemp={basetemp}", str(path.relative_to(REPO))], folder, _env(),
                    timeout=3600)
        print(f"{'ok  ' if done.passed else 'FAIL'} {done.seconds:7.1f}s  {path.name}  {done.summary}", flush=True)
        subprocess.run(["rm", "-rf", str(basetemp)], check=False)
        return done

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, files))


def shuffled(out: Path, seed: int) -> FileRun:
    """The suite as `make test` runs it, its files in the order `seed` draws."""
    print(f"shuffled suite, seed {seed}", flush=True)
    args = [*PYTEST, "-n", "4", "--dist", "loadfile", "--no-loadscope-reorder", "-p", "tests.tools.shuffle_files",
            "tests"]
    done = _run(f"shuffled-{seed}", args, out, _env() | {"COMPASS_SHUFFLE_SEED": str(seed)}, timeout=3 * 3600)
    print(f"{'ok  ' if done.passed else 'FAIL'} {done.seconds:7.1f}s  shuffled suite  {done.summary}", flush=True)
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alone", action="store_true")
    parser.add_argument("--shuffled", action="store_true")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--files", nargs="*", default=None, help="test file names (default: every tests/test_*.py)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "compass-isolation")
    args = parser.parse_args()
    both = not args.alone and not args.shuffled
    args.out.mkdir(parents=True, exist_ok=True)
    files = [TESTS / name for name in args.files] if args.files else suite_files()
    start = time.monotonic()
    runs: list[FileRun] = []
    if args.alone or both:
        runs += alone(files, args.out, args.jobs)
    if args.shuffled or both:
        runs.append(shuffled(args.out, args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)))
    failed = [run for run in runs if not run.passed]
    report = {"seconds": round(time.monotonic() - start, 1), "runs": [asdict(run) for run in runs],
              "failed": [run.name for run in failed]}
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"\n{len(runs)} runs in {report['seconds']:.0f} s; {len(failed)} failed"
          + "".join(f"\n  {run.name}: {run.summary}{' (Error logging to API)' if run.leaked_handler else ''}"
                    f"  log {run.log}" for run in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
