"""The one byte-size parser: binary units (IEC, and bare K/M/G/T) and decimal ones (SI)."""

import pytest

from trainbook.errors import TrainbookError
from trainbook.sizes import GiB, human, parse_size


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * GiB), ("80G", 80 * GiB), ("512MiB", 512 << 20), ("1.5TB", 1_500_000_000_000),
    ("80GB", 80_000_000_000), ("1000", 1000), (" 64 kib ", 64 << 10), ("2TiB", 2 << 40),
    ("64K", 64 << 10), ("16M", 16 << 20), ("1.5k", 1536), ("512B", 512), ("1MB", 1_000_000), ("1kB", 1000),
])
def test_binary_and_decimal_units(text, expected):
    assert parse_size(text, where="--max-bytes") == expected


@pytest.mark.parametrize("text", ["eighty", "", "GiB", "-5GiB", "0", "80XB", "1.2.3G", "lots"])
def test_bad_sizes_name_where_they_came_from(text):
    with pytest.raises(TrainbookError) as e:
        parse_size(text, where="--max-bytes")
    assert e.value.where == "--max-bytes" and "\n" not in str(e.value)


def test_human_readable_sizes():
    assert [human(n) for n in (4, 768 << 10, 1_770_000, 29.9 * GiB)] == ["4 B", "768 KiB", "1.69 MiB", "29.9 GiB"]
