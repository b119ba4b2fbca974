"""Every file a step reads is in its identity (issue 75, item 1): a post-training dataset (local or s3://), a local
or hub tokenizer candidate, a source on s3:// are stamped when the spec loads (names, sizes, mtimes; sha256 under
`how.storage.input_stamps: content`; ETags on S3), so editing one re-runs exactly the steps that read it and their
descendants; the stamp is recorded in the manifest's provenance, `lineage` shows it and `why` names the file that
changed. A stamp is compass's to fill in: one written in the spec is refused."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from compass.flows.compiler import compile_spec
from compass.specs import load_spec
from compass.specs.loader import SpecError
from tests.conftest import write_minimal_spec

CHAT = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                      {"role": "assistant", "content": f"{i} + {i} is {2 * i}."}]} for i in range(8)]
SFT = "{method: sft, name: chat, dataset: DATA, lr: 1.0e-3, max_samples: 4, max_length: 64}"


def write_chat(folder: Path, rows: list[dict] = CHAT, name: str = "chat.jsonl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def sft_spec(folder: Path, dataset: str, how: str = "") -> Path:
    return write_minimal_spec(folder, **{"  pretraining:": f"  post_training:\n    - {SFT.replace('DATA', dataset)}\n"
                                                           "  pretraining:", "how:\n": f"how:\n{how}"})


def fingerprints(spec: Path) -> dict[str, str]:
    return compile_spec(load_spec(spec).spec).fingerprints


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {step for step in before if before[step] != after[step]}


def test_editing_adding_removing_or_renaming_a_dataset_file_reruns_only_its_step(tmp_path: Path):
    data = write_chat(tmp_path / "sft")
    spec = sft_spec(tmp_path, str(data))
    first = fingerprints(spec)
    assert fingerprints(spec) == first  # untouched: reused
    (data / "README.md").write_text("not a JSONL file: never read")
    assert fingerprints(spec) == first

    page = data / "chat.jsonl"
    page.write_text(page.read_text().replace("is 0.", "is 00"))  # the same size, another answer
    edited = fingerprints(spec)
    assert changed(first, edited) == {"post_train:chat"}
    write_chat(data, CHAT[:2], "more.jsonl")
    added = fingerprints(spec)
    assert changed(edited, added) == {"post_train:chat"}
    (data / "more.jsonl").rename(data / "renamed.jsonl")
    renamed = fingerprints(spec)
    assert changed(added, renamed) == {"post_train:chat"}
    (data / "renamed.jsonl").unlink()
    assert changed(renamed, fingerprints(spec)) == {"post_train:chat"}


def test_content_stamps_follow_the_bytes_not_the_dates(tmp_path: Path):
    data = write_chat(tmp_path / "sft")
    spec = sft_spec(tmp_path, str(data), "  storage: {input_stamps: content}\n")
    page = data / "chat.jsonl"
    first = fingerprints(spec)
    os.utime(page, ns=(page.stat().st_atime_ns, page.stat().st_mtime_ns + 10**9))  # touched, the same bytes
    assert fingerprints(spec) == first
    page.write_text(page.read_text().replace("is 2.", "is 3."))  # the same size: hashed again, as its date moved
    edited = fingerprints(spec)
    assert changed(first, edited) == {"post_train:chat"}
    page.write_text(page.read_text().replace("is 3.", "is 2."))  # the first bytes again: the first identity
    assert fingerprints(spec) == first


def test_a_local_tokenizer_candidate_and_a_hub_snapshot_are_stamped(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    local = tmp_path / "tok"
    local.mkdir()
    (local / "tokenizer.json").write_text('{"version": "1.0"}')
    cache = tmp_path / "hub"
    snapshots = cache / "models--org--tok" / "snapshots"
    for commit in ("a" * 40, "b" * 40):
        (snapshots / commit).mkdir(parents=True)
        (snapshots / commit / "tokenizer.json").write_text(f'{{"commit": "{commit}"}}')
    (cache / "models--org--tok" / "refs").mkdir()
    (cache / "models--org--tok" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    spec = write_minimal_spec(tmp_path, **{"      - {kind: bpe, vocab_size: 400}\n":
                                           "      - {kind: bpe, vocab_size: 400}\n"
                                           f"      - {{kind: local, name: mine, path: {local}}}\n"
                                           "      - {kind: hub, repo: org/tok, vocab_size: 300}\n"})
    first = fingerprints(spec)
    steps = {s for s in first if s.startswith("tokenizer:")}
    (local / "tokenizer.json").write_text('{"version": "2.0"}')
    edited = fingerprints(spec)
    assert changed(first, edited) >= steps and not changed(first, edited) & {"ingest:notes", "curate:notes"}
    (cache / "models--org--tok" / "refs" / "main").write_text("b" * 40)  # main moved to another commit
    assert changed(edited, fingerprints(spec)) >= steps


def test_a_stamp_written_in_the_spec_is_refused(tmp_path: Path):
    data = write_chat(tmp_path / "sft")
    step = SFT.replace("DATA", str(data)).replace("}", ", dataset_stamp: {location: x, method: listing, files: 1, "
                                                       "bytes: 1, digest: abc}}")
    spec = write_minimal_spec(tmp_path, **{"  pretraining:": f"  post_training:\n    - {step}\n  pretraining:"})
    with pytest.raises(SpecError) as refused:
        load_spec(spec)
    (problem,) = refused.value.problems
    assert problem.path == "what.post_training[0].dataset_stamp"
    assert "filled in by compass when it loads the spec" in problem.message and problem.hint == "remove dataset_stamp"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    from tests.s3_server import s3_on_loopback

    with s3_on_loopback("data") as server:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        yield server


def test_an_s3_dataset_and_an_s3_source_are_stamped_by_their_objects(tmp_path: Path, s3):
    client = s3.client()
    body = "".join(json.dumps(r) + "\n" for r in CHAT)
    client.put_object(Bucket="data", Key="sft/chat.jsonl", Body=body.encode())
    client.put_object(Bucket="data", Key="notes/a.txt", Body=b"A document about learning rates, long enough.")
    spec = sft_spec(tmp_path, "s3://data/sft")
    text = spec.read_text()
    spec.write_text(text.replace(text.split("uri: ")[1].split("\n")[0], "s3://data/notes", 1))
    loaded = load_spec(spec).spec
    assert loaded.what.post_training[0].dataset_stamp.method == "etag"
    assert loaded.what.post_training[0].dataset_stamp.files == 1 and loaded.what.data.sources[0].listing
    first = fingerprints(spec)
    client.put_object(Bucket="data", Key="sft/chat.jsonl", Body=body.replace("is 0.", "is 00").encode())
    edited = fingerprints(spec)
    assert changed(first, edited) == {"post_train:chat"}
    client.put_object(Bucket="data", Key="notes/b.txt", Body=b"Another document, added to the source's prefix.")
    assert "ingest:notes" in changed(edited, fingerprints(spec))


def _flip_a_byte_keeping_its_date(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_artifact_verify_found_damaged_is_never_reused(tmp_path: Path, data_store: Path):
    """After `compass verify --full` finds a committed file changed (a bad sector: the same size and date), the
    plan says the step runs again and the run recomputes it; a resized file is caught under every verify depth."""
    from typer.testing import CliRunner

    from compass.flows.cli.app import app
    from compass.flows.reports.plan_status import plan_status
    from compass.infra.store import STORE_MARKER, Store
    from tests.conftest import run_up_to, seeded

    store = seeded(tmp_path / "store", data_store)
    (store / STORE_MARKER).touch()  # as a run's first commit leaves it
    spec = write_minimal_spec(tmp_path)
    plan = compile_spec(load_spec(spec).spec)
    assert all(s.state == "cached" for s in plan_status(plan, Store(str(store))) if s.step_id.startswith("ingest"))
    (manifest,) = store.glob("ingest/notes-*/manifest.json")  # hashed by that check: its stamps trust its files
    shard = next(p for p in manifest.parent.rglob("*") if p.is_file() and p.name != "manifest.json")
    _flip_a_byte_keeping_its_date(shard)
    done = CliRunner().invoke(app, ["verify", str(store), "--full"])
    assert done.exit_code == 1 and "ingest/notes-" in done.output, done.output
    states = {s.step_id: s for s in plan_status(plan, Store(str(store)))}
    assert states["ingest:notes"].state == "run" and "altered after its commit" in states["ingest:notes"].reason
    assert states["ingest:code"].state == "cached"
    _, outcomes = run_up_to(spec, ["ingest:notes", "ingest:code"], store)
    assert outcomes["ingest:notes"].executed and not outcomes["ingest:code"].executed

    (manifest,) = store.glob("ingest/code-*/manifest.json")
    shard = next(p for p in manifest.parent.rglob("*") if p.is_file() and p.name != "manifest.json")
    with open(shard, "ab") as f:
        f.write(b"!")
    sizes = write_minimal_spec(tmp_path, **{"how:\n": "how:\n  storage: {verify: sizes}\n"})
    states = {s.step_id: s for s in plan_status(compile_spec(load_spec(sizes).spec), Store(str(store)))}
    assert states["ingest:code"].state == "run" and "bytes, committed with" in states["ingest:code"].reason


@pytest.mark.slow
def test_an_edited_sft_dataset_trains_again_and_why_and_lineage_name_it(tmp_path: Path, trained_store: Path):
    """The case of the issue, through the commands: SFT committed, every answer of its dataset rewritten; `why`
    says the dataset changed, the plan runs the step again, its manifest records the dataset's stamp and `lineage`
    shows it."""
    from typer.testing import CliRunner

    from compass.flows.cli.app import app
    from tests.conftest import run_up_to, seeded

    data = write_chat(tmp_path / "sft")
    spec = sft_spec(tmp_path, str(data))
    store = seeded(tmp_path / "store", trained_store)
    _, outcomes = run_up_to(spec, "post_train:chat", store)
    assert outcomes["post_train:chat"].executed and not outcomes["pretrain:stage2"].executed
    manifest = outcomes["post_train:chat"].manifest
    (files,) = [p for p in manifest.provenance if p.get("kind") == "files"]
    assert files["field"] == "dataset_stamp" and files["location"] == str(data) and files["files"] == 1

    lineage = CliRunner().invoke(app, ["lineage", manifest.uri])
    assert lineage.exit_code == 0 and f"files (dataset_stamp): {data}: 1 file," in lineage.output, lineage.output
    cached = CliRunner().invoke(app, ["why", "post_train:chat", str(spec), "--store", str(store)])
    assert "post_train:chat is reused" in cached.output, cached.output

    write_chat(data, [{"messages": [m if m["role"] == "user" else {**m, "content": "I do not know."}
                                    for m in row["messages"]]} for row in CHAT])
    why = CliRunner().invoke(app, ["why", "post_train:chat", str(spec), "--store", str(store)])
    assert why.exit_code == 0, why.output
    assert f"post_train:chat runs: dataset changed: {data}" in " ".join(why.output.split()), why.output
    assert "config changed" not in why.output  # the stamp's digits are not shown as fields
    _, again = run_up_to(spec, "post_train:chat", store)
    assert again["post_train:chat"].executed and again["post_train:chat"].uri != manifest.uri
