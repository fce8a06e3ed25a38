"""The preflight's rules on their own: the outlier rule, the version lock, the disk row."""

import sys

import pytest
import torch

from trainbook.config import load_config
from trainbook.config.book import EnvConfig
from trainbook.diagnose.preflight import (
    checkpoint_bytes, disk_row, matmul_rows, outliers, version_row, version_rows,
)
from trainbook.errors import TrainbookError


def test_outlier_rule_uses_the_larger_of_mad_and_ten_percent():
    # Tight ranks: MAD 0, so 10% of the median (90 of 100) is the bar.
    assert outliers([100, 100, 100, 50]) == [3]
    assert outliers([100, 95, 92, 100]) == []  # all within 10%
    assert outliers([100.0] * 8) == []
    # Noisy ranks: median 100, MAD 30 > 10, so only what is more than 30 below is named (70 is not).
    assert outliers([100, 70, 130, 100, 40]) == [4]


def test_outlier_rule_with_two_ranks_names_the_slower_when_more_than_ten_percent_behind():
    # The median of two sits halfway (one MAD from each): the rule proper could never fire.
    assert outliers([100, 50]) == [1]
    assert outliers([50, 100]) == [0]
    assert outliers([100, 95]) == []
    assert outliers([100]) == []


def test_matmul_row_names_host_and_rank_of_the_outlier():
    ranks = [{"rank": r, "host": f"node{r // 2}", "gflops": g} for r, g in enumerate([200, 205, 198, 20])]
    (row,) = matmul_rows(ranks, "cuda")
    assert row.status == "fail" and "rank 3 on node1" in row.detail and "rank 0" not in row.detail
    (row,) = matmul_rows(ranks, "cpu")  # ranks sharing a host's cores: maybe only load elsewhere
    assert row.status == "warn" and "rank 3 on node1" in row.detail


@pytest.mark.parametrize("spec, found, status", [
    ("==2.13.0", "2.13.0+cpu", "pass"),     # a local label is ignored unless the specifier names one
    ("==2.12.0", "2.13.0+cpu", "fail"),
    ("==2.13.*", "2.13.1", "pass"),
    (">=2.13", "2.14.0.dev20260101", "pass"),  # a nightly is what it is
    (">=0.19,<1", "1.0.0", "fail"),
    (">=1", None, "fail"),
    (">=1", "not-a-version", "warn"),
])
def test_version_row_against_pep440_specifiers(spec, found, status):
    assert version_row("pkg", spec, found, "fix", "env.pkg").status == status


def test_version_rows_give_the_install_line_and_name_the_interpreter():
    rows = {r.check: r for r in version_rows(EnvConfig(
        python="<3", torch="==2.12.0", packages={"numpy": ">=1", "no-such-distribution-xyz": ">=1.0, <2"}))}
    assert rows["torch"].status == "fail" and rows["torch"].fix == "pip install 'torch==2.12.0'"
    assert rows["torch"].key == "env.torch"
    assert rows["numpy"].status == "pass"
    missing = rows["no-such-distribution-xyz"]
    assert missing.status == "fail" and "not installed" in missing.detail
    assert missing.fix == "pip install 'no-such-distribution-xyz>=1.0,<2'"
    assert missing.key == "env.packages.no-such-distribution-xyz"
    assert rows["python"].status == "fail" and sys.executable in rows["python"].fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rows are compared where CUDA is present")
def test_accelerator_keys_are_skipped_where_the_machine_has_none():
    rows = version_rows(EnvConfig(cuda="==12.4", nccl=">=2.20", driver=">=550"))
    assert [(r.check, r.status) for r in rows] == [("cuda", "skip"), ("nccl", "skip"), ("driver", "skip")]


def test_a_bad_specifier_is_an_error_naming_the_key(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[env]\npackages = { numpy = ">=1.26", tokenizers = "0.19+" }\n')
    with pytest.raises(TrainbookError) as e:
        load_config(recipe)
    assert str(e.value).startswith(f"{recipe}: env.packages.tokenizers: '0.19+' is not a PEP 440 version specifier")
    # and from the command line, written bare
    with pytest.raises(TrainbookError, match=r"command line: env.torch: '=>2' is not a PEP 440"):
        load_config(tmp_path / "r.toml", ["env.packages={}", "env.torch==>2"])


def test_disk_row_holds_free_space_against_the_checkpoints_kept(tmp_path):
    assert disk_row(tmp_path / "runs" / "not-yet", params=1000, keep_last=3).status == "pass"
    row = disk_row(tmp_path / "runs", params=10**15, keep_last=3)  # 13 PB a checkpoint
    assert row.status == "fail" and row.key == "checkpoint.keep_last"
    assert checkpoint_bytes(1_000_000) >= 12_000_000
