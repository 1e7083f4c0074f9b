"""The control plane imports no torch (docs/ARCHITECTURE.md, "Invariants"): router, bench and
the simulator reuse it in processes that never load a model."""

import subprocess
import sys

import pytest

TORCH_FREE = [
    "pdserve.kvcache.manager",
    "pdserve.engine.scheduler",
    "pdserve.output_processor",
    "pdserve.sampling_params",
    "pdserve.config",
    "pdserve.costmodel.step_cost",
    "pdserve.costmodel.profile",
    "pdserve.costmodel.analytic",
    "pdserve.perf.cli",
    "pdserve.sim.simulator",
    "pdserve.sim.plan",
    "pdserve.sim.cli",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"
