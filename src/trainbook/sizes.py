"""Byte sizes as people write them, one parser for every command and config value.

Binary (IEC) units are powers of 1024: `KiB`, `MiB`, `GiB`, `TiB`, and the bare letters `K`,
`M`, `G`, `T` (how memory is usually quoted: "80G" of device memory is 80 GiB).
Decimal (SI) units are powers of 1000: `kB`/`KB`, `MB`, `GB`, `TB` (how disks and links are
quoted). A plain number, or one with `B`, is bytes. Case does not matter.
"""

from __future__ import annotations

import re

from trainbook.errors import TrainbookError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_UNITS = {"": 1, "b": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str, where: str) -> int:
    """'80GiB', '512MiB', '64K', '80G' (binary), '1.5TB', '80GB' (decimal), '1000' -> bytes.

    A user error naming `where` (the flag or key) for anything else, zero or negative included.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise TrainbookError(f"{text!r} is not a byte size (e.g. 80GiB, 512MiB, 64K, 1.5TB)", where=where)
    return int(float(match.group(1)) * _UNITS[unit])


def human(n: float) -> str:
    """Bytes in binary units with three significant digits at most: 4 B, 768 KiB, 1.69 MiB, 29.9 GiB."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            text = f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f}"
            return (text.rstrip("0").rstrip(".") if "." in text else text) + f" {unit}"
    return f"{int(n)} B"
