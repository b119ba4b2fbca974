"""Kernels checked against the cluster's torch (issue 74, M9): torch's `varlen_attn` changed its keywords from
release to release (2.9: `is_causal`, no scale, no GQA; later `scale`, then `window_size` and `enable_gqa`), and
GPU nodes may run another torch than the one compass was written against. The call is built from the installed
signature once, and what a release lacks is done around it; each release's signature computes the same attention
as compass's own per-document reference. A torch without it is named in the error. `compass preflight` runs one
packed-attention forward and backward per rank on the node's own torch (tests/test_preflight.py runs it on two
CPU ranks)."""

from __future__ import annotations

import re

import pytest
import torch

from compass.model import varlen
from compass.model.varlen import packed_causal_attention, torch_varlen

CU = torch.tensor([0, 5, 16, 30], dtype=torch.int32)


def _reference_kernel(query, key, value, cu_q, cu_k, max_q, max_k, causal: bool, scale: float | None,
                      gqa: bool) -> torch.Tensor:
    """A varlen kernel as a torch release computes it: per-document attention, its own defaults."""
    assert causal, "called without causal masking"
    if key.shape[1] != query.shape[1]:
        assert gqa, "grouped KV heads given to a release without enable_gqa"
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    return packed_causal_attention(query, key, value, cu_q, scale if scale is not None else query.shape[-1] ** -0.5)


def torch_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None, False)


def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None,
               scale=None):
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, False)


def torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0),
                             scale, enable_gqa)


@pytest.mark.parametrize("kernel", [torch_2_9, torch_2_11, torch_2_13], ids=["2.9", "2.11", "2.13"])
def test_every_releases_signature_computes_the_same_attention(kernel):
    torch.manual_seed(0)
    query, key = torch.randn(30, 4, 8), torch.randn(30, 2, 8)  # GQA 4:2
    value = torch.randn(30, 2, 8)
    expected = packed_causal_attention(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), CU, 0.3)
    got = torch_varlen(kernel).call(kernel, query, key, value, CU, 14, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_signature_is_read_once_per_kernel():
    assert torch_varlen(torch_2_9) == varlen.TorchVarlen("is_causal", scale=False, gqa=False)
    assert torch_varlen(torch_2_13) == varlen.TorchVarlen("window_size", scale=True, gqa=True)
    assert varlen._signature_of.cache_info().currsize >= 2
    assert torch_varlen() == varlen.TorchVarlen("window_size", scale=True, gqa=True)  # this machine's torch 2.13


def test_a_torch_without_varlen_is_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(varlen, "varlen_attn", None)
    with pytest.raises(ValueError, match=rf"torch 2.9 or later.*this node's torch is {re.escape(torch.__version__)}.*"
                                         r"cluster lock.*attention: flash"):
        torch_varlen()

    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        return query

    with pytest.raises(ValueError, match="cannot attend causally"):
        torch_varlen(no_causal)


def test_preflights_packed_attention_check_passes_the_real_kernel_and_catches_a_wrong_one(monkeypatch):
    from compass.model.training.preflight import judge, packed_attention

    cpu = torch.device("cpu")
    good = packed_attention(cpu)
    assert good["ok"] and good["kernel"] == "compass::packed_causal_attention" and good["max_error"] < 1e-5
    assert good["torch"] == torch.__version__

    def across_documents(query, key, value, cu_seqlens, scale):  # a kernel that ignores the documents' bounds
        return packed_causal_attention(query, key, value, cu_seqlens[[0, -1]], scale)

    monkeypatch.setattr(varlen, "packed_causal_attention", across_documents)
    wrong = packed_attention(cpu)
    assert not wrong["ok"] and wrong["max_error"] > 0.1
    monkeypatch.setattr(varlen, "packed_causal_attention", lambda *a: (_ for _ in ()).throw(RuntimeError("no")))
    broken = packed_attention(cpu)
    assert not broken["ok"] and broken["error"] == "RuntimeError: no"
    rows = [{"node": "n1", "rank": 0, "matmul_tflops": 1.0, "allreduce_busbw_gbps": 1.0, "packed_attention": good},
            {"node": "n2", "rank": 1, "matmul_tflops": 1.0, "allreduce_busbw_gbps": 1.0, "packed_attention": wrong}]
    verdict = judge(rows, tolerance=0.5)
    assert list(verdict.flagged) == ["n2"] and "packed attention (compass::packed_causal_attention" in \
        verdict.flagged["n2"][0]
