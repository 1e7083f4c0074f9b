"""The names the control plane reads (backends, modes, layouts, bandwidth) load without
torch (tests/test_imports.py holds the whole package free of import cycles)."""

from __future__ import annotations

import subprocess
import sys


def test_control_plane_names_import_without_torch() -> None:
    code = (
        "import sys; from pdserve.transfer import BACKENDS, TRANSFER_MODES; "
        "from pdserve.transfer.layout import KVLayout; from pdserve.transfer.limits import "
        "parse_bandwidth; print('torch' in sys.modules)"
    )
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"
