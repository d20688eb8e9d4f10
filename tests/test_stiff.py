"""JaxRadau (flowsim.stiff): against a tight LSODA reference on both models, on a stiff
variant and with a complex eigensystem; batched runs against the same runs one by one."""

import numpy as np
import pytest

from flowsim import stiff
from flowsim.config import load_config
from flowsim.experiment import prepare
from flowsim.solvers import solve_flow, solve_flow_batch

# One save grid size for every test here: the compiled integrator is shared.
SAVE_GRID = ["time.n_linear=41", "time.n_log=20", "time.t_log_min=0.5"]
CONFIGS = "configs/two_layer"


def _reference_error(prepared, rtol=None, atol=1e-12):
    """JaxRadau at (rtol, atol) against LSODA at rtol 1e-12: largest relative loss and parameter
    errors. ``rtol=None`` is JaxRadau's default, the project's default method and tolerance."""
    reference = solve_flow(prepared.flow, prepared.params0, prepared.times, method="LSODA", rtol=1e-12, atol=atol * 1e-3)
    result = solve_flow(prepared.flow, prepared.params0, prepared.times, method="JaxRadau", rtol=rtol, atol=atol)
    assert reference.success and result.success, (reference.message, result.message)
    np.testing.assert_array_equal(result.trajectory.t, prepared.times)
    loss_error = np.max(np.abs(result.trajectory.loss / reference.trajectory.loss - 1))
    theta = np.stack([prepared.flow.flatten(result.trajectory.at(i)) for i in range(len(prepared.times))])
    theta_ref = np.stack([prepared.flow.flatten(reference.trajectory.at(i)) for i in range(len(prepared.times))])
    param_error = np.max(np.abs(theta - theta_ref)) / np.max(np.abs(theta_ref))
    return loss_error, param_error, result, reference


@pytest.mark.parametrize("overrides, rtol", [
    (["time.t_end=400"], None),  # the default: condensation, focus of q0, the next direction opening
    # the stiff variant: its start sits 1e-6 from the saddle, which takes rtol 1e-8 (stated in the README)
    (["time.t_end=400", "init.eps=1e-6", "chain.lam=0.9", "solver.atol=1e-18"], 1e-8),
])
def test_one_layer_matches_tight_reference(overrides, rtol):
    prepared = prepare(load_config(None, [*SAVE_GRID, *overrides]))
    loss_error, param_error, result, reference = _reference_error(prepared, rtol, atol=load_config(None, overrides).solver.atol)
    assert loss_error < 1e-6 and param_error < 1e-5, (loss_error, param_error)
    # the loss moved: agreement is not agreement on a plateau
    assert reference.trajectory.loss[-1] < 0.9 * reference.trajectory.loss[0]
    assert result.stats.njev >= 1 and result.stats.n_steps > 10


@pytest.mark.parametrize("config", ["baseline.toml", "smoothing_0.2.toml"])
def test_two_layer_matches_tight_reference(config):
    """baseline: J = -H, a real eigensystem; depth smoothing makes J non-symmetric (complex route)."""
    prepared = prepare(load_config(f"{CONFIGS}/{config}", [*SAVE_GRID, "time.t_end=12"]))  # through the Q/K ramp
    assert prepared.flow.eigensystem_is_real == (config == "baseline.toml")
    loss_error, param_error, _, reference = _reference_error(prepared)
    assert loss_error < 1e-6 and param_error < 1e-5, (loss_error, param_error)
    assert reference.trajectory.loss[-1] < reference.trajectory.loss[0] - 1e-3


def test_batch_equals_runs_one_by_one():
    prepared = [prepare(load_config(None, [*SAVE_GRID, "time.t_end=200", f"chain.lam={lam}", f"init.seed={seed}"]))
                for lam, seed in [(0.3, 0), (0.7, 1), (0.5, 2)]]
    batch = solve_flow_batch([p.flow for p in prepared], [p.params0 for p in prepared], prepared[0].times)
    losses = [result.trajectory.loss for result in batch]
    assert np.ptp([loss[-1] for loss in losses]) > 1e-2  # the members really differ
    for p, batched in zip(prepared, batch):
        alone = solve_flow(p.flow, p.params0, p.times, method="JaxRadau")
        assert batched.success and alone.success
        assert (batched.stats.n_steps, batched.stats.njev) == (alone.stats.n_steps, alone.stats.njev)
        np.testing.assert_allclose(batched.trajectory.loss, alone.trajectory.loss, rtol=1e-12)
        for name in p.params0:
            np.testing.assert_allclose(batched.trajectory.params[name], alone.trajectory.params[name], rtol=0, atol=1e-10)


def test_batch_rejects_mixed_structures():
    one = prepare(load_config(None, SAVE_GRID))
    two = prepare(load_config(None, [*SAVE_GRID, "model.m=4"]))
    with pytest.raises(ValueError, match="share one structure"):
        solve_flow_batch([one.flow, two.flow], [one.params0, two.params0], one.times)


def test_dense_output_reproduces_the_step_end():
    """The collocation polynomial at x = 1 is y_old + Z[2], the step's end: P @ [1, 1, 1] = e_3."""
    np.testing.assert_allclose(stiff.P @ np.ones(3), [0.0, 0.0, 1.0], atol=1e-12)
    np.testing.assert_allclose(stiff.T @ stiff.TI, np.eye(3), atol=1e-12)


def test_compilation_cache_variable_keeps_compiled_code_on_disk(tmp_path):
    """FLOWSIM_COMPILATION_CACHE=DIR: the integrator compiled in one process is written under DIR."""
    import os
    import subprocess
    import sys

    script = ("import numpy as np; from flowsim.config import load_config; from flowsim.experiment import prepare; "
              "from flowsim.solvers import solve_flow; p = prepare(load_config(None, ['time.t_end=5'])); "
              "print(solve_flow(p.flow, p.params0, p.times, method='JaxRadau').status_name)")
    cache = tmp_path / "cache"
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "FLOWSIM_COMPILATION_CACHE": str(cache)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "finished", run.stderr[-2000:]
    assert cache.is_dir() and sum(1 for path in cache.rglob("*") if path.is_file()) >= 2


@pytest.mark.parametrize("setting, expected", [(None, "{xdg}/flowsim/xla"), ("off", "None"), ("{tmp}/mine", "{tmp}/mine")])
def test_compilation_cache_location(tmp_path, setting, expected):
    """By default compiled code goes under the user's cache directory; "off" turns the cache off."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "FLOWSIM_COMPILATION_CACHE"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    if setting is not None:
        env["FLOWSIM_COMPILATION_CACHE"] = setting.format(tmp=tmp_path)
    script = "import flowsim, jax; print(jax.config.jax_compilation_cache_dir)"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == expected.format(xdg=tmp_path / "xdg", tmp=tmp_path)


def test_compiler_options_reach_xla_and_unknown_ones_fall_back(monkeypatch):
    """JaxRadau compiles with ``stiff.COMPILER_OPTIONS`` (its small products as XLA loops, not
    library calls); an XLA that does not know an option compiles without it, other errors still raise."""
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b).lower(jnp.ones((192, 3)), jnp.ones((3, 3)))
    default, ours = lowered.compile().as_text(), stiff._compile(lowered).as_text()
    if "ynn_fusion" not in default:
        pytest.skip("this XLA makes no YNNPACK library calls")
    assert "ynn_fusion" not in ours
    monkeypatch.setattr(stiff, "COMPILER_OPTIONS", {"xla_flowsim_no_such_option": ""})
    assert "ynn_fusion" in stiff._compile(lowered).as_text()
    monkeypatch.setattr(stiff, "COMPILER_OPTIONS", {"xla_cpu_experimental_ynn_fusion_type": 3.5})
    with pytest.raises(Exception):
        stiff._compile(lowered)
