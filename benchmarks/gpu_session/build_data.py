"""Build the minimal spec's data artifacts (ingest, curate, tokenizer, tokenize) here, for a GPU node that cannot
run the data steps itself (no datatrove/spaCy there): the same conftest helper the `data_store` fixture uses, run
once in this process, its store's artifacts copied to OUT/store with OUT/data.json naming each step's fingerprint
here. The `prebuilt_data` pytest plugin (beside this file) installs them on the GPU node under that node's own
fingerprints.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpu_session/build_data.py [OUT]   # OUT: .devkit/data
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / ".devkit" / "data"
    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    from compass.flows.compiler import compile_spec
    from compass.infra.manifest import code_version, library_versions
    from compass.specs import load_spec
    from tests.conftest import DATA_KINDS, _prepare, seeded

    scratch = os.environ.get("GPU_KIT_SCRATCH") or None
    with tempfile.TemporaryDirectory(prefix="compass-gpu-data-", dir=scratch) as tmp:
        folder = Path(tmp) / "prepared-data"
        folder.mkdir()
        started = time.time()
        _prepare(folder, DATA_KINDS)
        plan = compile_spec(load_spec(folder / "spec.yaml").spec).up_to(list(DATA_KINDS))
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        seeded(out / "store", folder)  # the artifacts only, as `seeded` copies them for a test
        info = {"kinds": list(DATA_KINDS), "fingerprints": {s.id: plan.fingerprints[s.id] for s in plan.steps},
                "repo": str(REPO), "code_version": code_version(), "libraries": library_versions(),
                "python": sys.version.split()[0],
                "seconds": round(time.time() - started, 1), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (out / "data.json").write_text(json.dumps(info, indent=2) + "\n")
    missing = [i for i, fp in info["fingerprints"].items()
               if not (out / "store" / i.split(":")[0] / f"{i.split(':')[1]}-{fp[:12]}" / "manifest.json").exists()]
    if missing:
        raise SystemExit(f"built, but no committed artifact for {missing} under {out / 'store'}")
    print(f"{len(info['fingerprints'])} data artifacts in {out} ({info['seconds']} s): "
          + ", ".join(info["fingerprints"]))


if __name__ == "__main__":
    main()
