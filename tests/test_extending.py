"""Extending flowsim through its public registries (docs/extending.md): a toy stage and a toy solver, each added
in one place, then seen by everything downstream (detectors, reports, sweep tables; configuration, solve_flow)."""

from dataclasses import dataclass, field

import numpy as np
import pytest

from flowsim import methods

from flowsim.solve import solvers

from flowsim.observe import stages
from flowsim.config import load_config
from flowsim.observe.observables import stage_observables
from flowsim.solve.solvers import FlowResult, Integration, Problem, register_method, solve_flow
from flowsim.observe.stages import Interval, Stage, detect_stages, register_stage
from flowsim.solve.status import Status


@pytest.fixture
def registries():
    """The registries as they were, restored after the test (a registration lasts for the process)."""
    saved = (list(stages.STAGES), dict(stages.STAGE), list(stages.EVENT_STAGES), dict(methods.METHOD),
             dict(solvers.FAMILIES))
    yield
    for live, kept in zip((stages.STAGES, stages.STAGE, stages.EVENT_STAGES, methods.METHOD, solvers.FAMILIES), saved):
        live.clear()
        live.extend(kept) if isinstance(live, list) else live.update(kept)


def loss_halved(detection: stages.Detection) -> list[Interval]:
    """The toy stage: from the first time the (smoothed) loss is at most half its first value."""
    loss = detection.smoothed("loss")
    below = np.flatnonzero(loss <= 0.5 * loss[0])
    if len(below) == 0:
        return []
    return [Interval("loss_halved", None, None, float(detection.t[below[0]]), None, f"loss {loss[below[0]]:.4g}")]


def test_a_registered_stage_is_detected_reported_and_tabled(default_flow, paper_chain, registries):
    from flowsim.observe.families import FAMILIES

    flow, params0 = default_flow
    times = np.concatenate([[0.0], np.geomspace(0.1, 300.0, 120)])
    trajectory = solve_flow(flow, params0, times).trajectory
    observables = stage_observables(trajectory, paper_chain.pi)
    before = detect_stages(observables)

    register_stage(Stage("loss_halved", "onset", event=True, cycle_step=False, colour="tab:pink", hatch="xx",
                         detect=loss_halved))
    report = detect_stages(observables)
    # independent of the detector's code path: the first saved time with the smoothed loss at half its start
    smoothed = stages.smooth_in_log_time(observables.t[1:], observables["loss"][1:], report.thresholds.smoothing_decades)
    expected = float(observables.t[1:][np.argmax(smoothed <= 0.5 * smoothed[0])])
    assert smoothed.min() <= 0.5 * smoothed[0]
    assert report.first_time("loss_halved") == expected
    assert report.dated()["onset_loss_halved"] == expected
    assert report.events()[("loss_halved", None, None, 1)] == expected
    assert [i for i in report.intervals if i.stage != "loss_halved"] == before.intervals  # the shipped stages unmoved
    assert "onset_loss_halved" in FAMILIES["one_layer"].summary_columns()
    assert "onset_loss_halved" in FAMILIES["one_layer"].table_columns()
    assert "loss_halved" in report.table()

    with pytest.raises(ValueError, match="exists already"):
        register_stage(Stage("focus", "onset", event=True, cycle_step=False, colour=None, hatch="", detect=loss_halved))
    with pytest.raises(ValueError, match="needs a detector"):
        register_stage(Stage("no_detector", "onset", event=True, cycle_step=False, colour=None, hatch=""))


@dataclass
class EulerIntegration(Integration):
    theta: np.ndarray | None = None
    saved: list = field(default_factory=list)
    steps: int = 0


@dataclass(frozen=True)
class ToyEuler(solvers.Method):
    """The toy solver: explicit Euler at a fixed step, landing on each save time, one save interval per chunk."""

    step: float = 0.01
    name = "ToyEuler"

    def start(self, problem: Problem) -> EulerIntegration:
        return EulerIntegration(problem, float(problem.times[0]), theta=problem.thetas0[0].copy(), saved=[problem.thetas0[0]])

    def advance(self, run: EulerIntegration) -> None:
        flow, start, target = run.problem.flow, run.t, run.problem.times[len(run.saved)]
        count = int(np.ceil((target - start) / self.step - 1e-9))
        for i in range(count):
            run.theta = run.theta + (target - start) / count * np.asarray(flow.vector_field(run.t, run.theta))
            run.t = start + (target - start) * (i + 1) / count
        run.t, run.steps = target, run.steps + count
        run.saved.append(run.theta)
        if len(run.saved) == len(run.problem.times):
            run.status, run.message = Status.FINISHED, Status.FINISHED.message()

    def results(self, run: EulerIntegration) -> list[FlowResult]:
        counts = {"n_steps": run.steps, "n_rejected": 0, "nfev": run.steps, "njev": 0, "nlu": 0, "compile_seconds": 0.0}
        times = run.problem.times[:len(run.saved)]
        return [solvers.flow_result(run.problem.flow, self.name, run.status, run.message, run.t, times, run.saved,
                                    solvers.solver_stats(counts, run.problem.started))]


def test_a_registered_solver_runs_by_name_from_a_configuration(default_flow, registries):
    flow, params0 = default_flow
    times = np.linspace(0.0, 20.0, 5)  # through condensation
    with pytest.raises(ValueError, match="solver.method = 'ToyEuler' is invalid"):
        load_config(None, ["solver.method='ToyEuler'"])

    register_method(methods.Method("ToyEuler", "toy_euler", default_rtol=1.0), lambda name, lr: ToyEuler())
    assert load_config(None, ["solver.method='ToyEuler'"]).solver.method == "ToyEuler"
    toy = solve_flow(flow, params0, times, method="ToyEuler")
    reference = solve_flow(flow, params0, times, rtol=1e-10, atol=1e-14)
    assert toy.success and toy.method == "ToyEuler" and toy.stats.n_steps == 2000
    error = np.abs(toy.trajectory.loss - reference.trajectory.loss).max()
    halved = solve_flow(flow, params0, times, method=ToyEuler(step=0.005))
    error_halved = np.abs(halved.trajectory.loss - reference.trajectory.loss).max()
    assert 0 < error < 1e-2 and 1.6 < error / error_halved < 2.4  # first order: Euler, not a stand-in

    with pytest.raises(ValueError, match="family 'bdf' is taken"):
        register_method(methods.Method("OtherBDF", "bdf"), lambda name, lr: ToyEuler())
    for shipped in ("JaxRadau", "auto"):
        with pytest.raises(ValueError, match="one of flowsim's own"):
            register_method(methods.Method(shipped, "new_family"), lambda name, lr: ToyEuler())


def test_observables_carry_their_model_family(default_flow, paper_chain, paper_model, tmp_path):
    """Every run's observables name their model's family; observables saved before that are classified by their
    columns; an object of no family, or a family registered twice, is refused."""
    from flowsim.observe.families import FAMILIES, KIND_CONSTANT, ModelFamily, family_of, family_of_observables, register_family
    from flowsim.observe.families import compute_observables
    from flowsim.observe.observables import Observables

    flow, params0 = default_flow
    trajectory = solve_flow(flow, params0, np.linspace(0.0, 2.0, 5)).trajectory
    compute_observables(trajectory, paper_model, paper_chain.pi).save(tmp_path)
    loaded = Observables.load(tmp_path)
    assert str(loaded.constants[KIND_CONSTANT]) == "one_layer"
    assert family_of_observables(loaded.constants, loaded.columns) is FAMILIES["one_layer"] is family_of(paper_model)
    older = {name: value for name, value in loaded.constants.items() if name != KIND_CONSTANT}
    assert family_of_observables(older, loaded.columns) is FAMILIES["one_layer"]
    assert family_of_observables({}, {"sv_W_E": None}) is FAMILIES["two_layer"]
    assert family_of_observables({KIND_CONSTANT: np.asarray("gpt")}, loaded.columns) is None
    with pytest.raises(ValueError, match="belongs to no model family"):
        family_of(object())
    with pytest.raises(ValueError, match="exists already"):
        register_family(ModelFamily("one_layer", (object,), FAMILIES["one_layer"].observables, False, "W0", "attention_entropy"))
