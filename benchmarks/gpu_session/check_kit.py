"""Check the GPU node kit where it runs: every distribution installed from .whl (SITE) has its requirements met by
what this interpreter sees (SITE first, then the node's own packages), and the modules tests/gpu and
benchmarks/gpu_throughput.py import load. Prints one line per problem and a summary; exits 0 always (a report).

    python3 benchmarks/gpu_session/check_kit.py SITE
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import sys
import time
import traceback
from pathlib import Path

# What tests/conftest.py, tests/gpu/* and benchmarks/gpu_throughput.py import, at the top or inside the code they run.
MODULES = [
    "torch", "triton", "numpy", "pandas", "pyarrow", "huggingface_hub", "typer", "rich", "prefect", "datatrove",
    "pydantic", "ruamel.yaml", "fsspec", "transformers", "datasets", "trl", "peft", "accelerate",
    "deepspeed", "liger_kernel.transformers.fused_linear_cross_entropy", "prometheus_client",
    "torch.utils.tensorboard", "pynvml", "tokenizers", "safetensors",
    "compass.flows.compiler", "compass.flows.cli.app", "compass.infra.store", "compass.model.training.trainer",
    "compass.model.training.preflight", "compass.tasks.common.training", "compass.tasks.post_training.trl_ranks",
    "compass.tasks.post_training.chat", "compass.tasks.post_training.adapters", "compass.tasks.evaluation.retrieval",
    "compass.flows.lifecycle",  # `compass preflight` resolves the store root there (imports prefect)
]
# Shipped for what importing them needs, not for all they can do: their other requirements (TensorBoard's server,
# Prefect's server and CLI, an OTLP exporter's protobufs, griffe's CLI colours) are left out on purpose.
PARTIAL = {"tensorboard", "prefect", "griffecli", "opentelemetry-exporter-otlp-proto-http"}
OPTIONAL = {"flash_attn", "flash_attn_interface", "bitsandbytes", "vllm"}  # not shipped: their tests say so


def requirements(site: Path) -> tuple[list[str], list[str]]:
    """(unmet requirements, unmet ones of PARTIAL distributions)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return ["packaging is not installed: requirements not checked"], []
    problems, by_design = [], []
    for info in sorted(site.glob("*.dist-info")):
        dist = md.Distribution.at(info)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            out = by_design if dist.metadata["Name"].lower() in PARTIAL else problems
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                out.append(f"{dist.metadata['Name']} {dist.version} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                out.append(f"{dist.metadata['Name']} {dist.version} needs {req}: {have} found")
    return problems, by_design


def main() -> None:
    site = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/site")
    problems, by_design = requirements(site) if site.is_dir() else ([f"{site}: no such folder"], [])
    for line in problems:
        print(f"requirement: {line}")
    if by_design:
        names = sorted({line.split(" needs ")[1].split(":")[0] for line in by_design})
        print(f"not shipped on purpose ({', '.join(sorted(PARTIAL))} import without them): {', '.join(names)}")
    failed, versions = [], []
    for name in MODULES:
        started = time.perf_counter()
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 (a report of every failure)
            failed.append(name)
            print(f"import {name}: FAILED {type(exc).__name__}: {exc}")
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
            for frame in frames[-4:]:
                print(f"    {frame.filename}:{frame.lineno} {frame.line}")
            continue
        version = getattr(module, "__version__", "")
        where = str(getattr(module, "__file__", "") or "").replace(str(site), "$SITE")
        print(f"import {name}: ok {version} {time.perf_counter() - started:.1f}s {where}")
        if version and "." not in name:
            versions.append(f"{name} {version}{' (kit)' if where.startswith('$SITE') else ''}")
    try:  # compiling any plan imports every step kind (the data kinds import datatrove.io)
        from compass.tasks.steps import registry

        print(f"step kinds: ok {len(registry.kinds())}")
    except Exception as exc:  # noqa: BLE001
        failed.append("step kinds")
        print(f"step kinds: FAILED {type(exc).__name__}: {exc}")
    for name in sorted(OPTIONAL):
        found = importlib.util.find_spec(name) is not None
        print(f"optional {name}: {'present' if found else 'absent (its test fails, as meant)'}")
    print("versions: " + ", ".join(versions))
    print(f"kit check: {len(problems)} unmet requirements, {len(failed)} failed imports"
          + (f" ({', '.join(failed)})" if failed else ""))


if __name__ == "__main__":
    main()
