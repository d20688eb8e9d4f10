"""flowsim.solve.solvers: every method through one entry point, agreeing with each other; step
limits, blow-ups and failures kept and reported; bad arguments refused."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from flowsim.model.flow import GradientFlow
from flowsim.solve.solvers import solve_flow
from flowsim.solve.status import Status


@pytest.mark.slow
def test_solvers_agree_at_tight_tolerance(default_flow):
    flow, params0 = default_flow
    times = np.array([0.0, 50.0, 300.0])  # through condensation, the first focus and the next direction opening
    # diffrax's implicit Kvaerno5 shares its code path with Tsit5 here and costs a minute
    # (benchmarks/solvers.py runs it); JaxRadau is the compiled implicit method.
    results = {
        method: solve_flow(flow, params0, times, method=method, rtol=1e-9, atol=1e-13, max_steps=400_000)
        for method in ("LSODA", "BDF", "Radau", "JaxRadau", "JaxBDF", "Tsit5")
    }
    reference = results["LSODA"]
    for method, result in results.items():
        assert result.success, (method, result.message)
        np.testing.assert_array_equal(result.trajectory.t, times)
        for index in (1, 2):
            difference = np.abs(flow.flatten(result.trajectory.at(index)) - flow.flatten(reference.trajectory.at(index)))
            assert difference.max() < 1e-6, (method, times[index], difference.max())
    # the state moved by O(1): agreement is not agreement on a frozen state
    assert np.abs(flow.flatten(reference.trajectory.at(2))).max() > 0.5


def test_gradient_descent_approaches_the_flow_at_order_eta(default_flow):
    flow, params0 = default_flow
    times = np.array([0.0, 10.0, 20.0])  # through condensation: the state changes at O(1)
    flow_end = flow.flatten(solve_flow(flow, params0, times, rtol=1e-11, atol=1e-15).trajectory.at(-1))
    errors = []
    for lr in (0.1, 0.05, 0.025):
        descent = solve_flow(flow, params0, times, method="gradient_descent", lr=lr)
        assert descent.success
        np.testing.assert_allclose(descent.trajectory.t, times, atol=1e-12)
        errors.append(np.abs(flow.flatten(descent.trajectory.at(-1)) - flow_end).max())
    assert errors[0] > 1e-4
    for coarse, fine in zip(errors, errors[1:]):
        assert 1.8 < coarse / fine < 2.2


@pytest.mark.parametrize("method", ["LSODA", pytest.param("Tsit5", marks=pytest.mark.slow), pytest.param("JaxRadau", marks=pytest.mark.slow), "JaxBDF",
                                    "gradient_descent"])
def test_step_limit_keeps_and_marks_what_was_computed(default_flow, method):
    flow, params0 = default_flow
    times = np.linspace(0.0, 100.0, 101)
    result = solve_flow(flow, params0, times, method=method, max_steps=60, lr=1.0)
    assert result.status == Status.STEP_LIMIT and not result.success
    assert "step limit" in result.message
    n = len(result.trajectory)
    assert 1 <= n < len(times)
    np.testing.assert_allclose(result.trajectory.t, times[:n])
    assert np.all(np.isfinite(result.trajectory.params["W0"]))
    # what was kept is right: it matches a full run at the same times
    full = solve_flow(flow, params0, times[:n], method=method, lr=1.0, rtol=1e-8, atol=1e-12) if n > 1 else None
    if full is not None:
        np.testing.assert_allclose(result.trajectory.params["W1"][-1], full.trajectory.params["W1"][-1], atol=1e-6)


def test_non_finite_state_and_solver_failure_are_reported():
    """L = -Σ θ^4 / 4 gives dθ/dt = θ^3, which blows up at t = 1/(2 θ0^2) = 0.5 for θ0 = 1."""
    params0 = {"theta": np.ones(3)}
    flow = GradientFlow(lambda params: -jnp.sum(params["theta"] ** 4) / 4, params0)
    times = np.linspace(0.0, 2.0, 21)
    descent = solve_flow(flow, params0, times, method="gradient_descent", lr=0.05)
    assert descent.status == Status.NON_FINITE and "non-finite" in descent.message
    assert 2 <= len(descent.trajectory) < len(times) and np.all(np.isfinite(descent.trajectory.params["theta"]))
    for method in ("LSODA", "JaxRadau", "JaxBDF"):
        stiff = solve_flow(flow, params0, times, method=method, max_steps=5000)
        assert stiff.status in (Status.NON_FINITE, Status.SOLVER_FAILED, Status.STEP_LIMIT) and not stiff.success, method
        assert stiff.t_reached == pytest.approx(0.5, abs=0.01), method
        # t = 0, 0.1, ..., 0.4: every save time before the blow-up. An implicit collocation step
        # can land on t = 0.5 itself with a large finite value; nothing after it is kept.
        kept = stiff.trajectory
        before = kept.t < 0.5
        assert np.count_nonzero(before) == 5 and len(kept) <= 6, method
        # to each method's accuracy at its default rtol; JaxBDF's formulas are of order 5 at most, and by t = 0.4 the
        # blow-up has amplified earlier errors (1 - 2t)^(-3/2) = 11-fold: 1.2e-5 there at its default rtol of 1e-7
        accuracy = 3e-5 if method == "JaxBDF" else 1e-6
        np.testing.assert_allclose(kept.params["theta"][before, 0], 1 / np.sqrt(1 - 2 * kept.t[before]), rtol=accuracy)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="Euler"), "solver.method = 'Euler' is invalid: input should be 'auto', 'LSODA'"),
        (dict(method="gradient_descent"), "positive learning rate"),
        (dict(method="gradient_descent", lr=0.0), "solver.lr = 0.0 is invalid: input should be greater than 0"),
        (dict(rtol=-1.0), "solver.rtol = -1.0 is invalid: input should be greater than or equal to 0.00000000000001"),
        (dict(atol=float("nan")), "solver.atol = nan is invalid"),
        (dict(max_steps=0), "solver.max_steps = 0 is invalid"),
        (dict(max_steps=2.5), "solver.max_steps = 2.5 has type float, expected int"),
    ],
)
def test_bad_solver_arguments(default_flow, kwargs, message):
    flow, params0 = default_flow
    with pytest.raises(ValueError, match=message):
        solve_flow(flow, params0, [0.0, 1.0], **kwargs)


@pytest.mark.parametrize("times, message", [([1.0, 2.0], "start at t = 0"), ([0.0, 2.0, 1.0], "ascending")])
def test_bad_save_times(default_flow, times, message):
    flow, params0 = default_flow
    with pytest.raises(ValueError, match=message):
        solve_flow(flow, params0, times)


@pytest.mark.parametrize("method", ["LSODA", "gradient_descent"])
def test_checkpoints_are_prefixes_of_the_final_trajectory(default_flow, method):
    flow, params0 = default_flow
    times = np.linspace(0.0, 20.0, 11)  # few distinct prefix lengths: few recompiles of the loss
    partials = []
    result = solve_flow(flow, params0, times, method=method, lr=0.5, on_checkpoint=partials.append, checkpoint_every_s=0.0)
    assert result.success and len(partials) >= 3
    for partial in partials:
        n = len(partial.trajectory)
        np.testing.assert_array_equal(partial.trajectory.t, result.trajectory.t[:n])
        np.testing.assert_array_equal(partial.trajectory.params["W0"], result.trajectory.params["W0"][:n])


def _stop_after(calls: int):
    """A stop request that turns true on its ``calls``-th poll (as a signal arriving mid-run would)."""
    polls = []

    def should_stop():
        polls.append(None)
        return len(polls) >= calls

    return should_stop


def _same_trajectory(a, b) -> bool:
    return np.array_equal(a.t, b.t) and all(np.array_equal(a.params[name], b.params[name]) for name in a.params)


def test_jaxradau_in_chunks_takes_the_uninterrupted_steps(default_flow, monkeypatch):
    import flowsim.solve.compiled_methods as compiled_methods

    flow, params0 = default_flow
    times = np.linspace(0.0, 400.0, 41)
    whole = solve_flow(flow, params0, times)
    monkeypatch.setattr(compiled_methods, "RADAU_CHUNK_SECONDS", 1e-4)  # a chunk of one or two attempts
    polls = []
    chunked = solve_flow(flow, params0, times, should_stop=lambda: polls.append(None) or False)
    assert len(polls) > 20 and chunked.success
    assert _same_trajectory(chunked.trajectory, whole.trajectory) and chunked.stats.n_steps == whole.stats.n_steps


@pytest.mark.parametrize("method", ["JaxRadau", "gradient_descent", "LSODA", pytest.param("Tsit5", marks=pytest.mark.slow), "JaxBDF"])
def test_an_interrupted_solve_resumes_to_the_uninterrupted_result(default_flow, method, monkeypatch):
    import flowsim.solve.compiled_methods as compiled_methods
    from flowsim.solve.solvers import ResumePoint

    flow, params0 = default_flow
    monkeypatch.setattr(compiled_methods, "RADAU_CHUNK_SECONDS", 1e-4)
    times = np.linspace(0.0, 100.0, 41)
    options = {"method": method, "lr": 0.5, "rtol": None if method == "JaxRadau" else 1e-8}
    whole = solve_flow(flow, params0, times, **options)
    # polled once per step (per chunk of about one attempt for JaxRadau), once per save for gradient descent
    polls = len(times) // 2 if method == "gradient_descent" else whole.stats.n_steps // 2
    part = solve_flow(flow, params0, times, should_stop=_stop_after(polls), **options)
    assert part.status == Status.INTERRUPTED and "stopped on request" in part.message
    assert 1 < len(part.trajectory) < len(whole.trajectory)
    assert (part.solver_state is not None) == (method in ("JaxRadau", "JaxBDF"))
    resume = ResumePoint(part.trajectory.t, flow.flatten_batch(part.trajectory.params), part.solver_state)
    resumed = solve_flow(flow, params0, times, resume=resume, **options)
    assert resumed.success and resume.is_exact(method) == (method in ("JaxRadau", "gradient_descent", "JaxBDF"))
    np.testing.assert_array_equal(resumed.trajectory.t, whole.trajectory.t)
    if resume.is_exact(method):
        assert _same_trajectory(resumed.trajectory, whole.trajectory)
    if method == "JaxRadau":  # a state saved before eigensystems carried their next subspace
        older = {name: array for name, array in part.solver_state.items() if name != "jacobian.ahead"}
        resumed = solve_flow(flow, params0, times, resume=dataclasses.replace(resume, solver_state=older), **options)
        assert _same_trajectory(resumed.trajectory, whole.trajectory)
        # and one saved with a smaller save buffer (64 slots, as earlier versions kept for 41 times)
        smaller = {**part.solver_state, "saved": part.solver_state["saved"][:, :64]}
        resumed = solve_flow(flow, params0, times, resume=dataclasses.replace(resume, solver_state=smaller), **options)
        assert _same_trajectory(resumed.trajectory, whole.trajectory)
        # met by JaxBDF (a run that "auto" began with JaxRadau in earlier versions): afresh from the last saved point
        by_another = dataclasses.replace(resume, state_method="JaxRadau")
        assert not by_another.is_exact("JaxBDF")
        continued = solve_flow(flow, params0, times, resume=by_another, method="JaxBDF", rtol=1e-8)
        assert continued.success and continued.method == "JaxBDF"
        np.testing.assert_array_equal(continued.trajectory.t, whole.trajectory.t)
        np.testing.assert_allclose(continued.trajectory.loss, whole.trajectory.loss, rtol=1e-5)
    if method == "JaxBDF":
        assert resumed.stats.n_steps == whole.stats.n_steps and resumed.stats.nfev == whole.stats.nfev
        # only the points written are kept: the state holds as many as the trajectory, not the whole save buffer
        assert len(part.solver_state["saved"]) == len(part.trajectory)
        for name, value, named in (("t", np.array(1e9), "at t = 1000000000.0, outside"), ("h", np.array(-1.0), "not positive"),
                                   ("D", part.solver_state["D"][:3], "differences of shape (3,")):
            with pytest.raises(ValueError, match=re.escape(named)):
                solve_flow(flow, params0, times, resume=dataclasses.replace(resume, solver_state={**part.solver_state, name: value}), **options)
        without = {key: array for key, array in part.solver_state.items() if key != "rate"}
        with pytest.raises(ValueError, match="the saved JaxBDF state lacks the array 'rate'"):
            solve_flow(flow, params0, times, resume=dataclasses.replace(resume, solver_state=without), **options)
        resume = dataclasses.replace(resume, solver_state=None)  # a run interrupted before JaxBDF saved its state
        resumed = solve_flow(flow, params0, times, resume=resume, **options)
        assert resumed.success and not resume.is_exact(method)
    if not resume.is_exact(method):  # a fresh start at the last saved point: the same flow, other steps
        for name in whole.trajectory.params:
            np.testing.assert_allclose(resumed.trajectory.params[name], whole.trajectory.params[name], atol=1e-6)


def test_save_grids_of_different_lengths_share_one_compiled_loop(default_flow, monkeypatch):
    import flowsim.solve.compiled_methods as compiled_methods

    flow, params0 = default_flow
    monkeypatch.setattr(compiled_methods, "_RADAU_COMPILED", {})
    short = solve_flow(flow, params0, np.linspace(0.0, 5.0, 11), method="JaxRadau")
    long = solve_flow(flow, params0, np.linspace(0.0, 5.0, 300), method="JaxRadau")
    assert short.success and long.success and short.stats.compile_seconds > 0
    assert long.stats.compile_seconds == 0 and len(compiled_methods._RADAU_COMPILED) == 1
    np.testing.assert_allclose(long.trajectory.loss[-1], short.trajectory.loss[-1], rtol=1e-6)


@pytest.mark.slow
def test_the_large_flow_newton_control_reaches_the_same_flow(default_flow):
    """The default flow run as a large one (lagged refreshes, the slow-solve Newton control) agrees
    with its usual run to the solver's tolerance, with its own steps."""
    from flowsim.solve.solvers import JaxRadau

    flow, params0 = default_flow
    times = np.linspace(0.0, 1000.0, 41)
    usual = solve_flow(flow, params0, times)
    large = solve_flow(flow, params0, times, method=JaxRadau(large_flow=True))
    assert usual.success and large.success and large.stats.n_steps != usual.stats.n_steps
    np.testing.assert_allclose(large.trajectory.loss, usual.trajectory.loss, rtol=1e-5)
    for name in usual.trajectory.params:
        np.testing.assert_allclose(large.trajectory.params[name], usual.trajectory.params[name], atol=1e-4)


@pytest.mark.parametrize("products", ["difference", "exact"])
def test_jaxbdf_follows_jaxradau_through_the_stages(default_flow, products):
    """The matrix-free BDF, with J·v by differences (the default) or exact, against the Radau loop on the default
    flow, through condensation, the focus and the next direction opening: the loss within the tolerance's reach,
    with its own steps."""
    from flowsim.solve.solvers import JaxBDF

    flow, params0 = default_flow
    times = np.linspace(0.0, 400.0, 41)
    radau = solve_flow(flow, params0, times, rtol=1e-9, atol=1e-13)
    result = solve_flow(flow, params0, times, method=JaxBDF(jacobian_products=products), rtol=1e-8, atol=1e-13)
    assert result.success and result.stats.njev > 0 and result.stats.n_steps != radau.stats.n_steps
    np.testing.assert_array_equal(result.trajectory.t, times)
    np.testing.assert_allclose(result.trajectory.loss, radau.trajectory.loss, rtol=1e-6)
    assert abs(radau.trajectory.loss[-1] - radau.trajectory.loss[0]) > 0.1  # the flow moved


def test_jaxbdf_refuses_an_unknown_product_route():
    from flowsim.solve.solvers import JaxBDF

    with pytest.raises(ValueError, match="jacobian_products must be 'difference' or 'exact', got 'forward'"):
        JaxBDF(jacobian_products="forward")


def test_a_diverging_gradient_descent_stops_with_status_diverged(default_flow):
    flow, params0 = default_flow
    result = solve_flow(flow, params0, np.linspace(0.0, 2000.0, 101), method="gradient_descent", lr=20.0)
    assert result.status == Status.DIVERGED and not result.success and "lower solver.lr" in result.message
    loss = result.trajectory.loss
    assert np.all(np.isfinite(loss)) and loss.max() <= 1e3 * loss[0] and result.t_reached < 2000.0


@pytest.mark.slow
def test_the_stiff_subspace_grows_with_the_flow_so_a_sixteen_token_flow_finishes():
    """d = 16, m = k = 16 (n = 1024), Zipf π, to t = 6000: with 8 eigenpairs most stiff
    directions lay outside the subspace (step limit after 20000 attempts at t = 4633); with
    the size-dependent rank the run finishes in under 2000 attempts and descends."""
    from flowsim.config import resolve_config
    from flowsim.assemble import prepare
    from flowsim.solve.solvers import stiff_rank

    pi = 1.0 / np.arange(1, 17)
    config = resolve_config({"chain": {"pi": (pi / pi.sum()).tolist(), "lam": 0.5}, "model": {"m": 16, "k": 16},
                             "time": {"t_end": 6000.0, "n_linear": 31, "n_log": 20}})
    prepared = prepare(config)
    assert prepared.flow.size == 1024 and stiff_rank(prepared.flow.size) > 8 == stiff_rank(832)
    result = solve_flow(prepared.flow, prepared.params0, prepared.times, method="JaxRadau", max_steps=2000)
    assert result.success, result.message
    assert np.all(np.diff(result.trajectory.loss) <= 1e-9) and result.trajectory.loss[-1] < 0.7 * result.trajectory.loss[0]


@pytest.mark.parametrize("method", ["JaxRadau", "JaxBDF", "LSODA"])
def test_the_progress_bar_says_when_it_is_compiling(default_flow, method, capsys):
    """The first run of a model shape spends tens of seconds in JAX's compiler: the bar says so, not 0%."""
    flow, params0 = default_flow
    result = solve_flow(flow, params0, np.array([0.0, 1.0]), method=method, progress=True)
    assert result.success
    shown = capsys.readouterr().err
    assert f"flow ({method}) compiling (once per model shape) 0 s" in shown and f"flow ({method}) t=1/1" in shown
