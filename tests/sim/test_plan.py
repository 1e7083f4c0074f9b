import pytest

from pdserve.cli import main
from pdserve.costmodel.step_cost import FEATURES, StepCostModel
from pdserve.sim.deployment import Deployment
from pdserve.sim.simulator import Simulation


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


PLAN = [
    "plan",
    "--preset",
    "chat",
    "--rate",
    "50",
    "--slo-ttft-ms",
    "500",
    "--slo-tpot-ms",
    "50",
    "--no-progress",
]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--profile", "analytic:B300:llama-3-8b", "--num-devices", "8"], "unknown device 'B300'"),
        (
            ["--profile", "analytic:A100-40GB:llama-2-70b", "--num-devices", "2"],
            "too small for one replica",
        ),
        (
            [
                "--profile",
                "analytic:H100-SXM:llama-3-8b",
                "--model",
                "llama-2-7b",
                "--num-devices",
                "8",
            ],
            "profile is of model 'llama-3-8b', not 'llama-2-7b'",
        ),
        (["--profile", "/nonexistent.json", "--num-devices", "8"], "No such file"),
        (
            [
                "--profile",
                "analytic:H100-SXM:llama-3-8b",
                "--num-devices",
                "8",
                "--temperature",
                "0.7",
            ],
            "--temperature 0.7: profiles time greedy decoding",
        ),
    ],
)
def test_plan_refuses_bad_input_in_one_line(capsys, extra, message):
    code, out, err = _run(capsys, *PLAN, *extra)
    assert code == 2 and out == ""
    # one line, the last (a first run may print the default model's conversion before it)
    assert message in err.splitlines()[-1] and "Traceback" not in err


def test_plan_finds_a_layout_for_a_small_budget(capsys):
    small = [
        "--num-devices",
        "16",
        "--probe-requests",
        "40",
        "--max-probes",
        "3",
        "--slo-max-gap-ms",
        "2000",
    ]
    code, out, _ = _run(capsys, *PLAN, "--profile", "analytic:H100-SXM:llama-3-8b", *small)
    assert code == 0
    assert "chosen:" in out and "collocated" in out and "prefill" in out
    assert "/ max gap 2000 ms;" in out and "max gap ms" in out  # each layout's longest freeze


def test_simulate_prints_the_bench_report(capsys):
    code, out, _ = _run(
        capsys,
        "simulate",
        "--profile",
        "analytic:H100-SXM:llama-3-8b",
        "--preset",
        "chat",
        "--num-requests",
        "40",
        "--rate",
        "10",
        "--deployment",
        "1p1d",
        "--no-progress",
        "--slo-max-gap-ms",
        "1000",
    )
    assert code == 0
    assert "ttft_ms mean/p50/p90/p99" in out and "goodput (req/s)" in out
    assert "longest freeze (max gap, ms)" in out and "-, -, -, 1000\n" in out


def test_one_cost_model_serves_the_simulator_and_an_online_fit():
    """The simulator steps with the profile's StepCostModel, and the steps it runs, fitted by
    that same class the way an online planner fits workers' reported steps, give it back."""
    from pdserve.bench.arrivals import ArrivalSpec
    from pdserve.bench.workloads import Session, Turn
    from pdserve.costmodel.analytic import analytic_profile, model_shape

    profile = analytic_profile(model_shape("llama-3-8b"), "H100-SXM", sizes=(1,))
    sim = Simulation(profile, Deployment(num_collocated=1))
    worker = sim.workers[0]
    assert worker.cost_model is profile.cost_model(1)
    worker.steps = []
    work = [
        Session(f"s{i}", [Turn(list(range(i, i + 40 * (i % 7 + 1))), 20 + i % 5)], i * 0.01)
        for i in range(60)
    ]
    sim.run(work, ArrivalSpec("trace"))
    online = StepCostModel([0.0] * len(FEATURES), knee_tokens=worker.cost_model.knee_tokens)
    online.fit(worker.steps)
    for shape, step_s in worker.steps:
        assert online.predict(shape) == pytest.approx(step_s, rel=1e-3)


def test_simulate_refuses_a_sampled_workload_in_one_line(capsys):
    code, out, err = _run(
        capsys,
        "simulate",
        "--profile",
        "analytic:H100-SXM:llama-3-8b",
        "--preset",
        "chat",
        "--temperature",
        "1",
        "--no-progress",
    )
    assert code == 2 and out == ""
    assert "--temperature 1: profiles time greedy decoding" in err and err.count("\n") == 1
