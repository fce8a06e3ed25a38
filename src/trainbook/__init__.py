"""trainbook: reproducible large-model training recipes on PyTorch."""

__version__ = "0.1.0"
