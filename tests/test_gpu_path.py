"""The CUDA path checked on this CPU machine: what gloo forgives and NCCL does not. Collectives go through one module
(compass.model.training.collectives; tests/test_architecture.py fails on any other caller) that moves every tensor
to the backend's device; the same code on NCCL runs in tests/gpu/ (`make test-gpu`)."""

from __future__ import annotations

import pytest
import torch

from compass.model.training import collectives


def test_the_backend_decides_where_collective_tensors_live(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert collectives.backend_device("nccl") == torch.device("cuda", 3)  # NCCL moves CUDA tensors only
    assert collectives.backend_device("gloo") == torch.device("cpu")
    assert collectives.backend_device() == torch.device("cpu")  # no process group: nothing to move


ALONE_AND_IN_A_GROUP_OF_ONE = """
import sys, torch, torch.distributed as dist
from compass.model.training import collectives as c
t = torch.tensor([1.0, 2.0])
assert not c.active() and c.world_size() == 1
assert c.all_reduce(t, "max") is t and c.all_gather(t)[0].equal(t) and c.broadcast(t) is t
assert c.all_gather_object({"a": 1}) == [{"a": 1}] and c.any_rank(True) and not c.any_rank(False)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
assert c.active() and c.world_size() == 1
assert c.broadcast(t).equal(t) and c.all_reduce(t, "max").equal(t) and c.all_gather(t)[0].equal(t)
assert c.any_rank(True) and not c.any_rank(False)
dist.destroy_process_group()
print("ok")
"""


def test_alone_each_collective_is_the_identity_and_a_group_of_one_goes_through_the_backend(tmp_path):
    """Without a process group every collective is this rank alone (in place, no copy); a group of one (what
    DeepSpeed opens for one in-process rank) runs each through its backend, as NCCL does on a single GPU
    (tests/gpu), results on the caller's device. In a fresh interpreter: the test session's own processes keep
    the group an in-process DeepSpeed run opened, which must not be torn down under it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ALONE_AND_IN_A_GROUP_OF_ONE, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


A_RANK_THAT_EXITS = """
import atexit, sys, threading
from compass.model.training import collectives as c
atexit.register(lambda: print("exit handlers ran"))
sys.stdout.write("buffered, no newline")
threading.Thread(target=lambda: __import__("time").sleep(60), daemon=False).start()  # would hold a normal exit
c.exit_process(3)
"""


def test_a_rank_exits_with_its_code_its_streams_and_exit_handlers_but_no_finalization():
    """Rank processes end through exit_process: a library's process group alive at finalization aborts a finished
    rank now and then (a gloo worker needing the GIL). Skipping finalization must keep the exit code, the buffered
    output and the exit handlers (logging's among them); a live thread does not hold the exit."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", A_RANK_THAT_EXITS], capture_output=True, text=True, timeout=30)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stdout == "buffered, no newlineexit handlers ran\n"


# --- flash attention's varlen path at a micro-batch of several rows ----------------------------------------------
# flash-attn runs on CUDA only; what decides whether documents stay apart is transformers' dispatch
# (modeling_flash_attention_utils._flash_attention_forward), which runs here as it does on a GPU. Only the two
# kernels are replaced, by their definitions in plain torch: dense causal attention per row (flash_attn_func) and
# causal attention per cu_seqlens segment of the flattened batch (flash_attn_varlen_func).
REFERENCE_FLASH = "compass_flash_reference"


def _reference_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=softmax_scale, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def _reference_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                            softmax_scale=None, causal=False):
    bounds = cu_seqlens_q.tolist()
    return torch.cat([_reference_flash(q[None, s:e], k[None, s:e], v[None, s:e], softmax_scale=softmax_scale,
                                       causal=causal)[0] for s, e in zip(bounds[:-1], bounds[1:], strict=True)])


@pytest.fixture
def reference_flash(monkeypatch: pytest.MonkeyPatch) -> str:
    import transformers.modeling_flash_attention_utils as fa
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward

    real = fa._lazy_imports

    def kernels(implementation, *args, **kwargs):
        if implementation == REFERENCE_FLASH:
            return _reference_flash, _reference_flash_varlen, None, None, None
        return real(implementation, *args, **kwargs)

    monkeypatch.setattr(fa, "_lazy_imports", kernels)
    monkeypatch.setattr(fa, "_loaded_implementation", None)
    AttentionInterface.register(REFERENCE_FLASH, flash_attention_forward)
    return REFERENCE_FLASH


def _packed_micro_batch_of_three():
    import numpy as np

    from compass.model.training.packing import PADDING, make_batch

    rng = np.random.default_rng(5)
    rows = [(13, 21, 14), (48,), (7, 30, 5, 6)]  # documents per row (the last row ends in padding)
    tokens, segments = [], []
    for lengths in rows:
        seg = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
        seg[sum(lengths) - 6:] = PADDING if len(lengths) == 4 else seg[sum(lengths) - 6:]
        tokens.append(rng.integers(2, 300, 48))
        segments.append(seg)
    return make_batch(np.stack(tokens), np.stack(segments).astype(np.int64))


def test_flash_keeps_documents_apart_at_a_micro_batch_of_three(reference_flash: str):
    """The packed micro-batch of 3 rows gives flash the same documents as compass's per-document SDPA (outputs and
    gradients), because the trainer passes their cumulative lengths; without them (what transformers infers from
    position ids alone, for one row only) the rows' documents attend to each other."""
    from compass.model.architecture import build_model, hf_config
    from compass.model.attention import DOCUMENT_SDPA, takes_sequence_lengths
    from compass.model.lm import CausalLMWithLoss
    from compass.specs.architecture import Architecture

    arch = Architecture(num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2)
    config = hf_config(arch, 300, {"bos": 0, "eos": 0, "pad": 1}, 128)
    batch = _packed_micro_batch_of_three()
    cpu = torch.device("cpu")

    def loss_and_grads(implementation: str, lengths: bool):
        lm = CausalLMWithLoss(build_model(config, 7, implementation))
        loss, _ = lm(**batch.inputs(cpu, sequence_lengths=lengths))
        loss.backward()
        return float(loss), torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None])

    assert takes_sequence_lengths(reference_flash) and takes_sequence_lengths("flash_attention_3")
    assert not takes_sequence_lengths(DOCUMENT_SDPA)
    expected_loss, expected_grads = loss_and_grads(DOCUMENT_SDPA, False)
    loss, grads = loss_and_grads(reference_flash, True)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    torch.testing.assert_close(grads, expected_grads, atol=1e-5, rtol=1e-4)
    leaked_loss, _ = loss_and_grads(reference_flash, False)
    assert abs(leaked_loss - expected_loss) > 1e-3  # the bug this guards against: documents attend across


def test_flex_trains_with_its_main_kernel_not_the_decoding_one(monkeypatch: pytest.MonkeyPatch):
    """For queries under 128 tokens inductor picks FlexAttention's decoding kernel, which has no backward (the first
    H200 run: NoValidChoicesError in training). In training mode compass's model asks for the main kernel; in
    evaluation it leaves the choice to torch."""
    from transformers.integrations import flex_attention as hf_flex

    from compass.model.architecture import build_model, hf_config
    from compass.model.lm import CausalLMWithLoss
    from compass.specs.architecture import Architecture

    seen: list[dict | None] = []
    real = hf_flex.compile_friendly_flex_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", spy)
    arch = Architecture(num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2)
    lm = CausalLMWithLoss(build_model(hf_config(arch, 512, {"bos": 0, "eos": 0, "pad": 1}, 256), 7, "flex_attention"))
    ids = torch.randint(2, 500, (2, 96))
    positions = torch.cat([torch.arange(40), torch.arange(56)]).expand(2, -1)
    with torch.no_grad():  # FlexAttention has no backward on CPU: the forward shows what the kernel is asked
        lm.train()
        lm(input_ids=ids, position_ids=positions, labels=ids)
        assert seen == [{"FORCE_USE_FLEX_ATTENTION": True}] * 2  # each layer
        lm.eval()
        lm(input_ids=ids, position_ids=positions, labels=ids)
        assert seen[2:] == [None, None]
