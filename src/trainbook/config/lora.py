"""`[lora]`: low-rank adapters on the blocks' linear layers, the rest of the model frozen.

Each targeted `nn.Linear` W (out, in) keeps its weight, frozen, and gains A (rank, in) and
B (out, rank): y = W x + (alpha / rank) * B A dropout(x). A starts kaiming-uniform (as
`nn.Linear` and PEFT initialise it), B at zero, so step 0 computes exactly the base model.
"""

from __future__ import annotations

import tomllib
from typing import Literal

from pydantic import Field, field_validator

from trainbook.config.section import Section

ALL_LINEAR = "all-linear"


class LoraConfig(Section):
    rank: int = Field(default=0, ge=0)
    """Rank r of each adapter; 0 turns LoRA off (every parameter trains, unless `train.freeze`)."""
    alpha: float = Field(default=16.0, gt=0)
    """The adapter's output is scaled by alpha / rank. 16 (torchtune's and QLoRA's choice at rank
    8-64) is a fixed number, not tied to the rank: doubling the rank halves the scale."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input only; the frozen base path never sees it."""
    targets: list[str] | Literal["all-linear"] = ALL_LINEAR
    """The linear layers to adapt, by module name: a last component (`wq`, `wk`, `wv`, `wo`, `w1`,
    `w2`, `w3`: in every block) or a longer dotted tail (`layers.0.attention.wq`); or
    `all-linear`: every `nn.Linear` inside the blocks (not the output head)."""

    @field_validator("targets", mode="before")
    @classmethod
    def _from_text(cls, v):
        """A string other than `all-linear` is a list: `wq,wv`, or `["wq", "wv"]` (an override's
        TOML list reaches here as text, since the field takes a string too)."""
        if not isinstance(v, str) or v == ALL_LINEAR:
            return v
        text = v.strip()
        if text.startswith("["):
            try:
                return tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                raise ValueError(f"cannot read {text!r} as a list of module names") from None
        return [t.strip() for t in text.split(",")]

    @field_validator("targets")
    @classmethod
    def _names(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list):
            if not v:
                raise ValueError(f"name at least one module, or '{ALL_LINEAR}'")
            blank = [t for t in v if not t.strip() or t.startswith(".") or t.endswith(".")]
            if blank:
                raise ValueError(f"{blank[0]!r} is not a module name")
        return v

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
