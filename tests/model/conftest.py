import pytest

from pdserve import envs
from pdserve.model import native


@pytest.fixture(params=list(native.ISA_FLAGS))
def lib(request, monkeypatch):
    """The native kernels, once per instruction-set variant (skipped where this machine
    cannot build or run it); engines a test builds load the same variant."""
    kernels = native.load(request.param)
    if kernels is None:
        pytest.skip(f"the {request.param} native kernels cannot run on this machine")
    monkeypatch.setenv(envs.CPU_ISA, request.param)
    return kernels
