"""Which errors of a rank mean its GPU failed (issue 74, H6): CUDA's and the driver's words for a device fault
(uncorrectable ECC, Xid, NVLink, a GPU off the bus) make a rank end retriable, saying so in the work folder, so
its job requeues itself; errors a program causes (a device-side assert, an illegal address, out of memory) do
not, since they would fail again. The end-to-end case (a rank's ECC error mid-stage on the emulated cluster,
the job requeued by its own batch shell and resumed) is in tests/test_rehearsal_faults.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from compass.infra.exits import RETRIABLE_EXIT, device_fault, failed_device, retriable_reasons

FAULTS = ["CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be asynchronously reported",
          "CUDA error: unspecified launch failure", "NCCL error: unhandled system error (Xid 79: GPU has fallen off "
          "the bus)", "CUDA error: uncorrectable NVLink error detected during the execution",
          "CUDA error: CUDA-capable device(s) is/are busy or unavailable"]
BUGS = ["CUDA error: device-side assert triggered", "CUDA error: an illegal memory access was encountered",
        "CUDA out of memory. Tried to allocate 2.00 GiB", "mat1 and mat2 shapes cannot be multiplied"]


@pytest.mark.parametrize("text", FAULTS)
def test_a_failed_device_ends_the_rank_retriable_and_says_why(text: str, tmp_path: Path):
    assert failed_device(tmp_path, 3, RuntimeError(text)) == RETRIABLE_EXIT
    (why,) = retriable_reasons(tmp_path)
    assert why.startswith("rank 3 on ") and f"its device failed ({text.splitlines()[0]})" in why


@pytest.mark.parametrize("text", BUGS)
def test_errors_a_program_causes_are_not_device_faults(text: str, tmp_path: Path):
    assert device_fault(RuntimeError(text)) is None and failed_device(tmp_path, 0, RuntimeError(text)) is None
    assert retriable_reasons(tmp_path) == []
    assert device_fault(ValueError(FAULTS[0])) is None  # CUDA raises RuntimeError (torch.AcceleratorError is one)
