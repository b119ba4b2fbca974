"""What the tracker tests read back from: a real `mlflow server` on loopback (SQLite backend and artifact folder in
a temp folder, stopped by PID) and a reader of W&B's offline run files (the records `wandb sync` uploads)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from compass.infra.net import free_port, wait_for_http
from tests.conftest import stop_group


@contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 with its artifacts proxied (clients upload through it); yields its URI."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(folder / "server.log", "wb")  # noqa: SIM115 (outlives this block: closed in finally)
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination",
         str(folder / "artifacts")], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # no job runner: MLflow 3 starts Huey consumers for its GenAI jobs (each ~5 s of CPU), which tracking never
        # uses (the suite started ~20 of them)
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for_http(f"{uri}/health", proc, timeout=120)
        except RuntimeError as exc:
            raise RuntimeError(f"mlflow server did not start ({exc}): "
                               f"{(folder / 'server.log').read_text()[-2000:]}") from None
        yield uri
    finally:
        stop_group(proc)
        log.close()


def wandb_offline_records(run_file: Path) -> Iterator[Any]:
    """The protobuf records of a W&B offline run file (`run-<id>.wandb`): a 7-byte header (`:W&B`, magic, version),
    then LevelDB-log blocks of 32 KiB whose chunks (crc32, length, type: full/first/middle/last) hold one record
    each."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    block, header = 32768, 7
    pos, pending = 7, b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        chunk = data[pos + header:pos + header + length]
        pos += header + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_offline_history(run_file: Path) -> list[dict[str, Any]]:
    """Each `run.log` of an offline run as {key: value} (W&B keeps a key in `key` or `nested_key`)."""
    import json

    return [{item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_offline_records(run_file) if record.WhichOneof("record_type") == "history"]
