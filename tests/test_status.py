"""flowsim.solve.status: one enumeration, shared by the compiled JaxRadau loop and every driver."""

import numpy as np
import pytest

from flowsim.solve import stiff
from flowsim.model.flow import GradientFlow
from flowsim.solve.solvers import solve_flow
from flowsim.solve.status import Status, at_time


def test_the_compiled_loop_stores_the_same_statuses():
    loop_codes = (stiff.RUNNING, stiff.FINISHED, stiff.STEP_LIMIT, stiff.NON_FINITE, stiff.SOLVER_FAILED)
    for code in loop_codes:
        assert Status(code).value == code
    assert len(set(loop_codes)) == len(loop_codes)
    # the drivers alone set these: a stop request between chunks, a diverging gradient descent
    assert {Status.INTERRUPTED, Status.DIVERGED}.isdisjoint(Status(code) for code in loop_codes)


def test_labels_and_messages():
    assert [status.label for status in Status] == ["finished", "step_limit", "non_finite", "running", "diverged",
                                                   "interrupted", "solver_failed"]
    assert Status.STEP_LIMIT.message(at_time(12.5), max_steps=40) == "step limit max_steps = 40 reached at t = 12.5"
    assert Status.SOLVER_FAILED.message(at_time(3.0), method="BDF", reason="step too small") == "BDF failed at t = 3: step too small"
    assert Status.NON_FINITE.message("between t = 1 and t = 2") == "the state became non-finite between t = 1 and t = 2"
    assert Status.INTERRUPTED.message(at_time(7.0)) == "stopped on request at t = 7"
    assert len({status.message(at_time(1.0), max_steps=1) for status in Status}) == len(Status)


def test_partial_and_broken_runs_are_told_apart():
    assert {status for status in Status if status.partial} == {Status.STEP_LIMIT, Status.INTERRUPTED, Status.RUNNING}
    assert {status for status in Status if status.broken} == {Status.NON_FINITE, Status.DIVERGED}
    assert not Status.FINISHED.partial and not Status.FINISHED.broken


@pytest.mark.parametrize("method", ["JaxRadau", "LSODA", "Tsit5", "gradient_descent"])
def test_every_method_reports_a_step_limit_with_the_same_status(method):
    params0 = {"theta": np.array([1.0, 2.0])}
    flow = GradientFlow(lambda params: 0.5 * (params["theta"] ** 2).sum(), params0)
    result = solve_flow(flow, params0, np.linspace(0, 50, 11), method=method, max_steps=3, lr=1.0)
    assert result.status is Status.STEP_LIMIT and result.status_name == "step_limit"
    assert "max_steps = 3" in result.message and result.summary()["status"] == int(Status.STEP_LIMIT)
