"""Two ranks of compass's DeepSpeed engine at every ZeRO stage, on fixed batches with accumulation 2:
`torchrun --nproc_per_node 2 -m tests.deepspeed_ranks OUT`. Per stage it records what the engine says the
gradient norm is before each step and what DeepSpeed used after it, then trains the same batches again with a
rollback in the middle (a batch's micro-batches forwarded, then discarded and the newest checkpoint loaded, as
the trainer's monitors do), and once more from that checkpoint in a new engine (a requeued job), and writes the
three runs' final weights. tests/test_gpu_path_deepspeed.py reads OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from compass.model.architecture import build_model, hf_config, parameter_groups
from compass.model.lm import CausalLMWithLoss
from compass.model.training import collectives
from compass.model.training.engines import DeepSpeedEngine
from compass.model.training.packing import make_batch
from compass.specs.architecture import Architecture
from compass.specs.training import Optimizer

ARCH = Architecture(num_layers=2, hidden_size=32, ffn_size=64, num_heads=4, num_kv_heads=2)
VOCAB, SEQ, ACCUMULATION, SEED, LR = 128, 24, 2, 11, 1e-2
STAGES = (0, 1, 2, 3)


def model() -> CausalLMWithLoss:
    hf = build_model(hf_config(ARCH, VOCAB, {"bos": 0, "eos": 0, "pad": 1}, 64), SEED)
    return CausalLMWithLoss(hf, loss="recomputed")  # the loss the trainer picks at ZeRO-3, at every stage alike


def micro_batch(step: int, rank: int, micro: int, bad: bool = False):
    """Two documents per row; a bad batch is all one token (a different gradient, the run must not keep it)."""
    rng = np.random.default_rng([step, rank, micro, int(bad)])
    tokens = np.full((1, SEQ), 5) if bad else rng.integers(2, VOCAB, (1, SEQ))
    segments = np.repeat([[0, 1]], SEQ // 2, axis=1)
    return make_batch(tokens, segments.astype(np.int64))


def engine(stage: int) -> DeepSpeedEngine:
    lm = model()
    return DeepSpeedEngine(lm, parameter_groups(lm.hf, 0.1, False), Optimizer(lr=LR, grad_clip=1.0), ACCUMULATION,
                           micro_batch=1, zero_stage=stage, precision="fp32", backend="gloo")


def forward_backward(eng: DeepSpeedEngine, step: int, bad: bool = False) -> None:
    rank = collectives.rank_env()[0]
    for m in range(ACCUMULATION):
        loss, _ = eng(**micro_batch(step, rank, m, bad).inputs(torch.device("cpu")))
        eng.backward(loss)
        if m < ACCUMULATION - 1:
            eng.micro_step()


def optimizer_step(eng: DeepSpeedEngine, step: int) -> tuple[float, float]:
    forward_backward(eng, step)
    before = eng.grad_norm()
    eng.step(LR, before)
    return float(before), float(eng.engine.get_global_grad_norm() or float("nan"))


def weights(eng: DeepSpeedEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in eng.export_state_dict().items()}


def run_stage(stage: int, out: Path, scratch: Path) -> dict:
    straight = engine(stage)
    norms = [optimizer_step(straight, s) for s in range(3)]
    expected = weights(straight)

    rolled = engine(stage)
    optimizer_step(rolled, 0)
    folder = scratch / f"zero{stage}"
    for write in rolled.snapshot(folder, {"step": 1}):
        write(folder)
    collectives.barrier()
    forward_backward(rolled, 1, bad=True)  # the bad batch: micro-batches forwarded, then the monitor rolls back
    rolled.grad_norm()
    rolled.discard()
    rolled.load(folder)
    for s in (1, 2):
        optimizer_step(rolled, s)
    after = weights(rolled)

    resumed = engine(stage)  # a new process's engine (a requeued job) loads the checkpoint of step 1
    resumed.load(folder)
    for s in (1, 2):
        optimizer_step(resumed, s)
    if collectives.rank_env()[0] == 0:
        torch.save({"straight": expected, "rolled_back": after, "resumed": weights(resumed)},
                   out / f"zero{stage}-weights.pt")
    else:
        weights(resumed)  # the gather at ZeRO-3 takes every rank
    return {"norm_before_step": [n[0] for n in norms], "deepspeed_norm": [n[1] for n in norms]}


def main() -> None:
    out = Path(sys.argv[1])
    collectives.init("gloo")
    rank = collectives.rank_env()[0]
    report: dict = {str(stage): run_stage(stage, out, out / "checkpoints") for stage in STAGES}
    report["backend"] = {  # what DeepSpeed's communication backend chose: torch.distributed's gloo, no JIT-built op
        "shm_comm_op": repr(sys.modules["deepspeed.comm.comm"].cdb.shm_comm_op),
        "ops_probed": "__compatible_ops__" in vars(sys.modules["deepspeed.ops"])}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    collectives.leave()


if __name__ == "__main__":
    main()
    collectives.exit_process(0)
