"""flowsim.common.budget: sizes are estimated and refused before anything is allocated."""

import pytest

from flowsim.common import budget


def test_the_budget_comes_from_the_environment_or_the_machine(monkeypatch):
    monkeypatch.setenv(budget.BUDGET_VARIABLE, "2.5")
    assert budget.memory_budget_bytes()[0] == 2.5e9
    monkeypatch.delenv(budget.BUDGET_VARIABLE)
    value, source = budget.memory_budget_bytes()
    assert value == pytest.approx(0.5 * budget.physical_memory_bytes()) and budget.BUDGET_VARIABLE in source
    monkeypatch.setenv(budget.BUDGET_VARIABLE, "-1")
    with pytest.raises(budget.BudgetError, match="positive number of gigabytes"):
        budget.memory_budget_bytes()


def test_an_estimate_over_the_budget_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(budget.BUDGET_VARIABLE, "1")
    budget.check_memory(0.9e9, "a small thing", "make it smaller")  # within budget: nothing happens
    with pytest.raises(budget.BudgetError) as error:
        budget.check_memory(3.2e12, "a big thing", "make it smaller")
    message = str(error.value)
    assert "a big thing needs about 3.2 TB" in message and "1 GB" in message and message.endswith("make it smaller")
    assert "\n" not in message


@pytest.mark.parametrize("overrides, names", [
    (["time.n_log=100000000"], "time.n_log"),
    ([f"chain.pi={[1.0 / 30000] * 30000}"], "len(chain.pi)"),
    (["model.m=100000", "solver.method='LSODA'"], "solver.method = 'LSODA'"),
])
def test_runs_too_large_for_memory_are_refused_before_anything_is_built(overrides, names, monkeypatch):
    """Each of these allocated gigabytes, or hung, before it failed; now each is one estimate, at once."""
    import time

    from flowsim.config import load_config
    from flowsim.assemble import prepare

    monkeypatch.setenv(budget.BUDGET_VARIABLE, "4")
    config = load_config(None, overrides)
    began = time.perf_counter()
    with pytest.raises(budget.BudgetError, match=r"needs about .* over the memory budget of 4 GB") as refused:
        prepare(config)
    assert names in str(refused.value) and time.perf_counter() - began < 5.0


def test_a_huge_induction_task_is_refused_by_its_size_without_computing_it():
    from flowsim.model.tasks import InductionTask

    with pytest.raises(ValueError, match=r"enumerates d!·d\^\(s\+1\) = 10\^\d+\.\d .* lower task.s or task.d"):
        InductionTask(d=100_000_000, s=6)
    with pytest.raises(ValueError, match=r"10\^"):
        InductionTask(d=171, s=2)  # d! overflows a float: the message must still format
