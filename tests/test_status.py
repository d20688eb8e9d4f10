"""flowsim.status: one enumeration, shared by the compiled JaxRadau loop and every driver."""

import numpy as np
import pytest

from flowsim import stiff
from flowsim.flow import GradientFlow
from flowsim.solvers import solve_flow
from flowsim.status import Status, at


def test_the_compiled_loop_stores_the_same_statuses():
    for code in (stiff.RUNNING, stiff.FINISHED, stiff.STEP_LIMIT, stiff.NON_FINITE, stiff.SOLVER_FAILED):
        assert Status(code).value == code
    assert len({stiff.RUNNING, stiff.FINISHED, stiff.STEP_LIMIT, stiff.NON_FINITE, stiff.SOLVER_FAILED}) == len(Status)


def test_labels_and_messages():
    assert [status.label for status in Status] == ["finished", "step_limit", "non_finite", "running", "solver_failed"]
    assert Status.STEP_LIMIT.message(at(12.5), max_steps=40) == "step limit max_steps = 40 reached at t = 12.5"
    assert Status.SOLVER_FAILED.message(at(3.0), method="BDF", reason="step too small") == "BDF failed at t = 3: step too small"
    assert Status.NON_FINITE.message("between t = 1 and t = 2") == "the state became non-finite between t = 1 and t = 2"
    assert len({status.message(at(1.0), max_steps=1) for status in Status}) == len(Status)


@pytest.mark.parametrize("method", ["JaxRadau", "LSODA", "Tsit5", "gradient_descent"])
def test_every_method_reports_a_step_limit_with_the_same_status(method):
    params0 = {"theta": np.array([1.0, 2.0])}
    flow = GradientFlow(lambda params: 0.5 * (params["theta"] ** 2).sum(), params0)
    result = solve_flow(flow, params0, np.linspace(0, 50, 11), method=method, max_steps=3, lr=1.0)
    assert result.status is Status.STEP_LIMIT and result.status_name == "step_limit"
    assert "max_steps = 3" in result.message and result.summary()["status"] == int(Status.STEP_LIMIT)
