"""Starting from an existing model (`what.model.init_from`): a small Llama built here and placed in a Hugging Face
cache as `hf download` leaves it. Its architecture and tokenizer come with it (a written architecture must agree,
a written tokenizer is refused); a spec without pretraining fine-tunes it; continued pretraining starts from its
weights; mid-training reads reasoning traces; the lineage names the checkpoint (URI, revision, sha256)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, VENV_BIN, base_env, run_up_to
from tests.hub_cache import COMMIT, seed_model, seed_smollm3_base, tiny_llama
from tests.shards import SHARD_SUFFIX, shard_records

REPO_ID = "acme/tiny-base"
SFT = """    - {method: sft, name: sft, dataset: "pypi://evals==3.0.1.post1", lr: 1.0e-3, max_samples: 16,
       max_length: 128, batch_size: 8}"""


def spec_text(what: str, name: str = "finetune", how: str = "") -> str:
    return f"""name: {name}
why:
  reason: research
  question: Does a short fine-tune of an existing base keep its accuracy?
  hypothesis: It does, within noise.
  success_criteria:
    - {{metric: "arc_easy:cf/acc", op: ">=", threshold: 0.0, checkpoint: final}}
what:
  model: {{init_from: {REPO_ID}}}
{what}
  evaluation:
    benchmarks:
      - {{name: arc_easy, formulation: cf, limit: 8}}
{how}"""


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    seed_model(root / "cache", REPO_ID, tiny_llama(root / "files"))
    return root / "cache"


@pytest.fixture
def offline_hub(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
    return hub_cache


def write(folder: Path, text: str) -> Path:
    path = folder / "spec.yaml"
    path.write_text(text)
    return path


def test_architecture_and_tokenizer_come_from_the_checkpoint(offline_hub: Path, tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    loaded = load_spec(write(tmp_path, spec_text(f"  post_training:\n{SFT}")))
    config = json.loads((offline_hub / "models--acme--tiny-base" / "snapshots" / COMMIT / "config.json").read_text())
    arch = loaded.spec.what.architecture
    assert (arch.num_layers, arch.hidden_size, arch.ffn_size, arch.num_heads, arch.num_kv_heads, arch.vocab_size) == (
        config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
        config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"])
    assert arch.tied_embeddings is False and arch.positions.kind == "rope"
    resolved = loaded.spec.what.model.resolved
    assert resolved.stamp == COMMIT and resolved.location == f"hf://{REPO_ID}" and resolved.model_type == "llama"

    plan = compile_spec(loaded.spec)
    assert plan.steps[0].id == "base_model:init"
    assert not [s for s in plan.steps if s.kind in ("tokenizer", "pretrain", "ingest")]
    assert plan.step("post_train:sft").inputs == {"tokenizer": "base_model:init", "previous": "base_model:init"}
    assert "evaluate:base_model-init" in plan.fingerprints  # the starting point is measured too
    # the checkpoint's snapshot is part of the identity: a new snapshot under the same name trains again
    replaced = loaded.spec.what.model.model_copy(update={"resolved": resolved.model_copy(update={"stamp": "d1" * 20})})
    moved = loaded.spec.model_copy(update={"what": loaded.spec.what.model_copy(update={"model": replaced})})
    again = compile_spec(moved)
    fence = ("fence_index:", "decontaminate:")  # the decontamination fence reads no model
    assert all(again.fingerprints[i] != plan.fingerprints[i] for i in plan.fingerprints if not i.startswith(fence))


def test_long_context_extends_the_checkpoints_own_context(offline_hub: Path, tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    what = f"""  data:
    sources:
      - {{name: notes, uri: {FIXTURES}/corpus/en, include: ["*.txt"]}}
  long_context:
    stages:
      - {{name: long, sequence_length: 1024, rope_theta: 100000, tokens: 8192, global_batch_size: 4,
         mixture: {{notes: 1.0}}}}"""
    loaded = load_spec(write(tmp_path, spec_text(what)))
    assert loaded.spec.what.trained_length == 512  # the checkpoint's max_position_embeddings
    step = compile_spec(loaded.spec).step("long_context:long")
    assert step.inputs["previous"] == "base_model:init" and step.config.previous_length == 512
    short = spec_text(what.replace("sequence_length: 1024", "sequence_length: 256"))
    from compass.specs.loader import SpecError

    with pytest.raises(SpecError, match="does not extend the context beyond 512"):
        load_spec(write(tmp_path, short))


def test_a_written_architecture_must_agree_and_the_tokenizer_comes_with_it(hub_cache: Path, tmp_path: Path):
    arch = "  architecture: {num_layers: %d, hidden_size: 32, ffn_size: 64, num_heads: 2, num_kv_heads: 1}\n"
    cases = {
        "disagrees": (arch % 3 + f"  post_training:\n{SFT}",
                      ["spec.yaml:10: what.architecture.num_layers: num_layers is 3 but the checkpoint acme/tiny-base "
                       "has 1", "make it agree"]),
        "tokenizer": (arch % 1 + "  tokenizer: {candidates: [{kind: bpe, vocab_size: 300}]}\n"
                      f"  post_training:\n{SFT}", ["what.tokenizer: the tokenizer comes with what.model.init_from",
                                                   "remove what.tokenizer"]),
        "missing": (f"  post_training:\n{SFT}", ["is not in the local Hugging Face cache",
                                                                 "hf download acme/tiny-base"]),
    }
    for name, (what, expected) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        write(folder, spec_text(what))
        cache = tmp_path / "empty" if name == "missing" else hub_cache
        env = base_env(tmp_path / "prefect") | {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
        done = subprocess.run([str(VENV_BIN / "compass"), "validate", "spec.yaml"], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (name, done.stdout, done.stderr)
        for text in expected:
            assert text in done.stderr, (name, done.stderr)
        assert not (folder / "store").exists()


def test_random_weights_still_need_an_architecture_a_tokenizer_and_a_stage(tmp_path: Path):
    from compass.specs.loader import SpecError, load_spec_text

    text = spec_text(f"  post_training:\n{SFT}").replace(f"  model: {{init_from: {REPO_ID}}}\n", "")
    with pytest.raises(SpecError) as raised:
        load_spec_text(text, "spec.yaml")
    shown = str(raised.value)
    for where in ("what.architecture: missing", "what.tokenizer: missing", "what.pretraining.stages: no pretraining",
                  "what.data.sources: no data source"):
        assert where in shown, shown
    assert "what.model.init_from" in shown


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


HOW = "how:\n  parallelism: {micro_batch_size: 2}\n"
TRACES = """  data:
    sources:
      - {name: traces, uri: "traces://arithmetic", domain: math, max_documents: 400,
         curation: {heldout_fraction: 0.1}}"""


@pytest.mark.slow
def test_fine_tuning_an_existing_base_runs_and_records_where_it_started(offline_hub: Path, tmp_path: Path):
    """No pretraining: the base goes through reasoning mid-training (worked traces, rendered in think mode) and a
    hybrid-reasoning SFT, and is evaluated beside the fine-tune; its lineage names the checkpoint."""
    what = f"""{TRACES}
  post_training:
    - {{method: mid_training, name: reasoning, dataset: traces, tokens: 8192, lr: 3.0e-3, batch_size: 4}}
{SFT[:-1]}, reasoning: {{think_fraction: 0.5}}}}"""
    spec = write(tmp_path, spec_text(what, how=HOW))
    plan, outcomes = run_up_to(spec, ["report:success", "evaluate:base_model-init"], tmp_path / "store")
    assert plan.step("mid_training:reasoning").inputs["previous"] == "base_model:init"
    base = outcomes["base_model:init"]
    snapshot = offline_hub / "models--acme--tiny-base" / "snapshots" / COMMIT
    digest = hashlib.sha256((snapshot / "model.safetensors").read_bytes()).hexdigest()
    (origin,) = [p for p in base.manifest.provenance if p.get("weights_sha256")]
    assert origin == {"model": REPO_ID, "source": f"hf://{REPO_ID}", "revision": COMMIT, "weights_sha256": digest}
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (Path(base.uri) / "chosen").iterdir()}

    documents = Path(outcomes["ingest:traces"].uri) / "documents"
    first = shard_records(next(documents.glob("*" + SHARD_SUFFIX)))[0]["text"]
    assert first.startswith("<|im_start|>system\n/think<|im_end|>\n<|im_start|>user\nWhat is ")
    assert re.search(r"<think>\n(-?[\d.]+ [-+*/] -?[\d.]+ = -?[\d.]+\n)+</think>\n-?[\d.]+<\|im_end\|>", first), first
    mid = outcomes["mid_training:reasoning"].manifest.metrics
    assert mid["method"] == "mid_training" and mid["final_loss"] < mid["first_loss"]  # it learns the traces

    sft = outcomes["post_train:sft"]
    assert sft.manifest.metrics["think_examples"] > 0
    before, after = _weights(snapshot), _weights(Path(sft.uri) / "final")
    key = "model.layers.0.mlp.down_proj.weight"
    assert before[key].shape == after[key].shape and not before[key].equal(after[key])
    report = json.loads((Path(outcomes["report:success"].uri) / "report.json").read_text())
    assert report["passed"] and report["criteria"][0]["checkpoint"] == "post_train:sft"
    assert "arc_easy:cf" in json.dumps(outcomes["evaluate:base_model-init"].manifest.metrics)  # the baseline


@pytest.mark.slow
def test_continued_pretraining_starts_from_the_checkpoint(offline_hub: Path, tmp_path: Path):
    """A stage at a learning rate too small to move the weights ends where the checkpoint began: it started from
    them, not from random weights (and trained on data tokenized by the checkpoint's tokenizer)."""
    what = f"""  data:
    sources:
      - {{name: notes, uri: {FIXTURES}/corpus/en, include: ["*.txt"], curation: {{heldout_fraction: 0.2}}}}
  pretraining:
    optimizer: {{lr: 1.0e-9}}
    schedule: {{kind: constant}}
    stages:
      - {{name: continued, tokens: 2048, sequence_length: 64, global_batch_size: 4, mixture: {{notes: 1.0}}}}"""
    spec = write(tmp_path, spec_text(what, name="continued", how=HOW))
    plan, outcomes = run_up_to(spec, "pretrain:continued", tmp_path / "store")
    assert plan.step("pretrain:continued").inputs["previous"] == "base_model:init"
    assert plan.step("tokenize:notes").inputs["tokenizer"] == "base_model:init"
    before = _weights(offline_hub / "models--acme--tiny-base" / "snapshots" / COMMIT)
    after = _weights(Path(outcomes["pretrain:continued"].uri) / "final")
    assert set(before) == set(after)
    assert max((before[k] - after[k]).abs().max().item() for k in before) < 1e-5
    metrics = outcomes["pretrain:continued"].manifest.metrics
    assert metrics["steps"] == 8 and metrics["resumed_from"] is None


def test_a_checkpoint_on_s3_is_read_stamped_and_copied(hub_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path):
    """From an S3-compatible server on loopback: config read when the spec loads, files copied by the first step
    with the URI and the weights' sha256 in the lineage; a changed object is a new identity."""
    import s3fs

    from compass.flows.compiler import compile_spec
    from compass.infra.net import free_port
    from compass.specs import load_spec
    from tests.s3_server import RestartableS3

    server = RestartableS3(free_port())
    server.start()
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        server.create_bucket("models")
        files = hub_cache / "models--acme--tiny-base" / "snapshots" / COMMIT
        for path in files.iterdir():
            server.client().put_object(Bucket="models", Key=f"tiny-base/{path.name}", Body=path.read_bytes())
        spec = write(tmp_path, spec_text(f"  post_training:\n{SFT}").replace(
            f"init_from: {REPO_ID}", "init_from: s3://models/tiny-base"))
        loaded = load_spec(spec)
        resolved = loaded.spec.what.model.resolved
        assert resolved.location == "s3://models/tiny-base" and resolved.stamp.startswith("files:")
        assert loaded.spec.what.architecture.hidden_size == 32
        _, outcomes = run_up_to(spec, "base_model:init", tmp_path / "store")
        (origin,) = outcomes["base_model:init"].manifest.provenance
        digest = hashlib.sha256((files / "model.safetensors").read_bytes()).hexdigest()
        assert origin == {"model": "s3://models/tiny-base", "source": "s3://models/tiny-base",
                          "revision": resolved.stamp, "weights_sha256": digest}
        before = compile_spec(loaded.spec).fingerprints["base_model:init"]
        server.client().put_object(Bucket="models", Key="tiny-base/config.json",
                                   Body=(files / "config.json").read_bytes() + b"\n")
        s3fs.S3FileSystem.clear_instance_cache()
        assert compile_spec(load_spec(spec).spec).fingerprints["base_model:init"] != before
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()  # the cached client would keep this server's endpoint




def test_the_fine_tune_example_plans_a_3b_base_read_from_its_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """specs/examples/smollm3-finetune.yaml writes no architecture: the one read from SmolLM3-3B-Base's config is
    the one the SmolLM3 pretraining example writes (same parameter count), and the plan has no pretraining."""
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec
    from compass.specs.costs import count_parameters

    seed_smollm3_base(tmp_path / "cache", tmp_path / "files")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    examples = Path(__file__).parent.parent / "specs" / "examples"
    loaded = load_spec(examples / "smollm3-finetune.yaml")
    derived, written = loaded.spec.what.architecture, load_spec(examples / "smollm3-3b.yaml").spec.what.architecture
    assert derived.positions.kind == "rnope" and derived.positions.nope_every == 4
    assert count_parameters(derived, 128256) == count_parameters(written, 128256)
    assert loaded.spec.what.trained_length == 65536
    plan = compile_spec(loaded.spec)
    assert [s.id for s in plan.steps[:2]] == ["gate:huggingfacetb-smollm3-3b", "base_model:init"]
    assert plan.step("base_model:init").inputs == {"gate:huggingfacetb-smollm3-3b": "gate:huggingfacetb-smollm3-3b"}
    assert not {"tokenizer", "pretrain", "long_context", "ablate"} & {s.kind for s in plan.steps}
    assert plan.step("mid_training:reasoning_mid").inputs["tokens:traces"] == "tokenize:traces"
    # its ZeRO-2 over 8 data-parallel ranks reaches SFT and mid-training: the node's 8 GPUs, not post-training's 1
    assert loaded.spec.how.shape("post_training").ranks == 8 == loaded.spec.how.parallelism.data_parallel
