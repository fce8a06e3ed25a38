"""Device selection for `run.device`."""

from __future__ import annotations

import os

import torch

from trainbook.errors import TrainbookError


def _npu_available() -> bool:
    # torch_npu registers `torch.npu` when imported; without it there is no NPU backend.
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


def pick_device(kind: str) -> torch.device:
    """`auto`: cuda, then npu, then cpu; an explicit kind that is not available is an error."""
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("npu") if _npu_available() else torch.device("cpu")
    available = {"cpu": True, "cuda": torch.cuda.is_available, "npu": _npu_available}[kind]
    if available is not True and not available():
        raise TrainbookError(f"device {kind!r} is not available on this machine", where="run.device")
    return torch.device(kind)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process on `device`: allocator peak on accelerators, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device)
    # Linux: this process image's high-water RSS. Not getrusage's ru_maxrss, which keeps across
    # exec the peak of the image it replaced: a run started by a large parent would report it.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource  # POSIX only; imported here so the module imports elsewhere

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux and BSD: KiB


def device_memory_bytes(device: torch.device, processes: int) -> int:
    """Memory one of `processes` ranks on this machine may plan for: its accelerator's total
    memory, or on CPU an equal share of the host's physical memory."""
    if device.type in ("cuda", "npu"):
        backend = getattr(torch, device.type)
        return backend.get_device_properties(device.index or 0).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, processes)


def memory_facts(device: torch.device) -> dict[str, int]:
    """This process's memory on `device` now: the allocator's `allocated` (live tensors) and
    `reserved` (held from the device, cached) on accelerators; the resident set `rss` on CPU; and
    `peak` (as `peak_memory_bytes`)."""
    if device.type in ("cuda", "npu"):
        backend = getattr(torch, device.type)
        return {"allocated": backend.memory_allocated(device), "reserved": backend.memory_reserved(device),
                "peak": backend.max_memory_allocated(device)}
    gauge = MemoryGauge(device)
    try:
        return {"rss": gauge(), "peak": peak_memory_bytes(device)}
    finally:
        gauge.close()


class MemoryGauge:
    """Reads this process's current memory on `device`, cheaply enough to call at every phase
    change (benchmarks/phase_memory.py): the allocator's live bytes on accelerators; on CPU the
    resident set, from /proc/self/statm held open (one pread; 0 where there is no /proc)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._fd: int | None = None
        if device.type == "cpu":
            try:
                self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            except OSError:
                pass
            self._page = os.sysconf("SC_PAGE_SIZE")

    def __call__(self) -> int:
        if self.device.type in ("cuda", "npu"):
            return getattr(torch, self.device.type).memory_allocated(self.device)
        if self._fd is None:
            return 0
        # statm: size resident shared text lib data dt, in pages
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
