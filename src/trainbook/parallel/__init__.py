"""Devices, meshes and parallel layouts, applied to the model from outside."""

from trainbook.parallel.device import peak_memory_bytes, pick_device

__all__ = ["peak_memory_bytes", "pick_device"]
