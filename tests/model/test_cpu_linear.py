import pytest
import torch
from torch import nn

from pdserve.model.cpu_linear import PackedLinear, can_pack, pack_linears


def test_packed_linear_equals_f_linear_for_every_batch_shape():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True)
    packed = PackedLinear(linear)
    for rows in (1, 3, 32, 257):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("onednn", [False, True])
def test_packed_linear_with_panels_equals_f_linear(lib, onednn):
    """With the native panel kernel of each variant, alone or next to oneDNN (which then
    takes the rows past PANEL_M_MAX)."""
    torch.manual_seed(1)
    linear = nn.Linear(64, 100, bias=True)
    packed = PackedLinear(linear, lib, onednn=onednn)
    assert packed.panel_weight.panel == lib.panel_width
    for rows in (1, 9, 32, 257):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_pack_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(2, 8)
    want = model(x)
    assert can_pack(model)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
