"""Post-training's CUDA path on a GPU node: a TRL step's rank trains in bf16 on the GPU and checkpoints, generation for
pairs and vibe checks runs on the GPU, and passkey scores on it without full-vocabulary logits."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("make test-gpu needs a CUDA device (run it on a GPU node)")
    return torch.device("cuda")


def test_a_trl_rank_trains_in_bf16_on_the_gpu_and_checkpoints(cuda, tmp_path: Path):
    from compass.infra.layout import WorkFolder
    from compass.specs.how import How
    from compass.specs.post_training import Sft
    from compass.tasks.post_training.chat import load_chat_model
    from compass.tasks.post_training.trl_checkpoints import newest_complete
    from compass.tasks.post_training.trl_job import TrlJob
    from compass.tasks.post_training.trl_ranks import train
    from tests.hub_cache import tiny_llama

    model, tokenizer = load_chat_model(tiny_llama(tmp_path / "start"))
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {a}?"},
                          {"role": "assistant", "content": str(2 * a)}]} for a in range(32)]
    how = How.model_validate({"hardware": {"accelerator": "h100"}, "precision": "bf16",
                              "checkpoints": {"every_steps": 2, "keep_last": 1}})
    job = TrlJob(step="post_train:sft", section=Sft(method="sft", name="sft", dataset="x", lr=1e-3, batch_size=8),
                 seed=0, how=how, work=tmp_path / "work", world=1, device="cuda", bf16=True)
    trainer, result = train(job, model, tokenizer, rows, started_at=time.time())
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert result.global_step == 4 and np.isfinite([h["loss"] for h in result.log_history if "loss" in h]).all()
    assert newest_complete(WorkFolder(job.work).trl_checkpoints).name == "checkpoint-4"
    assert result.goodput is not None and result.goodput.compute_s > 0 and result.goodput.checkpoint_s > 0


def test_generation_and_passkey_run_on_the_gpu(cuda, tmp_path: Path):
    from compass.tasks.common.devices import Device
    from compass.tasks.evaluation.retrieval import score_candidates
    from compass.tasks.post_training.chat import generate, load_chat_model
    from tests.hub_cache import tiny_llama

    model, tokenizer = load_chat_model(tiny_llama(tmp_path / "model"), Device("cuda", bf16=True))
    assert next(model.parameters()).device.type == "cuda" and next(model.parameters()).dtype == torch.bfloat16
    answers = generate(model, tokenizer, [[{"role": "user", "content": "Say hello."}]] * 3, max_new_tokens=8)
    assert len(answers) == 3
    prompt = np.random.default_rng(0).integers(3, 300, size=4096).tolist()
    torch.cuda.reset_peak_memory_stats()
    scores = score_candidates(model, prompt, [[5, 6], [7, 8], [9]], chunk=1024)
    assert len(scores) == 3 and np.isfinite(scores).all()
    full_logits = 5 * 4096 * len(tokenizer) * 4  # what five padded rows of float32 logits would take
    assert torch.cuda.max_memory_allocated() < full_logits + 64 * 2**20


@pytest.mark.vllm
def test_lighteval_through_vllm_scores_on_the_gpu(cuda, tmp_path: Path):
    """how.generation: vllm runs the evaluate step's lighteval on vLLM (an optional package on GPU nodes)."""
    import importlib.util

    from compass.specs.evaluation import Benchmark
    from compass.specs.how import How
    from compass.tasks.common.devices import Device
    from compass.tasks.evaluation.lighteval_run import run_lighteval
    from tests.hub_cache import tiny_llama

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("vllm is not installed: pip install 'compass-lifecycle[vllm]' on the GPU node")
    how = How.model_validate({"hardware": {"accelerator": "h100"}, "precision": "bf16", "generation": "vllm"})
    scores = run_lighteval(tiny_llama(tmp_path / "model"), [Benchmark(name="arc_easy", limit=16)],
                           tmp_path / "scratch", Device("cuda", bf16=True), how)
    (metrics,) = scores.results.values()
    assert 0 <= metrics["acc"] <= 1


def test_a_trl_ranks_endpoint_reads_its_gpu_through_nvml(cuda, tmp_path: Path):
    """On CUDA a TRL rank's endpoint serves the hardware layer too (NVML, for the GPU accelerate opened)."""
    import json
    import urllib.request
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from compass.model.training.job import Telemetry
    from compass.tasks.post_training.trl_goodput import TrlGoodput
    from compass.tasks.post_training.trl_prometheus import TrlPrometheus

    torch.cuda.set_device(cuda)
    folder = tmp_path / "monitoring"
    ledger = TrlGoodput(tmp_path / "goodput", started_at=time.time(), rank=0)
    served = TrlPrometheus(Telemetry(run="gpu", step="post_train:sft", folder=folder), ledger, cuda=True)
    state = SimpleNamespace(global_step=0, max_steps=1, is_world_process_zero=True)
    served.on_train_begin(None, state, None)
    try:
        (target,) = (folder / "targets").glob("*.json")
        address = json.loads(target.read_text())[0]["targets"][0]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            names = {s.name for f in text_string_to_metric_families(response.read().decode()) for s in f.samples}
    finally:
        served.on_train_end(None, state, None)
    assert {"compass_gpu_temperature_celsius", "compass_gpu_memory_used_bytes", "compass_gpu_power_watts"} <= names


def test_packed_sft_rows_run_the_document_kernels_on_the_gpu_and_keep_conversations_apart(cuda, tmp_path: Path):
    """Issue 73, H3 on CUDA: a packed SFT row in bf16 runs compass's varlen attention (flash where flash-attn is
    installed) on the cumulative lengths TRL's padding-free collator gives, with no [L, L] mask, and each
    conversation's logits equal its own forward alone."""
    from compass.model.attention import DOCUMENT_VARLEN, flash_kernel
    from compass.specs.how import How
    from compass.specs.post_training import Sft
    from compass.tasks.common.devices import Device
    from compass.tasks.post_training.chat import load_chat_model
    from compass.tasks.post_training.trl_goodput import TrlGoodput
    from compass.tasks.post_training.trl_job import TrlJob
    from compass.tasks.post_training.trl_ranks import sft_trainer
    from tests.hub_cache import tiny_llama

    model, tokenizer = load_chat_model(tiny_llama(tmp_path / "model"), Device("cuda", bf16=True))
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {a}?"},
                          {"role": "assistant", "content": f"It is {2 * a}."}]} for a in range(6)]
    how = How.model_validate({"hardware": {"accelerator": "h100"}, "precision": "bf16"})
    job = TrlJob(step="post_train:sft", seed=0, how=how, work=tmp_path / "work", world=1, device="cuda", bf16=True,
                 section=Sft(method="sft", name="sft", dataset="x", lr=1e-4, batch_size=2, packing=True,
                             max_length=128))
    trainer, _ = sft_trainer(job, model, tokenizer, rows, TrlGoodput(tmp_path / "goodput", time.time(), rank=0))
    assert model.config._attn_implementation == (flash_kernel() or DOCUMENT_VARLEN)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    batch = {k: v.to(cuda) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "labels"}
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = model(**batch).logits[0].float()
        for begin, end in zip(starts, [*starts[1:], batch["input_ids"].shape[1]], strict=True):
            ids = batch["input_ids"][:, begin:end]
            alone = model(input_ids=ids, position_ids=torch.arange(end - begin, device=cuda)[None],
                          **_lengths(end - begin, cuda)).logits[0].float()
            assert torch.allclose(alone, packed[begin:end], atol=5e-2, rtol=5e-2)


def _lengths(length: int, device: torch.device) -> dict:
    """One document's cumulative lengths, as the varlen kernels take them."""
    cu = torch.tensor([0, length], dtype=torch.int32, device=device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": length, "max_length_k": length}
