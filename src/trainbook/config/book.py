"""The recipe's own book-keeping, beside what trains: the versions it was proven with (`[env]`),
the world it is written for (`[launch]`) and the published figures it should reach (`[[expect]]`)."""

from __future__ import annotations

from typing import Annotated, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import AfterValidator, Field

from trainbook.config.section import Section

def _pep440(spec: str) -> str:
    """A PEP 440 version specifier, e.g. ">=3.11", "==2.13.0", ">=2.4,<3"."""
    try:
        SpecifierSet(spec)
    except InvalidSpecifier:
        raise ValueError(f"{spec!r} is not a PEP 440 version specifier (e.g. '>=2.4', '==2.13.0', "
                         "'==2.13.*', '>=2.4,<3')") from None
    if not spec.strip():
        raise ValueError("empty version specifier; remove the key to accept any version")
    return spec


VersionSpec = Annotated[str, AfterValidator(_pep440)]


class EnvConfig(Section):
    """The versions a recipe was proven with, as PEP 440 specifiers. `trainbook check` compares
    each with this machine and prints the install line that fixes a mismatch; `trainbook run`
    refuses a mismatch before it starts (exit 2). Unset keys accept any version."""

    python: VersionSpec | None = None
    """Python interpreter, e.g. ">=3.11"."""
    torch: VersionSpec | None = None
    """PyTorch (a local label such as `+cpu` is ignored unless the specifier names one)."""
    cuda: VersionSpec | None = None
    """The CUDA version torch was built with; checked where CUDA devices are present."""
    nccl: VersionSpec | None = None
    """The NCCL version torch uses; checked where CUDA devices are present."""
    cann: VersionSpec | None = None
    """Ascend CANN toolkit (`$ASCEND_TOOLKIT_HOME`); checked where it is installed."""
    driver: VersionSpec | None = None
    """NVIDIA driver (nvidia-smi); checked where CUDA devices are present."""
    packages: dict[str, VersionSpec] = {}
    """Distribution name -> specifier, e.g. { tokenizers = ">=0.19" }."""
    enforce: bool = True
    """`trainbook run` checks the version lock and free disk first and refuses a failure; false
    (or `run --no-check`) skips that check."""


class LaunchConfig(Section):
    """The world the recipe is written for. `trainbook run` starts `nproc_per_node` processes on
    this machine when `--nproc` is not given, and `trainbook plan` lays the recipe out on
    `nnodes x nproc_per_node` ranks when `--world-size` is not given."""

    nnodes: int = Field(default=1, ge=1)
    """Machines (nodes) the recipe is written for; more than one needs `run --rdzv-endpoint` on each."""
    nproc_per_node: int = Field(default=1, ge=1)
    """Processes (one per GPU or NPU; CPU runs may use several) on each node."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class ExpectedFigure(Section):
    """A figure the recipe is expected to reach, as published by someone who ran it, with its source."""

    metric: Literal["tokens_per_s_per_device", "mfu", "mem_peak_gib", "val_loss", "loss"]
    """What the figure measures: training tokens/s on each device, model FLOPs utilisation (0-1),
    peak device memory in GiB, or a loss."""
    value: float
    """The published number."""
    hardware: str
    """What it was measured on, e.g. "8x H100 SXM 80GB"."""
    source: str = Field(min_length=1)
    """Where the number is published: repository and file (with its version) or URL, and the row."""
    setting: str = ""
    """How the published run differs from the recipe, if at all (batch, sequence length, versions)."""
