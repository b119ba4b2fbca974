"""Fault injection for tests/test_cluster_faults_device.py, on PYTHONPATH of the ranks only: SIGUSR2 makes the
process raise what CUDA raises when a GPU reports an uncorrectable ECC error (the text torch's c10 CUDA check
gives), at whatever the main thread is doing, as a real device fault would surface at the next CUDA call."""

import signal


def _device_failed(signum, frame):
    raise RuntimeError("CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be asynchronously "
                       "reported at some other API call, so the stacktrace below might be incorrect.")


signal.signal(signal.SIGUSR2, _device_failed)
