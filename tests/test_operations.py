"""The operations commands refuse bad input before anything reaches the server (exit 2, nothing written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, Cli, base_env, prefect_client

pytestmark = pytest.mark.slow
BAD_SPEC = REPO / "tests" / "bad_specs" / "hosts_fewer_than_nodes.yaml"


def flow_run_count(api_url: str) -> int:
    with prefect_client(api_url) as client:
        return len(client.read_flow_runs(limit=200))


def test_a_bad_spec_never_reaches_the_server(server_cli: Cli, prefect_server: str):
    before = flow_run_count(prefect_server)
    done = server_cli("submit", str(BAD_SPEC), "--watch", check=False)
    assert done.returncode == 2
    assert f"{BAD_SPEC}:52: how.hardware.hosts: 1 hosts for nodes=2" in done.stderr
    done = server_cli("deploy", str(BAD_SPEC), check=False)
    assert done.returncode == 2 and "nothing was run or written" in done.stderr
    assert flow_run_count(prefect_server) == before


def test_submit_names_what_is_missing(server_cli: Cli, tmp_path: Path):
    spec = str(REPO / "specs" / "examples" / "tiny.yaml")
    done = server_cli("submit", spec, "--deployment", "no-such-flow/nowhere", check=False)
    assert done.returncode == 2 and "deployment 'no-such-flow/nowhere' not found" in done.stderr
    offline = Cli(tmp_path, base_env(tmp_path / "home"))  # no PREFECT_API_URL
    for command in (["submit", spec], ["status"], ["worker"], ["deploy"]):
        done = offline(*command, check=False)
        assert done.returncode == 2 and "needs a Prefect server" in done.stderr, command


def test_server_refuses_to_listen_beyond_loopback_without_auth(tmp_path: Path):
    cli = Cli(tmp_path, base_env(tmp_path / "home"))
    done = cli("server", "--host", "0.0.0.0", check=False)
    assert done.returncode == 2 and "PREFECT_SERVER_API_AUTH_STRING" in done.stderr
    for weak, why in (("x", "must be 'user:password'"), ("admin:secret", "password of 6 characters")):
        cli = Cli(tmp_path, base_env(tmp_path / "home") | {"PREFECT_SERVER_API_AUTH_STRING": weak})
        done = cli("server", "--host", "0.0.0.0", check=False)
        assert done.returncode == 2 and why in done.stderr, done.stderr


def test_the_prefect_home_compass_creates_is_private(tmp_path: Path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_HOME"}
    subprocess.run([sys.executable, "-c", "from compass.infra.environment import prepare_environment as p; p()"],
                   cwd=tmp_path, env=env, check=True)
    assert (tmp_path / ".compass" / "prefect").stat().st_mode & 0o777 == 0o700  # its database holds spec texts


def test_server_with_basic_auth_refuses_clients_without_it(tmp_path: Path):
    """The documented way to expose the server: Prefect's basic auth (tested on loopback)."""
    import base64
    import subprocess
    import urllib.error
    import urllib.request

    from compass.infra.net import free_port, wait_for_http
    from tests.conftest import VENV_BIN, stop_group

    port = free_port()
    env = base_env(tmp_path / "home") | {"PREFECT_SERVER_API_AUTH_STRING": "admin:compass-pw"}
    proc = subprocess.Popen([str(VENV_BIN / "compass"), "server", "--port", str(port)], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api/flow_runs/filter"

    def post(auth: str | None) -> int:
        request = urllib.request.Request(url, data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
        if auth:
            request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        wait_for_http(f"http://127.0.0.1:{port}/api/health", proc)
        code = post("admin:compass-pw")
        assert code == 200 and post(None) == 401 and post("admin:wrong") == 401
        client = base_env(tmp_path / "client") | {"PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
        assert Cli(tmp_path, client | {"PREFECT_API_AUTH_STRING": "admin:compass-pw"})("status", "--json")
        refused = Cli(tmp_path, client)("status", "--json", check=False)
        assert refused.returncode != 0
    finally:
        stop_group(proc)
