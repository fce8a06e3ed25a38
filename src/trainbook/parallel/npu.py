"""Ascend NPU adapter: the one place trainbook touches `torch_npu`.

Importing `torch_npu` registers the `npu` device type, its `torch.npu` module (memory stats, RNG,
streams) and the HCCL process-group backend; after that the rest of trainbook treats `npu` like
`cuda` (device strings, `getattr(torch, device.type)`). It cannot be exercised without Ascend
hardware, which is why it stays this small.
"""

from __future__ import annotations

from trainbook.errors import TrainbookError


def register() -> None:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu and the "hccl" backend)
    except ImportError:
        raise TrainbookError("run.device = npu needs the torch_npu package", where="run.device") from None
