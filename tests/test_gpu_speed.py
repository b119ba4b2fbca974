"""Training speed on a GPU, proven on CPU where it can be (issue 43): packed attention from torch itself (`varlen`)
keeps each document to itself at any micro-batch, is what `auto` picks on CUDA without the flash-attn wheel, and
stays inside compiled graphs, where compass's per-document SDPA breaks every layer's graph. The CUDA kernel itself
runs in tests/gpu (`make test-gpu`)."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu_path import _packed_micro_batch_of_three


def _tiny_config():
    from compass.model.architecture import hf_config
    from compass.specs.architecture import Architecture

    arch = Architecture(num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2)  # grouped queries
    return hf_config(arch, 300, {"bos": 0, "eos": 0, "pad": 1}, 128)


def test_varlen_keeps_documents_apart_at_a_micro_batch_of_three():
    """Three packed rows (one ending in padding), grouped-query attention: varlen's loss and gradients equal
    compass's per-document SDPA, from the cumulative lengths the packer hands it; without them it refuses (flash
    in that case attended across every document of a row)."""
    from compass.model.architecture import build_model
    from compass.model.attention import DOCUMENT_SDPA, DOCUMENT_VARLEN, takes_sequence_lengths
    from compass.model.lm import CausalLMWithLoss

    config, batch, cpu = _tiny_config(), _packed_micro_batch_of_three(), torch.device("cpu")

    def loss_and_grads(implementation: str, lengths: bool):
        lm = CausalLMWithLoss(build_model(config, 7, implementation))
        loss, _ = lm(**batch.inputs(cpu, sequence_lengths=lengths))
        loss.backward()
        return float(loss.detach()), torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None])

    assert takes_sequence_lengths(DOCUMENT_VARLEN)
    expected_loss, expected_grads = loss_and_grads(DOCUMENT_SDPA, False)
    loss, grads = loss_and_grads(DOCUMENT_VARLEN, True)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    torch.testing.assert_close(grads, expected_grads, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="cumulative lengths"):
        loss_and_grads(DOCUMENT_VARLEN, False)


def test_auto_picks_torchs_varlen_on_cuda_without_the_flash_attn_wheel(monkeypatch: pytest.MonkeyPatch):
    """What a GPU node without flash-attn trains with: torch's varlen kernels, not the per-document SDPA that runs
    eagerly between compiled regions; flash-attn still first where installed; CPU keeps compass's SDPA."""
    import torch.nn.attention.varlen as torch_varlen

    from compass.model import attention, varlen
    from compass.model.attention import DOCUMENT_SDPA, DOCUMENT_VARLEN

    monkeypatch.setattr(attention, "flash_kernel", lambda: None)
    assert attention.implementation("auto", cuda=True) == DOCUMENT_VARLEN
    assert attention.implementation("varlen", cuda=False) == DOCUMENT_VARLEN
    assert attention.implementation("auto", cuda=False) == DOCUMENT_SDPA
    assert attention.implementation("auto", cuda=True, dropout=True) == DOCUMENT_SDPA  # varlen has no dropout
    monkeypatch.setattr(attention, "flash_kernel", lambda: "flash_attention_2")
    assert attention.implementation("auto", cuda=True) == "flash_attention_2"

    # on CUDA in bf16 the call goes to torch's kernel with causal windows, grouped heads and the lengths as given
    seen = {}
    monkeypatch.setattr(varlen, "uses_torch_kernel", lambda query: True)

    def kernel(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.update(shapes=(query.shape, key.shape), cu=cu_q.tolist(), same=cu_k is cu_q, longest=(max_q, max_k),
                    scale=scale, window_size=window_size, enable_gqa=enable_gqa)  # torch 2.13's keywords
        return torch.zeros_like(query)

    monkeypatch.setattr(varlen, "varlen_attn", kernel)
    assert torch_varlen.varlen_attn is not kernel
    q, kv = torch.randn(3, 4, 16, 8), torch.randn(3, 2, 16, 8)
    cu = torch.tensor([0, 5, 16, 30, 48], dtype=torch.int32)
    out, _ = varlen.document_varlen(None, q, kv, kv, None, scaling=0.5, cu_seq_lens_q=cu, max_length_q=18)
    assert out.shape == (3, 16, 4, 8)
    assert seen == {"shapes": (torch.Size([48, 4, 8]), torch.Size([48, 2, 8])), "cu": [0, 5, 16, 30, 48],
                    "same": True, "longest": (18, 18), "scale": 0.5, "window_size": (-1, 0), "enable_gqa": True}


def _layer_inputs(model, batch):
    """A decoder layer's inputs for the packed batch: embeddings, rotary position embeddings, the lengths."""
    cpu = torch.device("cpu")
    inputs = batch.inputs(cpu, sequence_lengths=True)
    with torch.no_grad():  # the layer's own graph only: it runs backward twice (eager, compiled)
        hidden = model.model.embed_tokens(inputs["input_ids"])
        rotary = model.model.rotary_emb(hidden, inputs["position_ids"])
    lengths = {k: v for k, v in inputs.items() if k.startswith(("cu_seq", "max_length"))}
    return hidden, {"position_embeddings": rotary, "position_ids": inputs["position_ids"], **lengths}


@pytest.mark.parametrize("implementation, breaks", [("compass_varlen", 0), ("compass_document_sdpa", 1)])
def test_a_compiled_decoder_layer_keeps_varlen_attention_inside_its_graph(implementation: str, breaks: int):
    """torch._dynamo's explain of one decoder layer: with varlen its attention is one operator in the graph (0
    breaks); compass's per-document SDPA splits rows by data and breaks the graph around it (the GPU run's 6.4% MFU).
    The varlen layer then runs forward and backward compiled (AOTAutograd) to eager's numbers."""
    from torch._dynamo import explain

    from compass.model.architecture import build_model

    torch._dynamo.reset()
    model = build_model(_tiny_config(), 7, implementation)
    layer = model.model.layers[0]
    hidden, kwargs = _layer_inputs(model, _packed_micro_batch_of_three())
    report = explain(layer)(hidden, **kwargs)
    assert (report.graph_break_count > 0) == (breaks > 0), report.break_reasons
    if breaks:
        return
    eager = layer(hidden, **kwargs)
    eager = eager[0] if isinstance(eager, tuple) else eager
    eager.sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)(hidden, **kwargs)
    compiled = compiled[0] if isinstance(compiled, tuple) else compiled
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()
    for got, want in zip([p.grad for p in layer.parameters()], expected, strict=True):
        torch.testing.assert_close(got, want)


def test_checkpoints_stage_into_the_same_host_buffers_every_time(tmp_path):
    """Five checkpoints of the torch engine: each snapshot copies the weights and both Adam moments into the host
    buffers the first one allocated (torch's DefaultStager), so host memory holds one copy of the state however
    many checkpoints a stage writes; each snapshot holds the state of its own step, and writes it."""
    from compass.model.architecture import build_model, parameter_groups
    from compass.model.lm import CausalLMWithLoss
    from compass.model.training.engines import TorchEngine
    from compass.specs.training import Optimizer

    lm = CausalLMWithLoss(build_model(_tiny_config(), 7))
    engine = TorchEngine(lm, parameter_groups(lm.hf, 0.1, False), Optimizer(lr=1e-3), 1)
    inputs = _packed_micro_batch_of_three().inputs(torch.device("cpu"))
    staged: list = []  # every snapshot's host state, kept alive: a fresh copy could not reuse a freed address
    stage = engine.staging.copy
    engine.staging.copy = lambda state: staged.append(stage(state)) or staged[-1]
    buffers, sizes = [], []
    for step in range(5):
        loss, _ = engine(**inputs)
        engine.backward(loss)
        engine.step(1e-3, engine.grad_norm())
        engine.discard()
        (write,) = engine.snapshot(tmp_path, {"step": step})
        state = torch.load(write(tmp_path)[0], weights_only=False)  # what the writer thread writes: this step's
        for name, weight in lm.state_dict().items():
            torch.testing.assert_close(state["model"][name], weight, rtol=0, atol=0)
        assert state["extra"] == {"step": step}
        held = [t for t in _tensors(staged[-1]) if t.numel() > 1]
        assert len(held) >= 3 * len(list(lm.parameters()))  # weights, exp_avg, exp_avg_sq
        buffers.append({t.untyped_storage().data_ptr() for t in held})
        sizes.append(sum(t.untyped_storage().nbytes() for t in held))
    assert all(b == buffers[0] for b in buffers[1:]), "a checkpoint allocated new host buffers"
    assert len(set(sizes)) == 1


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return []


@pytest.mark.slow
def test_the_gpu_session_script_runs_every_step_on_cpu_up_to_its_first_cuda_call(tmp_path):
    """benchmarks/gpu_session.sh, the one command of a short GPU visit, run here with the suite's own packages: the
    kit check, every tests/gpu file and the benchmark for each attention run and stop where CUDA is first needed
    (or at the GPU kit's prebuilt data, which travels with the tree), and the summary names each part."""
    import os
    import subprocess

    from tests.conftest import REPO

    env = {**os.environ, "SKIP_INSTALL": "1", "PY": str(REPO / ".venv" / "bin" / "python"), "OUT": str(tmp_path),
           "TEST_S": "120", "BENCH_S": "60", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    summary = out[out.rindex("\nsetup:") + 1:]  # the closing summary
    assert summary.startswith("setup:     ok; kit check: 0 unmet requirements"), summary
    failures = [line for line in summary.splitlines() if line.strip().startswith(("ERROR", "FAILED"))]
    assert failures and all("needs a CUDA device" in line or "prebuilt_data" in line for line in failures), failures
    assert any("test_torchs_varlen_equals_per_document_sdpa" in line for line in failures)  # the new kernel is there
    assert "benchmark: --attention varlen: ok" in summary and "no CUDA device: skipped" in summary
    assert {p.name for p in tmp_path.iterdir()} >= {"gpu_session.log", "gpu_tests.log", "gpu_throughput.log"}
