"""Model building, packing with intra-document masks, schedules and checkpoints (unit level, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from compass.model.architecture import build_model, hf_config, nope_pattern, parameter_groups
from compass.model.training import checkpoints as ckpt
from compass.model.training.packing import Packer
from compass.model.training.schedules import schedule_shape
from compass.specs import costs
from compass.specs.architecture import Architecture
from compass.specs.training import PretrainStage, Schedule

SPECIAL = {"bos": 0, "eos": 0, "pad": 1}
ARCHS = {
    "smollm3-rnope-tied": Architecture(num_layers=4, hidden_size=64, ffn_size=160, num_heads=4, num_kv_heads=2,
                                       positions={"kind": "rnope", "nope_every": 4}),
    "qwen3-qknorm-untied": Architecture(num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=1,
                                        qk_norm=True, tied_embeddings=False),
    "moe": Architecture(family="moe", num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2,
                        qk_norm=True, moe={"num_experts": 4, "experts_per_token": 2, "expert_ffn_size": 32}),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_built_model_has_the_planned_parameter_count(name: str):
    arch = ARCHS[name]
    model = build_model(hf_config(arch, 300, SPECIAL, 128), seed=0)
    assert sum(p.numel() for p in model.parameters()) == costs.count_parameters(arch, 300).total


def test_rnope_pattern_and_rope_theta_reach_the_config():
    arch = Architecture(num_layers=8, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=4,
                        positions={"kind": "rnope", "nope_every": 4, "rope_theta": 50000})
    config = hf_config(arch, 300, SPECIAL, 128)
    assert config.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0] == nope_pattern(arch)
    assert config.rope_parameters["rope_theta"] == 50000


def test_weight_decay_groups_follow_the_spec():
    model = build_model(hf_config(ARCHS["smollm3-rnope-tied"], 300, SPECIAL, 128), seed=0)
    embedding = model.get_input_embeddings().weight
    off = parameter_groups(model, 0.1, decay_embeddings=False)
    on = parameter_groups(model, 0.1, decay_embeddings=True)
    assert any(p is embedding for p in off[1]["params"]) and not any(p is embedding for p in off[0]["params"])
    assert any(p is embedding for p in on[0]["params"])
    assert all(p.ndim == 1 for p in off[1]["params"] if p is not embedding)  # norms never decay


def test_same_seed_same_weights_different_seed_different_weights():
    config = hf_config(ARCHS["smollm3-rnope-tied"], 300, SPECIAL, 128)
    a, b, c = build_model(config, 1), build_model(config, 1), build_model(config, 2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.get_input_embeddings().weight, c.get_input_embeddings().weight)


class FakeSource:
    """A tokenized source in memory (documents of distinct lengths)."""

    def __init__(self, n: int, base: int):
        self.docs = [np.arange(base, base + 3 + i % 7) for i in range(n)]
        self.tokens = np.concatenate(self.docs)

    @property
    def n_documents(self) -> int:
        return len(self.docs)

    def document(self, i: int) -> np.ndarray:
        return self.docs[i]


def test_packer_is_deterministic_and_resumes_exactly():
    sources = {"a": FakeSource(30, 1000), "b": FakeSource(20, 2000)}
    first = Packer(sources, {"a": 0.7, "b": 0.3}, 16, seed=5)
    stream = [first.next_sequence()[0] for _ in range(40)]
    again = Packer(sources, {"a": 0.7, "b": 0.3}, 16, seed=5)
    head = [again.next_sequence()[0] for _ in range(15)]
    state = json.loads(json.dumps(again.state_dict()))  # survives JSON, like a checkpoint
    resumed = Packer(sources, {"a": 0.7, "b": 0.3}, 16, seed=5)
    resumed.load_state_dict(state)
    tail = [resumed.next_sequence()[0] for _ in range(25)]
    assert all(np.array_equal(x, y) for x, y in zip(stream, head + tail, strict=True))
    other_seed = Packer(sources, {"a": 0.7, "b": 0.3}, 16, seed=6)
    assert not np.array_equal(stream[0], other_seed.next_sequence()[0])


def test_packer_follows_mixture_weights():
    sources = {"a": FakeSource(50, 1000), "b": FakeSource(50, 2000)}
    packer = Packer(sources, {"a": 0.8, "b": 0.2}, 64, seed=0)
    tokens = np.concatenate([packer.next_sequence()[0] for _ in range(300)])
    share_a = np.mean(tokens < 2000)
    assert 0.75 < share_a < 0.85


def stages(*specs):
    return [PretrainStage(name=n, tokens=t, global_batch_size=1, sequence_length=1, mixture={"a": 1.0},
                          schedule_segment=seg) for n, t, seg in specs]


def test_wsd_warms_up_holds_and_decays_in_the_decay_stage():
    sched = Schedule(kind="wsd", warmup_steps=10, decay_fraction=0.1, min_lr_ratio=0.0)
    shape = schedule_shape(sched, stages(("s1", 100, "stable"), ("s2", 50, "decay")))
    f = [shape.lr_factor(i) for i in range(150)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0 and f[99] == 1.0
    assert f[100] < 1.0 and f[149] == pytest.approx(0.0)
    assert all(x >= y for x, y in zip(f[100:], f[101:], strict=False))
    # extending the stable stage changes nothing before the old end: the point of WSD
    longer = schedule_shape(sched, stages(("s1", 200, "stable"), ("s2", 50, "decay")))
    assert [longer.lr_factor(i) for i in range(100)] == f[:100]


def test_cosine_and_multistep():
    cos = schedule_shape(Schedule(kind="cosine", min_lr_ratio=0.1), stages(("s", 100, "auto")))
    assert cos.lr_factor(0) == pytest.approx(1.0) and cos.lr_factor(100) == pytest.approx(0.1)
    ms = schedule_shape(Schedule(kind="multistep", milestones=[0.5, 0.8], gamma=0.5), stages(("s", 100, "auto")))
    assert [ms.lr_factor(i) for i in (49, 50, 79, 80)] == [1.0, 0.5, 0.5, 0.25]


def test_checkpoints_commit_verify_and_prune(tmp_path: Path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        tmp = root / f"step-{step:08d}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "state.pt").write_bytes(bytes([step]) * 100)
        ckpt.finalize(tmp, ckpt.step_dir(root, step))
    (root / "step-00000050.tmp").mkdir()  # a crash mid-save: ignored
    assert ckpt.newest_valid(root).name == "step-00000040"
    (root / "step-00000040" / "state.pt").write_bytes(b"bit rot")
    assert ckpt.newest_valid(root).name == "step-00000030"  # corrupt one set aside
    (root / "step-00000030" / "state.pt").write_bytes(bytes([31]) * 100)  # same size, other bytes
    # its one file is rank 0's share of two ranks: rank 1 checks sizes only, and follows what the ranks agree
    assert ckpt.newest_valid(root, rank=1, world=2).name == "step-00000030"
    answers = iter([True, False])  # rank 0 found step 30 bad, then every rank agrees on step 20
    assert ckpt.newest_valid(root, rank=1, world=2, agree=lambda bad: next(answers)).name == "step-00000020"
    assert (root / "step-00000030").exists()  # only rank 0 sets a corrupt checkpoint aside
    assert ckpt.newest_valid(root, rank=0, world=2).name == "step-00000020"
    ckpt.prune(root, keep_last=1, keep={10})
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000010", "step-00000020"]


def test_pruning_keeps_the_exports_every_checkpoint_evaluation_has_not_scored(tmp_path: Path):
    """keep_last deletes a pruned checkpoint's training state, never its export while evaluation is pending: the
    export moves, with its checksum file, to the work folder's evaluation-pending/ (a kill mid-move is finished)."""
    from compass.infra.layout import WEIGHTS, WorkFolder, pending_copy

    work = WorkFolder(tmp_path / "work")
    for step in (10, 20, 30):
        tmp = work.checkpoints / f"step-{step:08d}.tmp"
        (tmp / "hf").mkdir(parents=True)
        (tmp / "state.pt").write_bytes(bytes([step]) * 100)
        if step != 20:  # step 20 holds training state only (hf_export_every)
            (tmp / "hf" / WEIGHTS).write_bytes(bytes([step + 1]) * 64)
        ckpt.finalize(tmp, ckpt.step_dir(work.checkpoints, step))
    ckpt.prune(work.checkpoints, keep_last=1, keep=set(), pending=work.evaluation_pending)
    assert [c.step for c in work.complete_checkpoints()] == [30]
    assert [c.step for c in work.pending_exports()] == [10]  # step 20 had no export to keep
    kept = work.pending_exports()[0]
    assert (kept.hf / WEIGHTS).read_bytes() == bytes([11]) * 64 and not (kept.root / "state.pt").exists()
    assert kept.committed_sha256(kept.weights) == ckpt.sha256_file(str(kept.hf / WEIGHTS))  # checked as committed
    assert [c.step for c in work.everything_to_evaluate()] == [10, 30]
    assert pending_copy(work.checkpoint(10).hf) == kept.hf  # where an event's reader looks once it moved
    # a kill after the export was renamed into the move's folder, before that folder was: finished at the next prune
    tmp = work.checkpoints / f"step-{40:08d}.tmp"
    (tmp / "hf").mkdir(parents=True)
    (tmp / "hf" / WEIGHTS).write_bytes(b"w40")
    ckpt.finalize(tmp, ckpt.step_dir(work.checkpoints, 40))
    moving = work.evaluation_pending / "step-00000030.tmp"
    moving.mkdir()
    (moving / "checksums.json").write_bytes(work.checkpoint(30).checksums.read_bytes())
    work.checkpoint(30).hf.rename(moving / "hf")
    ckpt.prune(work.checkpoints, keep_last=1, keep=set(), pending=work.evaluation_pending)
    assert [c.step for c in work.pending_exports()] == [10, 30] and not moving.exists()
    assert [c.step for c in work.everything_to_evaluate()] == [10, 30, 40]
    # without pending evaluation, pruning deletes the whole checkpoint as before
    ckpt.prune(work.checkpoints, keep_last=0, keep=set())
    assert work.complete_checkpoints() == [] and len(work.pending_exports()) == 2
