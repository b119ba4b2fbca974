"""The plan's S3 check asks the whole AWS credential chain: a node whose only credentials are its instance role
(the metadata service, here a fake one on loopback speaking IMDSv2) passes; with no credentials anywhere the spec
is refused with the ways to provide them."""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from compass.infra.net import free_port
from tests.conftest import Cli, base_env, write_minimal_spec

ROLE = "compass-training-node"


class _MetadataService(BaseHTTPRequestHandler):
    """The instance metadata service's credential paths, as botocore's InstanceMetadataFetcher asks them."""

    def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/latest/api/token":
            self._reply(b"a-session-token")
        else:
            self._reply(b"", 404)

    def do_GET(self) -> None:  # noqa: N802
        if self.headers.get("X-aws-ec2-metadata-token") != "a-session-token":
            self._reply(b"", 401)
        elif self.path == "/latest/meta-data/iam/security-credentials/":
            self._reply(ROLE.encode())
        elif self.path == f"/latest/meta-data/iam/security-credentials/{ROLE}":
            expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=6)
            self._reply(json.dumps({"Code": "Success", "AccessKeyId": "ASIAROLEKEY", "SecretAccessKey": "secret",
                                    "Token": "session", "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}
                                   ).encode())
        else:
            self._reply(b"", 404)

    def _reply(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def metadata_service() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _MetadataService)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _no_credentials_env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in base_env(tmp_path / "prefect").items() if not k.startswith("AWS_")}
    return env | {"HOME": str(tmp_path / "home"), "AWS_EC2_METADATA_SERVICE_ENDPOINT": endpoint}


def test_an_instance_role_is_credentials_for_an_s3_store(tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{"how:\n": "how:\n  storage: {root: s3://team-runs/minimal}\n"})
    with metadata_service() as endpoint:
        done = Cli(tmp_path, _no_credentials_env(tmp_path, endpoint))("validate", str(spec), check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_credentials_anywhere_is_refused_with_the_ways_to_give_them(tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{"how:\n": "how:\n  storage: {root: s3://team-runs/minimal}\n"})
    closed = f"http://127.0.0.1:{free_port()}/"  # nothing listens: no instance role
    done = Cli(tmp_path, _no_credentials_env(tmp_path, closed) | {"COLUMNS": "400"})("validate", str(spec),
                                                                                     check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "s3://team-runs/minimal is on S3 and no S3 credentials are set on this machine" in done.stderr
    assert "an AWS profile, or how.storage.credentials_block" in done.stderr
