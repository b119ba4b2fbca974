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
