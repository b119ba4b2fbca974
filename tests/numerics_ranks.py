"""Two bf16 ranks of compass's engines, one accumulation of 2 micro-batches each, as the SmolLM3 recipe trains:
`torchrun --nproc_per_node 2 -m tests.numerics_ranks OUT`. Per engine set-up it records the dtype of every gradient
reduction the engine issued (torch.distributed's reducing calls, wrapped before any engine starts: the level both
DeepSpeed's and FSDP2's collectives end in), the gradient the engine holds after the reduction (the whole one, in the
dtype it accumulated in), and how far that gradient is from a float64 reference: the same bf16 micro-batch gradients
summed over both ranks in float64. Then it takes one step, checkpoints, and loads the checkpoint in a new engine,
recording which files each rank wrote and read. tests/test_cluster_numerics.py reads OUT."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.deepspeed_ranks import ACCUMULATION, LR, micro_batch, model

REDUCING = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_reduce_coalesced", "reduce")
# (name, engine, zero stage, reduce_precision): what the SmolLM3 example trains with (ZeRO-1), the other sharded
# engines, and the reduction compass ran before `how.reduce_precision` (ZeRO-0: DeepSpeed's bf16 DDP optimizer)
SETUPS = (("zero1", "deepspeed", 1, "fp32"), ("zero2", "deepspeed", 2, "fp32"), ("fsdp2", "fsdp2", 0, "fp32"),
          ("zero0-bf16", "deepspeed", 0, "bf16"))
SMALL = 64  # fewer elements: a loss, a norm or an overflow flag, not a gradient


class ReductionSpy:
    """Records the dtype of every large tensor torch.distributed is asked to reduce, while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.dtypes: set[str] = set()
        for name in REDUCING:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name)))

    def _wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def reducing(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                for tensor in [*args, *kwargs.values()]:
                    for t in tensor if isinstance(tensor, list | tuple) else [tensor]:
                        if isinstance(t, torch.Tensor) and t.numel() > SMALL:
                            self.dtypes.add(str(t.dtype).removeprefix("torch."))
            return call(*args, **kwargs)

        return reducing


SPY = ReductionSpy()  # before DeepSpeed or FSDP2 take a reference to torch.distributed's functions

from compass.model.architecture import parameter_groups  # noqa: E402
from compass.model.training import collectives  # noqa: E402
from compass.specs.training import Optimizer  # noqa: E402


def engine(kind: str, stage: int, reduce_precision: str):
    lm = model()
    opt = Optimizer(lr=LR, grad_clip=1.0)
    if kind == "fsdp2":
        from compass.model.training.fsdp2 import FSDP2Engine

        return FSDP2Engine(lm, lambda hf: parameter_groups(hf, 0.1, False), opt, ACCUMULATION, "bf16",
                           reduce_precision=reduce_precision)
    from compass.model.training.engines import DeepSpeedEngine

    return DeepSpeedEngine(lm, parameter_groups(lm.hf, 0.1, False), opt, ACCUMULATION, micro_batch=1,
                           zero_stage=stage, precision="bf16", backend="gloo", reduce_precision=reduce_precision)


def reference() -> dict[str, torch.Tensor]:
    """Both ranks' micro-batch gradients of a bf16 copy of the model (the loss divided by the accumulation, as the
    engines do), summed in float64 and averaged over the ranks."""
    lm = model()
    for param in lm.parameters():  # the weights only: the engines keep buffers (rotary frequencies) in fp32
        param.data = param.data.to(torch.bfloat16)
    total: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        for m in range(ACCUMULATION):
            lm.zero_grad(set_to_none=True)
            loss, _ = lm(**micro_batch(0, rank, m).inputs(torch.device("cpu")))
            (loss / ACCUMULATION).backward()
            for name, p in lm.named_parameters():
                if p.grad is not None:
                    total[name] = total.get(name, 0) + p.grad.double()
    return {name: g / 2 for name, g in total.items()}


def whole_gradients(eng: Any) -> dict[str, torch.Tensor]:
    """The reduced gradient each parameter holds, whole (DeepSpeed: its public accessor of the accumulated
    gradient; FSDP2: the sharded gradient gathered)."""
    if eng.name == "fsdp2":
        return {name: p.grad.full_tensor() for name, p in eng.module.named_parameters() if p.grad is not None}
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, p in eng.module.named_parameters():
        grad = safe_get_full_grad(p)
        if grad is not None:
            out[name] = grad
    return out


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    names = sorted(set(got) & set(want))
    diff = sum(float((got[n].double() - want[n]).pow(2).sum()) for n in names)
    norm = sum(float(want[n].pow(2).sum()) for n in names)
    return (diff / norm) ** 0.5


def run_setup(name: str, kind: str, stage: int, reduce_precision: str, out: Path) -> dict[str, Any]:
    rank = collectives.rank_env()[0]
    eng = engine(kind, stage, reduce_precision)
    SPY.dtypes = set()
    SPY.active = True
    for m in range(ACCUMULATION):
        loss, _ = eng(**micro_batch(0, rank, m).inputs(torch.device("cpu")))
        eng.backward(loss)
        if m < ACCUMULATION - 1:
            eng.micro_step()
    SPY.active = False
    grads = whole_gradients(eng)
    report = {"reduced_in": sorted(SPY.dtypes), "held_in": sorted({str(g.dtype).removeprefix("torch.")
                                                                   for g in grads.values()}),
              "engine_says": eng.gradients, "parameters": len(grads),
              "relative_error": relative_error(grads, reference())}
    norm = eng.grad_norm()
    eng.step(LR, norm)
    report["norm"] = [float(norm), float(eng.engine.get_global_grad_norm()) if kind == "deepspeed" else float(norm)]
    folder = out / "checkpoints" / name
    written = [path for write in eng.snapshot(folder, {"step": 1}) for path in write(folder)]
    collectives.barrier()
    report["wrote"] = sorted(str(p.relative_to(folder)) for p in written)
    resumed = engine(kind, stage, reduce_precision)
    resumed.load(folder)
    report["read"] = sorted(str(Path(p).relative_to(folder)) for p in getattr(resumed, "files_read", []))
    return report


def main() -> None:
    out = Path(sys.argv[1])
    collectives.init("gloo")
    rank = collectives.rank_env()[0]
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else [s[0] for s in SETUPS]
    report = {name: run_setup(name, kind, stage, rp, out) for name, kind, stage, rp in SETUPS if name in wanted}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    collectives.leave()


if __name__ == "__main__":
    main()
    collectives.exit_process(0)
