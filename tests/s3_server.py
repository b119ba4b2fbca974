"""A real S3-compatible server (moto's) on 127.0.0.1 that a test can stop and start again, mid-request.

Moto keeps its buckets in this process's memory, so a server stopped and started again on the same port
still holds what was committed before: like a real object store coming back after an outage. `arm` makes the
next PUT whose path contains a marker hang until the server is stopped, and then drop its connection without
an answer: the client sees the server die in the middle of that upload.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import BaseWSGIServer, make_server

logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
KEY_ID = "compass-test"
SECRET = "compass-test-secret-key"


class RestartableS3:
    def __init__(self, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._app = DomainDispatcherApplication(create_backend_app)
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._marker: str | None = None
        self.hit = threading.Event()       # an armed PUT arrived
        self._released = threading.Event()  # the server was stopped: drop that PUT

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs: credentials and endpoint from the environment, as in production."""
        return {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.url, "AWS_EC2_METADATA_DISABLED": "true"}

    def _wsgi(self, environ: dict[str, Any], start_response: Any):
        marker = self._marker
        if marker and environ["REQUEST_METHOD"] == "PUT" and marker in environ.get("PATH_INFO", ""):
            self._marker = None
            self.hit.set()
            self._released.wait(60)
            raise ConnectionResetError("the S3 server went away mid-upload")  # werkzeug drops the connection
        return self._app(environ, start_response)

    def start(self) -> None:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # a cached instance may still talk to an earlier, stopped server
        self._released.clear()
        self._server = make_server("127.0.0.1", self.port, self._wsgi, threaded=True,
                                   request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening (new connections are refused) and drop the request held by `arm`."""
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._released.set()
        self._server = None

    def arm(self, marker: str) -> None:
        self.hit.clear()
        self._marker = marker

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
                            region_name="us-east-1")

    def create_bucket(self, name: str) -> None:
        """A bucket of that name, empty: moto keeps buckets in this process's memory for as long as it lives, so an
        earlier test of this pytest worker may have left one of the same name with its objects (and us-east-1
        answers a second create of one's own bucket with success): those are deleted."""
        client = self.client()
        client.create_bucket(Bucket=name)
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys})


@contextmanager
def s3_on_loopback(*buckets: str) -> Iterator[RestartableS3]:
    """A started server on a free loopback port holding `buckets`, stopped afterwards (a module's fixture)."""
    from compass.infra.net import free_port

    server = RestartableS3(free_port())
    server.start()
    try:
        for bucket in buckets:
            server.create_bucket(bucket)
        yield server
    finally:
        server.stop()
