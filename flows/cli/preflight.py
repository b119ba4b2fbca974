"""`compass preflight SPEC`: every rank of this node measured (compass.model.training.preflight), judged against its
peers and the expected figures, printed as a table per node and rank; exit 1 with the nodes to exclude."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from compass.flows.cli.common import SpecArg, err, load, out, refuse_write_option, store_root
from compass.infra.net import free_port
from compass.specs.how import PEAK_TFLOPS
from compass.specs.scaling import MATMUL_SHARE_OF_PEAK as ACHIEVABLE


def preflight(spec: SpecArg,
              ranks: Annotated[int | None, typer.Option(help="Processes on this node (default: the spec's "
                                                        "devices_per_node).")] = None,
              duration: Annotated[float, typer.Option(help="Seconds to repeat the tests (a burn-in); the worst "
                                                      "round counts.")] = 0.0,
              tolerance: Annotated[float, typer.Option(min=0.0, max=1.0, help="Flag a rank this far below the "
                                                       "median of its peers or the expected figure.")] = 0.15,
              megabytes: Annotated[int, typer.Option(min=1, help="Size of the all-reduce and of the file written "
                                                     "to the store and the staging folder.")] = 64,
              staging: Annotated[Path | None, typer.Option(help="The node-local staging folder to test (NVMe, "
                                                           "/scratch).")] = None,
              as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Matmul throughput per device, all-reduce bandwidth across ranks, store and staging throughput, and (on
    GPUs) NVML health; flags stragglers. On Slurm, run it on every node with
    `srun --ntasks-per-node=1 python -m torch.distributed.run --nnodes $SLURM_NNODES ...
    -m compass.model.training.preflight`
    the way training runs, or here for this node."""
    from compass.model.training.preflight import judge

    refuse_write_option("--staging", staging, "preflight's staging test")
    checked = load(spec)
    how = checked.loaded.spec.how
    hw = how.hardware
    n = ranks or hw.devices_per_node
    root = store_root(checked, None)
    store = None if root.startswith("s3://") else Path(root)
    with tempfile.TemporaryDirectory(prefix="compass-preflight-") as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
                   str(free_port()), "-m", "compass.model.training.preflight", folder, str(store or ""),
                   str(staging or ""), str(duration), str(megabytes),
                   "packed" if how.attention in ("varlen", "auto") else "none"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            err.print(f"preflight failed ({done.returncode}):\n{done.stderr[-3000:]}", markup=False)
            raise typer.Exit(1)
        rows = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank-*.json"))]
    expected = {"matmul_tflops": ACHIEVABLE * hw.peak} if hw.accelerator != "cpu" else {}
    verdict = judge(rows, tolerance, expected)
    if as_json:
        print(json.dumps({"rows": verdict.rows, "flagged": verdict.flagged, "exclude": verdict.exclude,
                          "expected": expected, "peak_tflops": PEAK_TFLOPS.get(hw.accelerator)}, indent=2))
    else:
        _print(verdict, expected)
    if verdict.flagged:
        raise typer.Exit(1)


def _packed(row: dict) -> str:
    packed = row.get("packed_attention")
    if not packed:
        return "-"
    verdict = "ok" if packed["ok"] else "FAILED"
    return f"{verdict}: {packed['kernel']} {packed['dtype']}, torch {packed['torch']}"


def _print(verdict, expected: dict[str, float]) -> None:

    table = Table(title="compass preflight", title_justify="left")
    for col in ("node", "rank", "device", "matmul TFLOPS", "all-reduce GB/s", "store w/r MB/s", "staging w/r MB/s",
                "GPU", "packed attention"):
        table.add_column(col, overflow="fold")
    for r in verdict.rows:
        gpu = r.get("gpu") or {}
        io = {k: f"{r[k]['write_mbps']:.0f}/{r[k]['read_mbps']:.0f}" if k in r else "-" for k in ("store", "staging")}
        table.add_row(escape(r["node"]), str(r["rank"]), escape(r["device"]), f"{r['matmul_tflops']:.3g}",
                      "-" if r["allreduce_busbw_gbps"] is None else f"{r['allreduce_busbw_gbps']:.3g}",
                      io["store"], io["staging"],
                      f"{gpu['temperature_c']}C {gpu['sm_clock_mhz']}MHz" if gpu else "-", _packed(r))
    out.print(table)
    if expected:
        out.print(f"expected matmul: {expected['matmul_tflops']:.0f} TFLOPS ({ACHIEVABLE:.0%} of the data sheet)")
    for node, why in verdict.flagged.items():
        out.print(f"[red]{escape(node)}[/red]: " + escape("; ".join(why)))
    out.print(verdict.exclude or "every rank within tolerance")
