"""Reading DCP's `.metadata` without running code.

DCP writes `.metadata` with `pickle.dump` and reads it back with `pickle.load`, which calls any
callable the file names: opening a checkpoint someone sent you would run their code. Here the
file is read by an unpickler that admits only the classes DCP's metadata is made of (what
pickling the metadata of single-process, async, FSDP, tensor- and pipeline-parallel trainbook
checkpoints names), and DCP's own load path reads it through `SafeReader`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from trainbook.errors import TrainbookError

# (module, name) -> allowed. Each is a plain data class, a value lookup or a path: none runs code.
_ALLOWED = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by its name, nothing else
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
})


class _MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only the names in `_ALLOWED` and torch dtypes."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype pickles as the name of a torch global
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"names {module}.{name}, which DCP metadata never holds")


def read_metadata(file: Path) -> Metadata:
    """The DCP metadata in `file`; a TrainbookError naming it if it holds anything else."""
    try:
        data = Path(file).read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except OSError as e:
        raise TrainbookError(f"cannot be read: {e.strerror}", where=str(file)) from None
    except Exception as e:  # a hostile or broken pickle raises anything; nothing of it has run
        raise TrainbookError(f"is not DCP checkpoint metadata, refusing to load it ({e})", where=str(file)) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise TrainbookError("is not DCP checkpoint metadata", where=str(file))
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's filesystem reader with `.metadata` read by `read_metadata` (for `dcp.load`)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
