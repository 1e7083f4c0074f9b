import pytest
import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from pdserve.model import native, panel_codec
from pdserve.model.cpu_linear import PackedLinear, can_pack, pack_linears
from tests.model.test_panel_codec import gguf_weights


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


def test_prefill_worker_keeps_compact_panels_for_short_inputs(lib, monkeypatch):
    """A prefill worker's linear (decode=False) of GGUF-born weights keeps their compact
    panels, which a short prompt's rows take as on a collocated worker; fp32 panels (same
    bytes as oneDNN's copy) it does not keep."""
    compact = nn.Linear(64, 100, bias=False)
    compact.weight.data = gguf_weights(100, 64, QT.Q4_1)
    prefill = PackedLinear(compact, lib, decode=False)
    assert prefill.panel_weight is not None and prefill.panel_weight.codec != panel_codec.F32
    rows = []
    run = native.linear_panels
    monkeypatch.setattr(native, "linear_panels", lambda *a: rows.append(a[1].shape[0]) or run(*a))
    for m in (1, 32, native.PANEL_M_MAX + 1):
        x = torch.randn(m, 64)
        torch.testing.assert_close(prefill(x), compact(x).detach(), atol=1e-4, rtol=1e-4)
    any_rows = native.panels_take_any_rows(lib, prefill.panel_weight)
    assert rows == ([1, 32, native.PANEL_M_MAX + 1] if any_rows else [1, 32])
    fp32 = PackedLinear(nn.Linear(64, 100), lib, decode=False)
    assert fp32.panel_weight is None and fp32.packed_weight is not None


def test_pack_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(2, 8)
    want = model(x)
    assert can_pack(model)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
