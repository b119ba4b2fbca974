"""On a CUDA machine (`make test-gpu`): the kernels compass picks on a GPU give what its CPU path gives. Flash
attention's varlen kernels on a packed micro-batch of 3 against compass's per-document SDPA (outputs and grads),
Liger's fused loss against the chunked loss (loss and grads), a bf16 step against fp32, torch.compile against
eager. Each is a few seconds on one H100; a missing kernel package fails with the command that installs it."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

GPU_EXTRAS = "pip install 'compass-lifecycle[gpu]'"


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("make test-gpu needs a CUDA device: run it on a GPU node")
    return torch.device("cuda", 0)


def needs(package: str, install: str = GPU_EXTRAS) -> None:
    if importlib.util.find_spec(package) is None:
        raise RuntimeError(f"{package} is not installed: {install}")


def tiny_model(implementation: str, device: torch.device, dtype: torch.dtype = torch.float32):
    from compass.model.architecture import build_model, hf_config
    from compass.specs.architecture import Architecture

    arch = Architecture(num_layers=2, hidden_size=128, ffn_size=256, num_heads=4, num_kv_heads=2)
    model = build_model(hf_config(arch, 512, {"bos": 0, "eos": 0, "pad": 1}, 256), 7, implementation)
    return model.to(device=device, dtype=dtype)


def packed_micro_batch(rows: int = 3, length: int = 96):
    from compass.model.training.packing import make_batch

    rng = np.random.default_rng(0)
    segments = np.stack([np.repeat(np.arange(4), length // 4) if r % 2 else np.repeat([0, 1], length // 2)
                         for r in range(rows)])
    return make_batch(rng.integers(2, 512, (rows, length)), segments.astype(np.int64))


def loss_and_grads(model, batch, device, lengths: bool, loss: str = "chunked"):
    from compass.model.lm import CausalLMWithLoss

    lm = CausalLMWithLoss(model, loss=loss)
    lm.zero_grad(set_to_none=True)
    value, _ = lm(**batch.inputs(device, sequence_lengths=lengths))
    value.backward()
    return value.detach().float(), torch.cat([p.grad.float().flatten() for p in lm.parameters() if p.grad is not None])


@pytest.mark.gpu_extra
def test_flash_varlen_equals_per_document_sdpa_on_a_packed_micro_batch_of_3(cuda):
    from compass.model.attention import DOCUMENT_SDPA, flash_kernel

    if flash_kernel() is None:
        raise RuntimeError(f"neither flash-attn nor flash_attn_interface is installed: {GPU_EXTRAS}")
    batch = packed_micro_batch()
    expected = loss_and_grads(tiny_model(DOCUMENT_SDPA, cuda, torch.bfloat16), batch, cuda, lengths=False)
    flash = loss_and_grads(tiny_model(flash_kernel(), cuda, torch.bfloat16), batch, cuda, lengths=True)
    torch.testing.assert_close(flash[0], expected[0], atol=2e-2, rtol=2e-2)
    assert torch.nn.functional.cosine_similarity(flash[1], expected[1], dim=0) > 0.99


def test_flex_attention_equals_per_document_sdpa_on_a_packed_micro_batch_of_3(cuda):
    """FlexAttention (its block mask from the position ids, compiled kernels) trains like compass's SDPA: the
    candidate for `auto` where flash-attn is not installed."""
    from compass.model.attention import DOCUMENT_SDPA, implementation

    batch = packed_micro_batch()
    expected = loss_and_grads(tiny_model(DOCUMENT_SDPA, cuda, torch.bfloat16), batch, cuda, lengths=False)
    flex = loss_and_grads(tiny_model(implementation("flex", cuda=True), cuda, torch.bfloat16), batch, cuda,
                          lengths=False)
    torch.testing.assert_close(flex[0], expected[0], atol=2e-2, rtol=2e-2)
    assert torch.nn.functional.cosine_similarity(flex[1], expected[1], dim=0) > 0.99


def test_torchs_varlen_equals_per_document_sdpa_and_compiles_without_a_graph_break(cuda):
    """torch's own varlen Flash kernels (what `auto` trains with on a GPU without flash-attn) on a packed
    micro-batch of 3 with grouped queries train like compass's SDPA, and a compiled model keeps them in its graph."""
    from compass.model import varlen
    from compass.model.attention import DOCUMENT_SDPA, DOCUMENT_VARLEN, implementation

    assert implementation("varlen", cuda=True) == DOCUMENT_VARLEN
    batch = packed_micro_batch()
    expected = loss_and_grads(tiny_model(DOCUMENT_SDPA, cuda, torch.bfloat16), batch, cuda, lengths=False)
    model = tiny_model(DOCUMENT_VARLEN, cuda, torch.bfloat16)
    assert varlen.uses_torch_kernel(torch.zeros(1, device=cuda, dtype=torch.bfloat16))
    got = loss_and_grads(model, batch, cuda, lengths=True)
    torch.testing.assert_close(got[0], expected[0], atol=2e-2, rtol=2e-2)
    assert torch.nn.functional.cosine_similarity(got[1], expected[1], dim=0) > 0.99
    torch._dynamo.reset()
    report = torch._dynamo.explain(model.model)(**{k: v for k, v in batch.inputs(cuda, sequence_lengths=True).items()
                                                   if k != "labels"}, use_cache=False)
    assert report.graph_break_count == 0, report.break_reasons


@pytest.mark.gpu_extra
def test_liger_loss_equals_the_chunked_loss(cuda):
    from compass.model.attention import DOCUMENT_SDPA

    needs("liger_kernel")
    batch = packed_micro_batch()
    chunked = loss_and_grads(tiny_model(DOCUMENT_SDPA, cuda), batch, cuda, lengths=False, loss="chunked")
    liger = loss_and_grads(tiny_model(DOCUMENT_SDPA, cuda), batch, cuda, lengths=False, loss="liger")
    torch.testing.assert_close(liger[0], chunked[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(liger[1], chunked[1], atol=1e-4, rtol=1e-3)


def test_a_bf16_autocast_step_agrees_with_fp32(cuda):
    from compass.model.attention import DOCUMENT_SDPA

    batch = packed_micro_batch()
    fp32 = loss_and_grads(tiny_model(DOCUMENT_SDPA, cuda), batch, cuda, lengths=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = loss_and_grads(tiny_model(DOCUMENT_SDPA, cuda), batch, cuda, lengths=False)
    torch.testing.assert_close(bf16[0], fp32[0], atol=2e-2, rtol=2e-2)
    assert torch.nn.functional.cosine_similarity(bf16[1], fp32[1], dim=0) > 0.99


def test_compiled_model_equals_eager(cuda):
    from compass.model.attention import DOCUMENT_SDPA
    from compass.model.lm import CausalLMWithLoss

    batch = packed_micro_batch()
    eager = loss_and_grads(tiny_model(DOCUMENT_SDPA, cuda), batch, cuda, lengths=False)
    lm = CausalLMWithLoss(tiny_model(DOCUMENT_SDPA, cuda))
    lm.compile()
    value, _ = lm(**batch.inputs(cuda))
    value.backward()
    grads = torch.cat([p.grad.float().flatten() for p in lm.parameters() if p.grad is not None])
    torch.testing.assert_close(value.detach().float(), eager[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads, eager[1], atol=1e-4, rtol=1e-3)


@pytest.mark.gpu_extra
def test_nvml_reads_this_gpu(cuda):
    needs("pynvml")
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).total > 0
    assert 0 < pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) < 120


@pytest.mark.bitsandbytes
def test_qlora_takes_one_step_on_a_4_bit_base_and_merges(cuda, tmp_path):
    """QLoRA: adapters on an NF4-quantised copy (bitsandbytes), one optimizer step moves only the adapters, and
    the merge into the full-precision base loads in transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compass.specs.post_training import Lora
    from compass.tasks.common.devices import Device
    from compass.tasks.post_training.adapters import export_merged, with_adapters
    from tests.hub_cache import tiny_llama

    needs("bitsandbytes", "pip install bitsandbytes")
    folder = tiny_llama(tmp_path / "base")  # the step's start model, saved where the 4-bit copy is loaded from
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    trained = with_adapters(model, Lora(kind="qlora", r=4, alpha=8), folder, Device(device="cuda", bf16=True))
    adapters = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    ids = tokenizer("The old river runs to the sea", return_tensors="pt")["input_ids"].to(cuda)
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-2)
    trained(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    moved = {n for n, p in trained.named_parameters() if p.requires_grad and not p.detach().equal(adapters[n])}
    assert moved
    trained.save_pretrained(str(tmp_path / "trained"))  # what the Trainer's save_model leaves for a PeftModel
    export_merged(tmp_path / "trained", folder, tmp_path / "merged", tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert merged(input_ids=ids.cpu()).logits.shape[-1] == len(tokenizer)
