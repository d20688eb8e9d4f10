"""The compiled stiff methods: JaxRadau (Radau IIA over a batch of flows, ``flowsim.solve.stiff``) and JaxBDF
(matrix-free variable-order BDF, ``flowsim.solve.bdf``), each one XLA loop called in chunks of step attempts."""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowsim.solve import bdf, stiff
from flowsim.model import flow as flow_functions
from flowsim.model.flow import GradientFlow
from flowsim.solve.integration import FlowResult, Integration, Method, Problem, SolverStats, flow_result
from flowsim.solve.status import Status, at_time


# Compiled JaxRadau integrators, shared by flows of one structure, batch size, save grid and method fields.
_RADAU_COMPILED: dict[tuple, stiff.RadauFunctions] = {}
RADAU_FIRST_CHUNK = 8  # step attempts in the first call of the compiled loop, when chunked
RADAU_CHUNK_SECONDS = 0.5  # later chunks are sized to about this wall-clock time
SAVE_BUFFER_BYTES = 16 * 2**20  # a save buffer this small costs nothing to carry (MEASUREMENTS.md)
SEQUENTIAL_STAGES_FROM_SIZE = 16_384  # larger flows evaluate the three Radau stages one by one (MEASUREMENTS.md)
# Eigenpairs of the Jacobian JaxRadau keeps (its stiff directions), by flow size: 8 at the
# paper's sizes, 32 from n = 1024, where 8 leaves stiff directions outside the subspace and
# the Newton iteration fails (benchmarks/MEASUREMENTS.md).
STIFF_RANKS = ((0, 8), (1024, 32))
# From this size the flow has more stiff directions than the eigensystem keeps: Newton control
# for slow solves (stiff.LARGE_FLOW_CONTROL) and lagged subspace refreshes (MEASUREMENTS.md).
LARGE_FLOW_FROM_SIZE = 1024


def stiff_rank(size: int) -> int:
    """The number of eigenpairs JaxRadau keeps for a flow of ``size`` parameters (STIFF_RANKS)."""
    return max(rank for threshold, rank in STIFF_RANKS if size >= threshold)


def _save_slots(n_times: int, size: int) -> int:
    """Save buffers come in powers of two, at least 64 and, while the buffer of a flow of ``size`` parameters
    stays within SAVE_BUFFER_BYTES, at least 512: every save grid of up to 512 times shares one compilation."""
    floor = 512 if 512 * size * 8 <= SAVE_BUFFER_BYTES else 64
    return max(floor, 1 << (n_times - 1).bit_length())


@dataclass
class RadauIntegration(Integration):
    functions: Any = None
    loss: Any = None  # the batch's losses, stacked
    state: Any = None  # stiff.RadauState
    times_device: Any = None
    slots: int = 0
    chunk: int = RADAU_FIRST_CHUNK
    solve_started: float = 0.0


@dataclass(frozen=True)
class JaxRadau(Method):
    """Radau IIA (order 5) compiled end to end in JAX (``flowsim.solve.stiff``) over a batch of flows.

    ``rank``: eigenpairs of the Jacobian kept (None: ``stiff_rank(n)``, the full eigensystem when n is
    smaller); ``large_flow``: the Newton control and lagged subspace refreshes of flows with more stiff
    directions than the eigensystem keeps (None: from n = LARGE_FLOW_FROM_SIZE); ``fused_products``:
    the model's small products fused inside the loop (``GradientFlow.loop_loss``)."""

    rank: int | None = None
    large_flow: bool | None = None
    fused_products: bool = True
    name = "JaxRadau"

    def rank_for(self, size: int) -> int:
        return stiff_rank(size) if self.rank is None else self.rank

    def is_large(self, size: int) -> bool:
        return size >= LARGE_FLOW_FROM_SIZE if self.large_flow is None else self.large_flow

    def compiled(self, flow: GradientFlow, batch: int, n_save: int, loss_batch) -> tuple[stiff.RadauFunctions, float]:
        """The compiled integrator for this structure (built on first use) and the seconds spent compiling now."""
        rank, large = self.rank_for(flow.size), self.is_large(flow.size)
        key = (flow.structure_key, batch, n_save, rank, large, self.fused_products)
        if key in _RADAU_COMPILED:
            return _RADAU_COMPILED[key], 0.0
        # Pure functions of one member with the (static) structure bound: no flow object is captured.
        structure = flow.structure
        bind = lambda function: functools.partial(function, structure)  # noqa: E731
        if not flow.eigensystem_is_real:
            eigensystem = stiff.general_eigensystem(bind(flow_functions.jacobian))
        elif flow.size <= rank:
            eigensystem = stiff.symmetric_eigensystem(bind(flow_functions.rate_vector), bind(flow_functions.loss_hessian))
        else:
            eigensystem = stiff.low_rank_eigensystem(bind(flow_functions.rate_vector), bind(flow_functions.loss_gradient),
                                                     flow.size, rank, lagged=large)
        newton = stiff.LARGE_FLOW_CONTROL if large else stiff.NewtonControl()
        problem = stiff.RadauProblem(bind(flow_functions.vector_field), eigensystem, flow.rates.kinks,
                                     sequential_stages=flow.size >= SEQUENTIAL_STAGES_FROM_SIZE, newton=newton)
        functions = stiff.build_radau(problem, batch, n_save, flow.size, loss_batch)
        _RADAU_COMPILED[key] = functions
        return functions, functions.compile_seconds

    def check_saved_state(self, arrays: dict[str, np.ndarray], problem: Problem) -> stiff.RadauState:
        """A saved loop state (``FlowResult.solver_state``) for this problem, or a ValueError naming what is wrong."""
        batch, size = problem.thetas0.shape
        state = _radau_state_from_arrays(arrays, batch, size, _save_slots(len(problem.times), size), self.is_large(size))
        _check_saved_time(self.name, state.t, problem.times)
        if not (np.all(np.isfinite(np.asarray(state.y))) and np.all(np.asarray(state.h) > 0)):
            raise ValueError("the saved JaxRadau state holds a non-finite point or a step size that is not positive: "
                             "the file was altered")
        return state

    def start(self, problem: Problem, state: stiff.RadauState | None = None) -> RadauIntegration:
        """Compile (once per structure) and start, or continue the loop ``state``."""
        flows, times = problem.flows, problem.times
        losses = [flow.loop_loss if self.fused_products else flow.loss for flow in flows]
        loss = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *losses)
        slots = _save_slots(len(times), problem.flow.size)
        functions, compile_seconds = self.compiled(problem.flow, len(flows), slots, loss)
        times_device = padded_save_times(times, slots)
        solve_started = time.perf_counter()
        if state is None:
            state = functions.init(jnp.asarray(problem.thetas0), loss, times_device, times[-1], problem.rtol, problem.atol)
        run = RadauIntegration(problem, float(times[0]), compile_seconds=compile_seconds, functions=functions, loss=loss,
                               state=state, times_device=times_device, slots=slots, chunk=first_chunk(problem),
                               solve_started=solve_started)
        run.t = float(np.min(np.asarray(state.t)))
        return run

    def advance(self, run: RadauIntegration) -> None:
        problem, t_end = run.problem, run.problem.times[-1]
        max_attempts = attempt_limit(problem)
        chunk_started = time.perf_counter()
        run.state = run.functions.advance(run.state, run.loss, run.times_device, t_end, t_end, problem.rtol, problem.atol,
                                          max_attempts, np.int32(run.chunk))
        active = np.asarray(run.state.status) == Status.RUNNING
        run.chunk = next_chunk(run.chunk, time.perf_counter() - chunk_started)
        run.t = float(np.min(np.where(active, run.state.t, t_end)))
        if not active.any():
            run.status = Status.FINISHED  # each member's own status is in its result

    def interrupt(self, run: RadauIntegration) -> None:
        run.status = Status.INTERRUPTED

    def results(self, run: RadauIntegration) -> list[FlowResult]:
        problem, state = run.problem, jax.device_get(run.state)
        wall, solve_seconds = time.perf_counter() - problem.started, time.perf_counter() - run.solve_started
        arrays = _radau_state_to_arrays(run.state) if run.status == Status.INTERRUPTED else None
        results = []
        for i, flow in enumerate(problem.flows):
            status = Status(int(state.status[i]))
            message = status.message(at_time(float(state.t[i])), max_steps=problem.max_steps, method=self.name,
                                     reason="the step size fell below its floor")
            n_saved = int(state.n_saved[i])
            stats = SolverStats(
                n_steps=int(state.n_steps[i]), n_rejected=int(state.n_rejected[i]), nfev=int(state.nfev[i]),
                njev=int(state.njev[i]), nlu=int(state.njev[i]), wall_time_s=wall, compile_seconds=run.compile_seconds,
                solve_seconds=solve_seconds,
            )
            result = flow_result(flow, self.name, status, message, state.t[i], problem.times[:n_saved], state.saved[i, :n_saved], stats)
            if arrays is not None and status == Status.RUNNING:
                result = dataclasses.replace(result, status=Status.INTERRUPTED, solver_state=arrays,
                                             message=Status.INTERRUPTED.message(at_time(result.t_reached)))
            results.append(result)
        return results


def _check_saved_time(method: str, t, times: np.ndarray) -> None:
    """A saved loop state's time(s) must lie in the run's save times; a ValueError names them otherwise."""
    t, start, end = np.asarray(t), float(times[0]), float(times[-1])
    if not np.all(np.isfinite(t)) or np.any(t < start) or np.any(t > end):
        raise ValueError(f"the saved {method} state is at t = {t.tolist()}, outside the run's save times [{start:g}, "
                         f"{end:g}]: the file was altered")


def padded_save_times(times: np.ndarray, slots: int) -> jax.Array:
    """The save times padded with +inf to the save buffer's ``slots`` (never reached)."""
    return jnp.asarray(np.concatenate([times, np.full(slots - len(times), np.inf)]))


def first_chunk(problem: Problem) -> int:
    """Step attempts in a compiled loop's first call: each call returns to the host to report, checkpoint or stop,
    so only when someone is listening does the loop run in chunks (later ones sized by ``next_chunk``)."""
    return RADAU_FIRST_CHUNK if problem.listening else 2**31 - 1


def attempt_limit(problem: Problem) -> np.int32:
    """``max_steps`` as the compiled loops take it."""
    return np.int32(min(problem.max_steps, 2**31 - 1))


def next_chunk(chunk: int, elapsed: float) -> int:
    """Step attempts for a compiled loop's next call: sized to about RADAU_CHUNK_SECONDS, at most doubled."""
    return int(np.clip(chunk * RADAU_CHUNK_SECONDS / max(elapsed, 1e-3), 1, 2 * chunk + 1))


def _radau_state_to_arrays(state: stiff.RadauState) -> dict[str, np.ndarray]:
    """The loop state as named numpy arrays (``jacobian.V`` for the nested eigensystem)."""
    state = jax.device_get(state)
    arrays = {name: np.asarray(value) for name, value in state._asdict().items() if name != "jacobian"}
    arrays.update({f"jacobian.{name}": np.asarray(value) for name, value in state.jacobian._asdict().items()})
    return arrays


def _radau_state_from_arrays(arrays: dict[str, np.ndarray], batch: int, size: int, slots: int, large: bool) -> stiff.RadauState:
    """The loop state back from ``_radau_state_to_arrays`` (its interrupted members are still running in it)."""
    if "jacobian.ahead" not in arrays and "jacobian.V_inv" in arrays:  # saved before eigensystems carried it
        basis = np.swapaxes(arrays["jacobian.V_inv"], 1, 2)  # its own subspace stands in for the next one
        lagged = large and basis.shape[2] < size
        arrays = {**arrays, "jacobian.ahead": basis if lagged else basis[:, :, :0]}
    try:
        jacobian = stiff.Eigensystem(*(jnp.asarray(arrays[f"jacobian.{name}"]) for name in stiff.Eigensystem._fields))
        fields = {name: jnp.asarray(arrays[name]) for name in stiff.RadauState._fields if name != "jacobian"}
    except KeyError as error:
        raise ValueError(f"the saved JaxRadau state lacks the array {error.args[0]!r}") from None
    saved = fields["saved"]
    if saved.ndim == 3 and saved.shape[1] < slots:
        # saved with a smaller buffer (an earlier version's): the written rows are kept, the rest are padding
        fields["saved"] = jnp.concatenate([saved, jnp.zeros((saved.shape[0], slots - saved.shape[1], *saved.shape[2:]))], axis=1)
    if fields["y"].shape != (batch, size) or fields["saved"].shape != (batch, slots, size):
        raise ValueError(f"the saved JaxRadau state is for {fields['y'].shape} parameters and "
                         f"{fields['saved'].shape[1]} save slots, not ({batch}, {size}) and {slots}")
    return stiff.RadauState(jacobian=jacobian, **fields)


# ---------------------------------------------------------------------------------------------
# JaxBDF: the compiled matrix-free BDF loop, one flow


_BDF_COMPILED: dict[tuple, bdf.BdfFunctions] = {}  # by flow structure, save slots and J·v route


@dataclass
class BdfIntegration(Integration):
    functions: Any = None
    loss: Any = None
    state: Any = None  # bdf.BdfState
    times_device: Any = None
    chunk: int = RADAU_FIRST_CHUNK
    solve_started: float = 0.0


@dataclass(frozen=True)
class JaxBDF(Method):
    """Variable-order BDF compiled end to end in JAX, its Newton systems solved by GMRES on J·v products
    (``flowsim.solve.bdf``): nothing of size n² is held, so it suits the largest flows. ``jacobian_products``:
    ``"difference"`` (one field evaluation a product) or ``"exact"`` (``jax.linearize``), ``bdf.JACOBIAN_PRODUCTS``."""

    jacobian_products: str = "difference"
    name = "JaxBDF"

    def __post_init__(self) -> None:
        if self.jacobian_products not in bdf.JACOBIAN_PRODUCTS:
            expected = " or ".join(repr(route) for route in bdf.JACOBIAN_PRODUCTS)
            raise ValueError(f"JaxBDF's jacobian_products must be {expected}, got {self.jacobian_products!r}")

    def check_saved_state(self, arrays: dict[str, np.ndarray], problem: Problem) -> bdf.BdfState:
        """A saved loop state (``FlowResult.solver_state``) for this problem, or a ValueError naming what is wrong."""
        size = problem.flow.size
        try:
            fields = {name: np.asarray(arrays[name]) for name in bdf.BdfState._fields}
        except KeyError as error:
            raise ValueError(f"the saved JaxBDF state lacks the array {error.args[0]!r}") from None
        slots, written = _save_slots(len(problem.times), size), fields["saved"]
        if fields["D"].shape != (bdf.ROWS, size) or written.ndim != 2 or written.shape[1] != size or len(written) > slots:
            raise ValueError(f"the saved JaxBDF state is for differences of shape {fields['D'].shape} and saved points of "
                             f"shape {written.shape}, not ({bdf.ROWS}, {size}) and at most ({slots}, {size})")
        _check_saved_time(self.name, fields["t"], problem.times)
        if not (np.all(np.isfinite(fields["D"])) and fields["h"] > 0 and 1 <= fields["order"] <= bdf.MAX_ORDER
                and 0 < fields["n_saved"] <= len(written)):
            raise ValueError("the saved JaxBDF state holds a non-finite point, a step that is not positive, an order "
                             f"outside 1..{bdf.MAX_ORDER} or a count of saved points it lacks: the file was altered")
        # only the points written are kept on disk (the trajectory holds them too); the rest of the buffer is padding
        fields["saved"] = np.concatenate([written, np.zeros((slots - len(written), size))])
        return bdf.BdfState(**{name: jnp.asarray(value) for name, value in fields.items()})

    def start(self, problem: Problem, state: bdf.BdfState | None = None) -> BdfIntegration:
        """Compile (once per structure) and start, or continue the loop ``state``."""
        flow, times = problem.flow, problem.times
        loss = flow.loop_loss
        slots = _save_slots(len(times), flow.size)
        key, compile_seconds = (flow.structure_key, slots, self.jacobian_products), 0.0
        if key not in _BDF_COMPILED:
            field_of_member = functools.partial(flow_functions.vector_field, flow.structure)
            bdf_problem = bdf.BdfProblem(field_of_member, flow.rates.kinks, self.jacobian_products)
            _BDF_COMPILED[key] = bdf.build_bdf(bdf_problem, slots, flow.size, loss)
            compile_seconds = _BDF_COMPILED[key].compile_seconds
        functions = _BDF_COMPILED[key]
        times_device = padded_save_times(times, slots)
        solve_started = time.perf_counter()
        if state is None:
            state = functions.init(jnp.asarray(problem.thetas0[0]), loss, times_device, times[-1], problem.rtol, problem.atol)
        return BdfIntegration(problem, float(state.t), compile_seconds=compile_seconds, functions=functions, loss=loss,
                              state=state, times_device=times_device, chunk=first_chunk(problem), solve_started=solve_started)

    def advance(self, run: BdfIntegration) -> None:
        problem, t_end = run.problem, run.problem.times[-1]
        chunk_started = time.perf_counter()
        run.state = run.functions.advance(run.state, run.loss, run.times_device, t_end, t_end, problem.rtol, problem.atol,
                                          attempt_limit(problem), np.int32(run.chunk))
        run.chunk = next_chunk(run.chunk, time.perf_counter() - chunk_started)
        run.t = float(run.state.t)
        if int(run.state.status) != Status.RUNNING:
            run.status = Status.FINISHED  # the flow's own status is in its result

    def interrupt(self, run: BdfIntegration) -> None:
        run.status = Status.INTERRUPTED

    def results(self, run: BdfIntegration) -> list[FlowResult]:
        problem, state = run.problem, jax.device_get(run.state)
        status = Status(int(state.status))
        if run.status == Status.INTERRUPTED and status == Status.RUNNING:
            status = Status.INTERRUPTED
        message = status.message(at_time(float(state.t)), max_steps=problem.max_steps, method=self.name,
                                 reason="the step size fell below its floor")
        n_saved = int(state.n_saved)
        stats = SolverStats(n_steps=int(state.n_steps), n_rejected=int(state.n_rejected), nfev=int(state.nfev),
                            njev=int(state.n_products), nlu=0, wall_time_s=time.perf_counter() - problem.started,
                            compile_seconds=run.compile_seconds, solve_seconds=time.perf_counter() - run.solve_started)
        result = flow_result(problem.flow, self.name, status, message, state.t, problem.times[:n_saved], state.saved[:n_saved], stats)
        if status == Status.INTERRUPTED:
            arrays = {name: np.asarray(value) for name, value in state._asdict().items()}
            result = dataclasses.replace(result, solver_state={**arrays, "saved": arrays["saved"][:n_saved]})
        return [result]
