"""The one table of accelerator peaks: device kinds as jax reports them find their data sheet, the most
specific row first; an unknown kind finds none; a wrong name is refused naming the known ones."""

import pytest

from d2f_jax import datasheets


@pytest.mark.parametrize("kind,name", [("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
                                       ("NVIDIA A100-SXM4-40GB", "A100 40GB SXM"), ("TPU v5 lite", "TPU v5e"),
                                       ("TPU v5p", "TPU v5p"), ("TPU v6 lite", "TPU v6e"), ("NVIDIA H200", "H200")])
def test_device_kinds_find_their_data_sheet(kind, name):
  assert datasheets.for_device_kind(kind).name == name


def test_unknown_kind_and_name():
  assert datasheets.for_device_kind("cpu") is None
  assert datasheets.by_name("TPU v5p").hbm_gbps == 2765.0
  with pytest.raises(KeyError, match="H100 SXM"):
    datasheets.by_name("H300")
