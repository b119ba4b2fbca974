"""The training core at scale, checked on CPU: packed attention without a dense mask (every backend that runs
here), the loss without full fp32 logits, per-rank packing whose union is the single-process batch at a cost
that does not grow with the step, prefetching, one host sync per optimizer step, the step-time breakdown, and
background checkpoints that a kill -9 mid-write cannot corrupt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from compass.model.architecture import build_model, hf_config
from compass.model.attention import DOCUMENT_SDPA
from compass.model.lm import CausalLMWithLoss
from compass.model.loss import chunked_lm_loss, lm_loss
from compass.model.training.callbacks import Callback
from compass.model.training.packing import PADDING, Packer, Prefetcher, RowPacker, make_batch, merge_states
from compass.specs.architecture import Architecture
from tests.conftest import REPO

ARCH = Architecture(num_layers=4, hidden_size=64, ffn_size=160, num_heads=4, num_kv_heads=2,
                    positions={"kind": "rnope", "nope_every": 4})
SPECIAL = {"bos": 0, "eos": 0, "pad": 1}
BACKENDS = {"sdpa": DOCUMENT_SDPA, "eager": "eager", "flex": "flex_attention"}  # flash needs CUDA


def model(implementation: str, vocab: int = 300, seed: int = 3):
    return build_model(hf_config(ARCH, vocab, SPECIAL, 128), seed, implementation).eval()


def packed_row(*documents: np.ndarray, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = np.concatenate([*documents, np.ones(pad, dtype=np.int64)])[None]
    segments = np.concatenate([np.full(len(d), i) for i, d in enumerate(documents)] + [np.full(pad, PADDING)])[None]
    batch = make_batch(tokens, segments.astype(np.int64))
    return batch.input_ids, batch.position_ids


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_packed_attention_keeps_documents_apart_without_a_mask(backend: str):
    """Changing one document of a packed row leaves the others' logits unchanged, each document's logits are
    its logits alone, and padding changes nothing."""
    m = model(BACKENDS[backend])
    rng = np.random.default_rng(0)
    a, b, c = rng.integers(2, 300, 11), rng.integers(2, 300, 17), rng.integers(2, 300, 9)
    other_b = rng.integers(2, 300, 17)
    with torch.no_grad():
        ids, pos = packed_row(a, b, c, pad=5)
        together = m(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        ids2, pos2 = packed_row(a, other_b, c, pad=5)
        changed = m(input_ids=ids2, position_ids=pos2, use_cache=False).logits[0]
        ids3 = ids.clone()
        ids3[0, -5:] = 7  # different padding tokens
        repadded = m(input_ids=ids3, position_ids=pos, use_cache=False).logits[0]
        alone = [m(input_ids=torch.from_numpy(d)[None], use_cache=False).logits[0] for d in (a, b, c)]
    spans = [(0, 11), (11, 28), (28, 37)]
    torch.testing.assert_close(changed[0:11], together[0:11], atol=1e-6, rtol=0)
    torch.testing.assert_close(changed[28:37], together[28:37], atol=1e-6, rtol=0)
    assert not torch.allclose(changed[11:28], together[11:28], atol=1e-3)
    torch.testing.assert_close(repadded[:37], together[:37], atol=1e-6, rtol=0)
    for (s, e), solo in zip(spans, alone, strict=True):
        torch.testing.assert_close(together[s:e], solo, atol=1e-5, rtol=1e-4)


def test_packed_loss_equals_the_documents_losses_unpacked():
    lm = CausalLMWithLoss(model(DOCUMENT_SDPA))
    rng = np.random.default_rng(1)
    docs = [rng.integers(2, 300, n) for n in (13, 21, 8)]
    tokens = np.concatenate(docs)[None]
    segments = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        _, packed = lm(**make_batch(tokens, segments).inputs(torch.device("cpu")))
        per_doc = [lm(**make_batch(d[None], np.zeros((1, len(d)), dtype=np.int64)).inputs(torch.device("cpu")))[1]
                   for d in docs]
    weights = [len(d) - 1 for d in docs]  # each document predicts all but its first token
    expected = sum(w * float(x) for w, x in zip(weights, per_doc, strict=True)) / sum(weights)
    assert float(packed) == pytest.approx(expected, abs=1e-5)


def test_flex_attention_is_refused_for_training_on_cpu():
    from compass.model.attention import unavailable

    assert "no backward pass on CPU" in unavailable("flex", cuda=False)
    assert "CUDA" in unavailable("flash", cuda=False)
    assert unavailable("sdpa", cuda=False) is None and unavailable("eager", cuda=False) is None


@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_chunked_loss_equals_the_full_logits_loss(z_loss: float):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 1000, bias=False)
    hidden = torch.randn(3, 50, 32, requires_grad=True)
    labels = torch.randint(0, 1000, (3, 50))
    labels[0, :7] = -100
    labels[2, 30:] = -100
    full, full_ce = lm_loss(head(hidden), labels, z_loss)
    chunked, chunked_ce = chunked_lm_loss(hidden, labels, head, z_loss, chunk_tokens=17)
    assert float(chunked) == pytest.approx(float(full), abs=1e-5)
    assert float(chunked_ce) == pytest.approx(float(full_ce), abs=1e-5)
    g_full = torch.autograd.grad(full, [hidden, head.weight])
    g_chunked = torch.autograd.grad(chunked, [hidden, head.weight])
    for a, b in zip(g_full, g_chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


class Source:
    """A tokenized source in memory: document i is `length(i)` tokens valued 1000*tag + i."""

    def __init__(self, n: int, tag: int):
        self.docs = [np.full(5 + (i * 7) % 23, 1000 * tag + i, dtype=np.int64) for i in range(n)]
        self.reads = 0

    @property
    def n_documents(self) -> int:
        return len(self.docs)

    def document(self, i: int) -> np.ndarray:
        self.reads += 1
        return self.docs[i]


def row_packer(rows: int, owned: range | None = None, sources: dict | None = None) -> RowPacker:
    sources = sources or {"a": Source(101, 1), "b": Source(37, 2)}
    return RowPacker(sources, {"a": 0.7, "b": 0.3}, 32, seed=9, rows=rows, owned=owned)


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_packs_only_its_rows_and_together_they_are_the_batch(world: int):
    single = row_packer(8)
    ranks = [row_packer(8, range(r * 8 // world, (r + 1) * 8 // world)) for r in range(world)]
    for _ in range(12):
        whole = single.next_batch()
        parts = [p.next_batch() for p in ranks]
        assert torch.equal(torch.cat([p.input_ids for p in parts]), whole.input_ids)
        assert torch.equal(torch.cat([p.position_ids for p in parts]), whole.position_ids)
    # the ranks' states together are the single process's: a checkpoint resumes at any world size
    assert merge_states([p.state_dict() for p in ranks]) == single.state_dict()
    resumed = row_packer(8)
    resumed.load_state_dict(merge_states([p.state_dict() for p in ranks]))
    assert torch.equal(resumed.next_batch().input_ids, single.next_batch().input_ids)


def test_rows_draw_disjoint_documents_within_an_epoch():
    source = Source(64, 1)
    packer = RowPacker({"a": source}, {"a": 1.0}, 16, seed=0, rows=4)
    seen = []
    for stream in packer.streams.values():
        seen += [int(stream.sources[0].document(i)[0]) % 1000 for i in range(stream.sources[0].n_documents)]
    assert sorted(seen) == list(range(64))  # every document in exactly one row's shard


def test_packing_cost_and_state_do_not_grow_with_the_step():
    """SmolLM3 lost throughput to a dataloader whose index grew with the steps: here the work per batch (documents
    read) and the size of the state at step 100,000 of a resumed packer are those at step 10."""
    sources = {"a": Source(101, 1), "b": Source(37, 2)}
    packer = row_packer(1, sources=sources)
    early = []
    for step in range(100_000):
        before = sources["a"].reads + sources["b"].reads
        packer.next_batch()
        if 10 <= step < 110:
            early.append(sources["a"].reads + sources["b"].reads - before)
    state = packer.state_dict()
    resumed = row_packer(1, sources=sources)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as read back from a checkpoint
    late = []
    for _ in range(100):
        before = sources["a"].reads + sources["b"].reads
        batch = resumed.next_batch()
        late.append(sources["a"].reads + sources["b"].reads - before)
        assert torch.equal(batch.input_ids, packer.next_batch().input_ids)
    assert abs(np.mean(late) - np.mean(early)) < 0.5 and max(late) <= max(early) + 2
    small = row_packer(1)
    for _ in range(10):
        small.next_batch()
    assert abs(len(json.dumps(state)) - len(json.dumps(small.state_dict()))) < 200


def test_prefetched_batches_and_states_are_those_packed_in_place():
    in_place, ahead = row_packer(4), Prefetcher(row_packer(4), depth=3)
    try:
        for _ in range(10):
            batch, state, wait = ahead.next()
            assert torch.equal(batch.input_ids, in_place.next_batch().input_ids) and wait >= 0
            assert state == in_place.state_dict()
    finally:
        ahead.close()


def test_a_stream_resumes_exactly():
    sources = {"a": Source(30, 1), "b": Source(20, 2)}
    first = Packer(sources, {"a": 0.7, "b": 0.3}, 16, seed=5, stream=3)
    for _ in range(25):
        first.next_sequence()
    state = first.state_dict()
    expected = [first.next_sequence()[0] for _ in range(10)]
    again = Packer(sources, {"a": 0.7, "b": 0.3}, 16, seed=5, stream=3)
    again.load_state_dict(state)
    assert all(np.array_equal(x, again.next_sequence()[0]) for x in expected)


@pytest.mark.slow
def test_one_host_sync_per_optimizer_step_and_the_step_time_breakdown(stage1_job, tmp_path: Path):
    """With 4 micro-batches per step the loop reads the device once per optimizer step; metrics.jsonl splits
    each step's time and the attention backend, loss kernel and compile state are reported."""
    from compass.model.training import trainer as trainer_module
    from compass.model.training.callbacks import Callback

    job = stage1_job(tmp_path, deepspeed=False, micro_batch_size=1)  # global batch 4: 4 micro-batches
    reads: list[str] = []
    counting = [False]
    original = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__")}

    def counted(name):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if counting[0] and caller.startswith("compass.model") and not on_the_host():
                reads.append(f"{caller}.{name}")
            return original[name](self, *args, **kwargs)
        return read

    class Window(Callback):  # count between the first batch and the last step
        def pre_step(self, trainer):
            counting[0] = True

        def post_step(self, trainer, record):
            counting[0] = False

    def on_the_host() -> bool:
        """Reading the batch's own position ids while packing.inputs() moves it: host memory, no device sync."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_globals.get("__name__") == "compass.model.training.packing" and frame.f_code.co_name == "inputs":
                return True
            frame = frame.f_back
        return False

    for name in original:
        setattr(torch.Tensor, name, counted(name))
    try:
        recipe = job.recipe
        stage = recipe.stages[0].model_copy(update={"tokens": 3 * 4 * 64})
        job = job.model_copy(update={"recipe": recipe.model_copy(update={"stages": [stage, *recipe.stages[1:]]})})
        result = trainer_module.train_stage(job, callbacks=[Window()])
    finally:
        for name, fn in original.items():
            setattr(torch.Tensor, name, fn)
    assert result.steps == 3
    per_step = [r for r in reads if not r.startswith("compass.model.training.export_check.")]  # once per export
    assert per_step == ["compass.model.training.trainer.tolist"] * 3, reads
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert {"data_wait_s", "forward_backward_s", "optimizer_s", "checkpoint_s", "rss_mb"} <= set(row)
        assert row["forward_backward_s"] > 0 and row["data_wait_s"] >= 0
    assert result.setup.attention == DOCUMENT_SDPA and result.setup.loss == "chunked"
    assert result.setup.compile is False and result.setup.async_checkpoints is True


SLOW_WRITER = """
import sys, time
from compass.model.training import checkpoints as checkpoint
original = checkpoint.finalize
def slow_finalize(tmp, final, sums=None):
    open(tmp.parent.parent / "writing.flag", "w").write(tmp.name)
    time.sleep(3)  # a long write: the test kills the process here
    return original(tmp, final, sums)
checkpoint.finalize = slow_finalize
from compass.model.training.trainer import main
sys.exit(main([sys.argv[1]]))
"""


@pytest.mark.slow
def test_kill_9_during_a_background_checkpoint_write_never_leaves_one_taken_as_valid(stage1_job, tmp_path: Path):
    from safetensors.torch import load_file

    from compass.infra.net import free_port
    from compass.model.training import checkpoints as ckpt

    def run(workdir: Path, code: str | None = None) -> subprocess.Popen:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        argv = ["-c", code, str(workdir / "job.json")] if code else ["-m", "compass.model.training.trainer",
                                                                   str(workdir / "job.json")]
        return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for folder in (straight, killed):
        folder.mkdir()
        stage1_job(folder, deepspeed=False).write(folder / "job.json")
    assert run(straight).wait(timeout=600) == 0
    proc = run(killed, SLOW_WRITER)
    flag = killed / "writing.flag"
    deadline = time.monotonic() + 600
    while not (flag.exists() and flag.read_text() == "step-00000020.tmp"):  # the second checkpoint mid-write
        assert proc.poll() is None and time.monotonic() < deadline, "trainer ended before the kill"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoints" / "step-00000020.tmp" / "state.pt").exists()  # written, not committed
    assert ckpt.newest_valid(killed / "checkpoints").name == "step-00000010"
    assert run(killed).wait(timeout=600) == 0
    assert json.loads((killed / "result.json").read_text())["resumed_from"] == 10

    def final(folder: Path) -> dict:
        return load_file(str(sorted((folder / "checkpoints").glob("step-*[0-9]"))[-1] / "hf" / "model.safetensors"))

    a, b = final(straight), final(killed)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def short(job, steps: int = 4, **changes):
    """The job trimmed to a few steps, with `how` changes (compile, attention, parallelism, ...)."""
    recipe = job.recipe
    stage = recipe.stages[0].model_copy(update={"tokens": steps * 4 * 64})
    parallelism = job.parallelism.model_copy(update=changes.pop("parallelism", {}))
    job = job.model_copy(update={"recipe": recipe.model_copy(update={"stages": [stage, *recipe.stages[1:]]})})
    return job.with_how(parallelism=parallelism, **changes)


def losses(workdir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


class LayerCalls(Callback):
    """Counts the runs of the first decoder layer's MLP during the steps (the held-out pass after them not). The
    count wraps the module's forward: transformers checkpoints a layer's `forward`, and torch's recomputation
    does not run module hooks again."""

    def __init__(self):
        self.calls = self.during_steps = 0

    def on_start(self, trainer) -> None:
        mlp = trainer.lm.hf.model.layers[0].mlp
        forward = mlp.forward

        def counted(*args, **kwargs):
            self.calls += torch.is_grad_enabled()  # training forwards (not the export check's no-grad one)
            return forward(*args, **kwargs)

        mlp.forward = counted

    def on_end(self, trainer) -> None:
        self.during_steps = self.calls


@pytest.mark.slow
def test_compile_and_activation_checkpointing_train_the_same_model(stage1_job, tmp_path: Path):
    from compass.model.training.trainer import train_stage

    runs = {"eager": {}, "checkpointed": {"parallelism": {"activation_checkpointing": True}},
            "compiled": {"compile": True}, "eager-attention": {"attention": "eager"},
            "compiled-varlen": {"compile": True, "attention": "varlen"}}
    counters = {"eager": LayerCalls(), "checkpointed": LayerCalls()}
    results = {}
    for name, changes in runs.items():
        callbacks = [counters[name]] if name in counters else []
        results[name] = train_stage(short(stage1_job(tmp_path / name, deepspeed=False), **changes), callbacks)
        assert results[name].steps == 4
    # compile is seen in dynamo's counters (equal losses alone would pass without it): the model's forward compiled
    compiled = results["compiled"].compiled
    assert compiled is not None and compiled.graphs >= 1 and results["eager"].compiled is None
    reference = losses(tmp_path / "eager")
    # what checkpointing changes: every decoder layer's insides run again in the backward pass (its activations were not
    # kept); the losses stay the same, recomputation is exact on CPU
    assert counters["checkpointed"].during_steps == 2 * counters["eager"].during_steps > 0
    assert losses(tmp_path / "checkpointed") == reference
    assert losses(tmp_path / "compiled") == pytest.approx(reference, rel=1e-4)
    assert losses(tmp_path / "eager-attention") == pytest.approx(reference, rel=1e-4)
    # torch's varlen attention (issue 43) trains the same model with its attention inside the compiled graphs: no
    # graph break, where compass's per-document SDPA breaks around every layer's attention
    assert results["compiled"].compiled.graph_breaks > 0
    varlen = results["compiled-varlen"].compiled
    assert varlen is not None and varlen.graph_breaks == 0, varlen.break_reasons
    assert losses(tmp_path / "compiled-varlen") == pytest.approx(reference, rel=1e-4)


@pytest.mark.slow
def test_hugging_face_exports_go_into_every_kth_checkpoint_and_the_last(stage1_job, tmp_path: Path):
    """how.checkpoints.hf_export_every: the training state is saved at every checkpoint, the gathered Hugging Face
    export only in every k-th and the stage's last (what evaluations and checkpoint events read)."""
    from compass.infra.layout import CheckpointFolder
    from compass.model.training.trainer import train_stage
    from compass.specs.how import Checkpoints

    every = Checkpoints(every_steps=2, keep_last=10, hf_export_every=2)
    train_stage(short(stage1_job(tmp_path, deepspeed=False), steps=7, checkpoints=every))
    folders = {CheckpointFolder(p).step: CheckpointFolder(p) for p in (tmp_path / "checkpoints").glob("step-*")}
    assert sorted(folders) == [2, 4, 6, 7]
    assert {step for step, f in folders.items() if f.exported} == {4, 7}
    assert all((f.root / "state.pt").exists() for f in folders.values())


@pytest.mark.slow
def test_a_resumed_stage_keeps_its_monitors_windows_and_rollback_count(stage1_job, tmp_path: Path):
    """The monitors' loss windows, throughput baseline and rollback count live in every checkpoint: a requeued job
    judges spikes and slow rises against the same history, and cannot roll back more than max_rollbacks times
    by being restarted in between."""
    from compass.model.training.callbacks import Monitoring
    from compass.model.training.trainer import Trainer

    job = short(stage1_job(tmp_path, deepspeed=False), steps=6)
    first = Trainer(job)
    first.fit()
    monitoring = next(c for c in first.callbacks if isinstance(c, Monitoring))
    assert len(monitoring.monitor.losses) == 6
    again = Trainer(job)  # the same work folder: resumes from the stage's last checkpoint, no step left to train
    restored = next(c for c in again.callbacks if isinstance(c, Monitoring))
    restored.rollbacks = 0
    monitoring.rollbacks = 2  # as if rolled back twice before the requeue (written at the next checkpoint)
    first.save_checkpoint()
    first.writer.wait()
    again.fit()
    assert restored.rollbacks == 2
    assert list(restored.monitor.losses) == list(monitoring.monitor.losses)
    assert list(restored.monitor.speeds) == list(monitoring.monitor.speeds)
