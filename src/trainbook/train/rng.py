"""Random number generator states as tensors, so a checkpoint holds them without pickling.

Every RNG a run could draw from is saved per rank: Python's `random`, NumPy's global generator,
torch's CPU generator and each accelerator device's. trainbook's own data order and init do not
draw from them (they are pure functions of the seed), but user code, dropout and any library a
recipe pulls in may; restoring them is what makes a resumed run continue the same sequence.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict[str, torch.Tensor]:
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    assert np_name == "MT19937", np_name
    state = {
        "python_mt": torch.tensor(mt, dtype=torch.int64),
        "python_meta": torch.tensor([version, gauss is not None], dtype=torch.int64),
        "python_gauss": torch.tensor(gauss or 0.0, dtype=torch.float64),
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_meta": torch.tensor([np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor(np_gauss, dtype=torch.float64),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    version, has_gauss = state["python_meta"].tolist()
    gauss = state["python_gauss"].item() if has_gauss else None
    random.setstate((version, tuple(state["python_mt"].tolist()), gauss))
    pos, np_has_gauss = state["numpy_meta"].tolist()
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, np_has_gauss,
                         state["numpy_gauss"].item()))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["torch_cuda"]))
