"""flowsim.budget: sizes are estimated and refused before anything is allocated."""

import pytest

from flowsim import budget


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
