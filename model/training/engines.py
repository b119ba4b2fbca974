"""Training engines with one interface: plain torch (optionally DDP) and DeepSpeed (ZeRO 0-3).

`how` picks one; both take a torch AdamW (so DeepSpeed builds no fused optimizer op on CPU), set the LR from
the schedule every step, clip gradients, and snapshot their whole state for a checkpoint (copied to host memory,
written by the checkpoint writer's thread) or load it back from a checkpoint folder.

The module an engine trains is `CausalLMWithLoss` (model/lm.py): its forward returns (loss, cross-entropy).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from compass.model.training import collectives
from compass.model.training.checkpoints import HostStaging, Write
from compass.model.training.collectives import rank_env
from compass.specs.training import Optimizer


class Engine(Protocol):
    """What the training loop needs from an engine: forward, backward with accumulation, a clipped optimizer
    step at a given LR, and the whole training state snapshotted for a checkpoint or loaded from one. An export's
    weights are either gathered on rank 0 (`export_state_dict`) or written by every rank from its shards
    (`write_hf_weights` says whether the engine did)."""

    name: str
    module: torch.nn.Module  # the bare CausalLMWithLoss (no DDP or DeepSpeed wrapper)
    sharding: str  # how the training states are spread over the ranks, in words ("" for one whole copy each)
    gradients: str  # the dtypes gradients are accumulated and reduced in, as the engine set them up

    def __call__(self, **inputs: Any) -> Any: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def micro_step(self) -> None: ...
    def grad_norm(self) -> torch.Tensor: ...
    def step(self, lr: float, norm: torch.Tensor) -> None: ...
    def discard(self) -> None: ...
    def snapshot(self, folder: Path, extra: dict[str, Any]) -> list[Write]: ...
    def load(self, folder: Path, load_optimizer: bool = True) -> dict[str, Any]: ...
    def export_state_dict(self) -> dict[str, torch.Tensor]: ...
    def write_hf_weights(self, folder: Path) -> bool: ...


def tensors_digest(tensors: Any) -> int:
    """A short digest of the tensors' dtypes and bytes (the start-of-run check compares it across ranks). Any dtype:
    the bytes are read through a uint8 view, since numpy has no bfloat16 (DeepSpeed's bf16 engine holds bf16
    weights: `.numpy()` of them raised before any bf16 run's first step)."""

    h = hashlib.sha256()
    for t in tensors:
        flat = t.detach().cpu().contiguous().reshape(-1)
        h.update(str(flat.dtype).encode())
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return int(h.hexdigest()[:12], 16)


def clipped_step(optimizer: torch.optim.Optimizer, module: torch.nn.Module, lr: float, clip: float,
                 norm: torch.Tensor) -> None:
    """One AdamW step at `lr`, gradients clipped to `clip` by the global `norm` already computed, then cleared.
    Clipped group by group: a group's gradients go through one foreach kernel, which takes DTensors of one mesh."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_([p for p in group["params"] if p.grad is not None], clip, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def adamw(groups: list[dict], opt: Optimizer, device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW at the spec's settings: its fused kernel on a GPU (the whole update in a few kernels, as the
    bare torch loop of benchmarks/gpu_throughput.py steps), the multi-tensor kernel on the CPU, where the suite's
    bitwise references are computed."""
    return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, fused=device.type == "cuda" or None)


def hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face model's own keys from the wrapper's state dict (`hf.` prefix dropped)."""
    return {k.removeprefix("hf."): v for k, v in state.items()}


class TorchEngine:
    name = "torch"

    def __init__(self, model: torch.nn.Module, groups: list[dict], opt: Optimizer, accumulation: int,
                 reduce_precision: str = "fp32"):
        self.module = model
        _, world, _ = rank_env()
        device = next(model.parameters()).device  # the rank's own GPU (model/training/rank_device.py), or the CPU
        self.model = (torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type ==
                                                                "cuda" else None) if world > 1 else model)
        reduced = torch.float32  # the weights are fp32 (bf16 computes under autocast): so are their gradients
        if world > 1 and reduce_precision == "bf16":  # how.reduce_precision: bf16 on the wire, DDP's own hook
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            self.model.register_comm_hook(None, bf16_compress_hook)
            reduced = torch.bfloat16
        self.optimizer = adamw(groups, opt, device)
        self.accumulation = accumulation
        self.clip = opt.grad_clip
        self.sharding = ""  # every rank holds every state
        self.gradients = gradients_in_words(torch.float32, reduced)
        self.staging = HostStaging(device.type == "cuda")

    def __call__(self, **inputs):
        return self.model(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accumulation).backward()

    def micro_step(self) -> None:
        """Nothing to do between accumulation boundaries: gradients simply accumulate."""

    def grad_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def step(self, lr: float, norm: torch.Tensor) -> None:
        clipped_step(self.optimizer, self.module, lr, self.clip, norm)

    def discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def snapshot(self, folder: Path, extra: dict[str, Any]) -> list[Write]:
        rank, _, _ = rank_env()
        if rank != 0:
            return []
        state = self.staging.copy({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                                   "extra": extra})

        def write(out: Path) -> list[Path]:
            torch.save(state, out / "state.pt")
            return [out / "state.pt"]

        return [write]

    def load(self, folder: Path, load_optimizer: bool = True) -> dict[str, Any]:
        state = torch.load(folder / "state.pt", map_location="cpu", weights_only=False)
        self.module.load_state_dict(state["model"])
        if load_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        return state["extra"]

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        return hf_state(self.module.state_dict())

    def write_hf_weights(self, folder: Path) -> bool:
        return False  # every rank holds the whole model: rank 0 writes it from export_state_dict


def import_deepspeed() -> ModuleType:
    """DeepSpeed, without the mlflow its autotuner imports when mlflow is installed (a tracker compass offers):
    1.8 s of every DeepSpeed rank's start for a feature compass does not use. mlflow stays importable after.
    One caller at a time: two steps of one process (`max_parallel_steps`) start DeepSpeed from two threads, and
    the second must wait for the first's import to finish, not take the half-initialised module it finds in
    sys.modules (a CI run's ablation died on "module 'deepspeed' has no attribute 'initialize'")."""
    with _DEEPSPEED_IMPORT:
        if "deepspeed" in sys.modules:
            import deepspeed  # complete: an import another caller began outside this function is waited for

            return deepspeed
        hide = "mlflow" not in sys.modules
        if hide:
            sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError meanwhile
        try:
            import deepspeed
        finally:
            if hide:
                sys.modules.pop("mlflow", None)
        return deepspeed


_DEEPSPEED_IMPORT = threading.Lock()


def keep_deepspeed_off_the_cpu_shm_op() -> None:
    """DeepSpeed JIT-compiles its shared-memory CPU allreduce op at every start, under a file lock in the torch
    extensions cache: a process ended while holding it (an interrupted run) leaves the lock behind and every
    later DeepSpeed start waits on it forever, and two environments sharing the cache rebuild it in turn. A
    single in-process rank needs no allreduce and several CPU ranks use gloo's, so compass marks the op
    unavailable (GPU accelerators do not use it). It replaces the function that builds the op rather than editing
    `deepspeed.ops.__compatible_ops__`, the table that function reads: DeepSpeed fills that table lazily, at its
    first read, and a CI run once found it missing from the module when DeepSpeed read it."""
    import_deepspeed()
    backend = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` as an attribute is torch
    backend.build_shm_op = _no_shm_op


def _no_shm_op() -> None:
    """What DeepSpeed's TorchBackend takes for "no shared-memory op": it then reduces through torch.distributed."""
    return None


def _capturing_checkpoint_engine(config: Any, cuda: bool) -> Any:
    """DeepSpeed's torch checkpoint engine with `save` turned into a snapshot: each state dict DeepSpeed would
    write is copied to host memory (into buffers reused at every checkpoint) and kept, for the checkpoint writer's
    thread to serialise."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    staging = HostStaging(cuda)

    class Capturing(TorchCheckpointEngine):
        def __init__(self) -> None:
            super().__init__(config)
            self.captured: list[tuple[str, Any]] = []
            self.loaded: list[str] = []

        def save(self, state_dict: Any, path: str) -> None:
            self.captured.append((path, staging.copy(state_dict)))

        def load(self, path: str, map_location: Any = None) -> Any:
            self.loaded.append(str(path))
            return super().load(path, map_location=map_location)

    return Capturing()


def _partitioned_at_any_size(model: torch.nn.Module, zero_stage: int) -> dict[str, int]:
    """ZeRO-3 keeps parameters under 100k elements whole on every rank (DeepSpeed's default, kept for real
    models); capped at 0.1% of the model, so a small model's matrices are partitioned too and its runs (the tests',
    a smoke run's) go through the gathers, and any rank left out of a forward hangs, as at 3B."""
    if zero_stage != 3:
        return {}
    total = sum(p.numel() for p in model.parameters())
    return {"stage3_param_persistence_threshold": min(100_000, total // 1000)}


def gradient_dtypes(precision: str, reduce_precision: str, zero_stage: int) -> dict[str, Any]:
    """DeepSpeed's settings for the dtype gradients are accumulated over micro-batches and reduced across ranks in.
    Left alone, bf16/fp16 training does both in the weights' 16 bits (DeepSpeed's default communication dtype is the
    model's); the recipe (SmolLM3's, nanotron's) does both in fp32. DeepSpeed 0.19 accumulates in fp32 from ZeRO-1 up
    (at ZeRO-1 in bf16 through its BF16_Optimizer); at ZeRO-0 it cannot, which validation refuses
    (specs/checks.py)."""
    if precision == "fp32":
        return {}
    if reduce_precision != "fp32":
        return {"communication_data_type": precision}
    return {"communication_data_type": "fp32", **({"data_types": {"grad_accum_dtype": "fp32"}} if zero_stage else {})}


def gradients_in_words(accumulated: torch.dtype, reduced: torch.dtype) -> str:
    """What the run's setup records: "accumulated in float32, reduced in float32"."""
    return f"accumulated in {str(accumulated).removeprefix('torch.')}, reduced in {str(reduced).removeprefix('torch.')}"


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, groups: list[dict], opt: Optimizer, accumulation: int,
                 micro_batch: int, zero_stage: int, precision: str, backend: str, tensor_parallel: int = 1,
                 reduce_precision: str = "fp32"):
        deepspeed = import_deepspeed()
        keep_deepspeed_off_the_cpu_shm_op()
        _, world, local_rank = rank_env()
        # DeepSpeed adopts the open group; a rank without a launcher (one process: `train_stage` called directly, as
        # on a first GPU node) gets a group of its own here, else DeepSpeed would look for MPI. Its argument check
        # asserts LOCAL_RANK, which compass resolved already (0 without a launcher).
        collectives.group_of_one(backend)
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": accumulation,
            "gradient_clipping": opt.grad_clip,
            "zero_optimization": {"stage": zero_stage, **_partitioned_at_any_size(model, zero_stage)},
            "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            **gradient_dtypes(precision, reduce_precision, zero_stage),
        }
        if tensor_parallel == 1:  # DeepSpeed's check counts every rank as a data-parallel one, TP peers too
            config["train_batch_size"] = micro_batch * accumulation * world
        if tensor_parallel > 1:  # AutoTP shards the layers by the model's tp_plan (transformers' base_model_tp_plan)
            config["tensor_parallel"] = {"autotp_size": tensor_parallel}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                                 dist_init_required=False)
        cuda = torch.device(self.engine.device).type == "cuda"
        self.engine.checkpoint_engine = self.capture = _capturing_checkpoint_engine(self.engine._config, cuda)
        self.module = self.engine.module
        self.zero_stage = zero_stage
        self.tensor_parallel = tensor_parallel
        self.sharding = f"ZeRO-{zero_stage} over {world // tensor_parallel} data-parallel ranks" if zero_stage else ""
        self.gradients = gradients_in_words(self._accumulated_in(), self.engine.communication_data_type)

    def _accumulated_in(self) -> torch.dtype:
        """The dtype DeepSpeed's optimizer sums micro-batch gradients in, read from the optimizer it built."""
        opt = self.engine.optimizer
        if hasattr(opt, "fp32_groups_gradients_flat"):  # BF16_Optimizer (bf16 at ZeRO-1 with fp32 accumulation)
            return opt.fp32_groups_gradients_flat[0].dtype
        if hasattr(opt, "gradient_accumulation_dtype"):  # ZeRO-1/2/3's own optimizers
            return opt.gradient_accumulation_dtype
        return next(self.module.parameters()).dtype  # ZeRO-0: in the weights' .grad

    @property
    def files_read(self) -> list[str]:
        """The checkpoint files this rank's engine has loaded (each rank reads its own optimizer share)."""
        return list(self.capture.loaded)

    def __call__(self, **inputs):
        return self.engine(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm before the step, computed as DeepSpeed's optimizer computes the norm it clips
        with (which it only exposes after the step): over each rank's partition at ZeRO-1/2/3, each tensor-parallel
        shard once and replicated weights once, summed over ranks. Every rank gets the same number."""
        from deepspeed.runtime.utils import combine_grad_norm_groups, get_global_norm_of_tensors

        opt = self.engine.optimizer
        if hasattr(opt, "scaled_global_norm"):  # ZeRO-1/2's optimizer (not BF16_Optimizer, below)
            return opt.scaled_global_norm() / opt.loss_scale
        if self.zero_stage == 3:
            return combine_grad_norm_groups(opt._get_norm_groups()) / opt.loss_scale
        if hasattr(opt, "get_grads_for_norm"):  # bf16/fp16 at ZeRO-0 (DeepSpeed's low-precision optimizer) and
            grads, _ = opt.get_grads_for_norm()  # BF16_Optimizer (bf16 at ZeRO-1: every rank holds the reduced sum)
        else:  # fp32 at ZeRO-0: DeepSpeed clips the full gradients with deepspeed.runtime.utils.clip_grad_norm_
            grads = self._full_gradients_once()
        return get_global_norm_of_tensors(grads, mpu=self.engine.mpu) if grads else torch.zeros(())

    def _full_gradients_once(self) -> list[torch.Tensor]:
        """Every gradient this rank holds that no other rank of its tensor-parallel group holds too."""
        from deepspeed.runtime.utils import is_model_parallel_parameter

        first = self.tensor_parallel == 1 or self.engine.mpu.get_tensor_model_parallel_rank() == 0
        return [p.grad for p in self.module.parameters()
                if p.grad is not None and (first or is_model_parallel_parameter(p))]

    def step(self, lr: float, norm: torch.Tensor) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.engine.step()  # an optimizer step at the accumulation boundary (DeepSpeed clips)

    def discard(self) -> None:
        """Drop the gradients of an unfinished accumulation and return DeepSpeed's micro-batch count to the last
        boundary: otherwise every later optimizer step fires that many micro-batches early. The engine's zero_grad
        only clears the module's gradients; ZeRO's optimizer keeps the reduced partitions and its own micro-batch
        count (ZeRO-3 would add the discarded gradients into the next step's)."""
        self.engine.zero_grad()
        self.engine.optimizer.zero_grad(set_to_none=True)
        self._to_boundary()

    def _to_boundary(self) -> None:
        self.engine.micro_steps = self.engine.global_steps * self.engine.gradient_accumulation_steps()

    def micro_step(self) -> None:
        """Between accumulation boundaries DeepSpeed still needs step() to count micro-batches."""
        self.engine.step()

    def snapshot(self, folder: Path, extra: dict[str, Any]) -> list[Write]:
        """DeepSpeed's own checkpoint (every rank its shards), captured in memory; files written later."""
        self.capture.captured = []
        self.engine.save_checkpoint(str(folder), tag="deepspeed", client_state={"extra": extra}, save_latest=False)
        captured, self.capture.captured = self.capture.captured, []
        zipfile = self.capture.zipfile_serialization

        def write(out: Path, path: str, state: Any) -> list[Path]:
            target = out / Path(path).relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, target, _use_new_zipfile_serialization=zipfile)
            return [target]

        return [lambda out, p=path, s=state: write(out, p, s) for path, state in captured]

    def load(self, folder: Path, load_optimizer: bool = True) -> dict[str, Any]:
        _, client = self.engine.load_checkpoint(str(folder), tag="deepspeed", load_optimizer_states=load_optimizer,
                                                load_lr_scheduler_states=False)
        self._to_boundary()  # DeepSpeed restores its step count, not its micro-batch count
        return (client or {}).get("extra", {})

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (gathered from every shard at ZeRO-3 or with tensor parallelism: every rank
        takes part; rank 0 receives them)."""
        if self.zero_stage == 3 or self.tensor_parallel > 1:
            return hf_state(self.engine._consolidated_16bit_state_dict() or {})
        return hf_state(self.module.state_dict())

    def write_hf_weights(self, folder: Path) -> bool:
        return False  # DeepSpeed gathers for rank 0 (export_state_dict)
