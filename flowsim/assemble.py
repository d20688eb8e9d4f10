"""A configuration assembled into the objects of one run: data (chain or task), model, loss, flow, initial point and
save times, checked against the memory budget before anything large is built. Pure: no file is written, and the
theory (``theory.predict``) assembles its runs here as the run layer does."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowsim.common.budget import check_memory
from flowsim.model.chains import MarkovChain
from flowsim.config import ConfigError, RunConfig
from flowsim.model.flow import DepthSmoothing, GradientFlow, RateSchedule
from flowsim.common.io import DamagedFileError, read_npz
from flowsim.model.losses import make_loss_function, make_task_loss
from flowsim.methods import METHOD, method_for
from flowsim.model.models import Model, Params, PositionalTwoLayerTransformer, model_from_config
from flowsim.observe.observables import FOLDED_ATTENTION_TYPES, kept_attention_types, observables_memory_bytes
from flowsim.model.tasks import InductionTask, SequenceLaw


def initial_params(config: RunConfig, model: Model) -> Params:
    """Seeded N(0, ε²) entries, or the arrays of ``init.file``."""
    if config.init.file is None:
        return model.init(config.init.eps, config.init.seed)
    path = Path(config.init.file)
    if path.is_dir():
        raise ConfigError(f"init.file {str(path)!r} is a folder; expected an .npz file")
    if not path.exists():
        raise ConfigError(f"init.file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"init.file {str(path)!r} is not a regular file (a FIFO or a device); expected an .npz file")
    try:
        arrays = read_npz(path)
    except DamagedFileError as error:
        raise ConfigError(f"init.file: {error}") from None
    params = {name: np.asarray(value, dtype=float) for name, value in arrays.items() if name in model.shapes}
    try:
        model.check_params(params)
    except ValueError as error:
        raise ConfigError(f"init.file {str(path)!r}: {error}") from None
    for name, value in params.items():
        bad = np.flatnonzero(~np.isfinite(value))
        if len(bad):
            raise ConfigError(f"init.file {str(path)!r}: {name} has {len(bad)} non-finite entries "
                              f"(first {value.ravel()[bad[0]]} at flat index {bad[0]}); expected finite numbers")
    return params


@dataclass(frozen=True)
class PreparedRun:
    """Everything a configured run needs, built and validated."""

    chain: MarkovChain | InductionTask  # the data: a Markov chain or a sequence task
    model: Model
    flow: GradientFlow
    params0: Params
    times: np.ndarray


def sequence_law(data: MarkovChain | InductionTask) -> SequenceLaw | None:
    """A sequence task's exact law of contexts (the positional observables average over it)."""
    return data.law if isinstance(data, InductionTask) else None


def task_and_model(config: RunConfig) -> tuple[InductionTask, PositionalTwoLayerTransformer]:
    """The sequence task of [task] and the two-layer model over its positions."""
    if config.model.kind != "two_layer":
        raise ConfigError(f"task.kind = {config.task.kind!r} needs model.kind = 'two_layer' (the composition it "
                          f"tests has two attention layers), got {config.model.kind!r}")
    if config.loss.kind == "mean_field":
        raise ConfigError("loss.kind = 'mean_field' does not apply to a sequence task (it has no s -> infinity "
                          "limit); expected 'finite' (exact, by enumeration) or 'monte_carlo'")
    try:
        task = InductionTask(config.task.d, config.task.s, config.task.noise)
        model = PositionalTwoLayerTransformer(d=task.d, s=task.s, m=config.model.m, k=config.model.k,
                                              ffn=config.model.ffn, ffn_width=config.model.ffn_width)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return task, model


def check_run_size(config: RunConfig) -> None:
    """Refuse (``BudgetError``, naming the keys) a run whose arrays will not fit the memory budget, before any is
    built: the chain's d x d matrices, the saved trajectory (save points x n parameters), and a dense n x n Jacobian
    for scipy's implicit methods (JaxRadau keeps a few eigenpairs: O(n) per pair)."""
    if config.task.kind == "markov":
        chain = config.chain
        d = len(chain.pi) if chain.pi is not None else len(chain.P or [])
        d_key = "len(chain.pi)" if chain.pi is not None else "len(chain.P)"
        model = model_from_config(config.model, max(d, 2))  # shapes only: nothing allocated
    else:
        d, d_key = config.task.d, "task.d"
        model = task_and_model(config)[1]
    m = config.model.m
    n = sum(int(np.prod(shape)) for shape in model.shapes.values())
    points = config.time.n_linear + config.time.n_log + 2
    check_memory(8.0 * 16 * d * d, f"a chain with d = {d} tokens ({d_key}; its d x d maps and the loss's intermediates)",
                 "use fewer tokens")
    if METHOD[method_for(config.solver.method)].needs_dense_jacobian:
        check_memory(8.0 * 4 * n * n, f"solver.method = {config.solver.method!r} on {n} parameters (dense n x n "
                                      f"Jacobian and its factorisation; model.m = {m})",
                     "use solver.method = 'auto' (JaxBDF: no dense Jacobian), or a smaller model.m")
    check_memory(8.0 * points * n, f"saving {points} points (time.n_linear + time.n_log) of {n} parameters "
                                   f"(model.m = {m}, d = {d})", "lower time.n_log or time.n_linear")
    check_observables_size(config, d, points)


def check_observables_size(config: RunConfig, d: int, points: int) -> None:
    """Refuse, before the solve, a run whose observables (``observables_memory_bytes``: the columns kept, their
    CSV text and one save's d x d working arrays) would not fit beside its trajectory: its attention kept whole
    at a large d. The two-layer models keep both layers' attention whole."""
    if config.model.kind == "one_layer":
        kept = kept_attention_types(d, config.observables.fold_d)
        fewer_saves = "save fewer times (time.n_linear, time.n_log)"
        folding_helps = kept > FOLDED_ATTENTION_TYPES + 1  # not where that fold, or a smaller one, is in effect
        check_memory(observables_memory_bytes(d, config.model.m, points, config.observables.fold_d),
                     f"the observables of {points} saves at d = {d}, their attention kept as {kept} x {kept} per save",
                     f"fold it with observables.fold_d = {FOLDED_ATTENTION_TYPES}, or {fewer_saves}" if folding_helps
                     else fewer_saves)
    else:
        check_memory(2 * points * d * d * (8.0 + 25.0), f"the two-layer observables of {points} saves at d = {d} (both "
                                                         "layers' attention kept whole)",
                     "save fewer times (time.n_linear, time.n_log)")


def prepare(config: RunConfig) -> PreparedRun:
    """Build the chain (or task), model, flow, initial point and save times, or raise ConfigError
    (``BudgetError`` for a run too large for the memory budget, ``check_run_size``)."""
    check_run_size(config)
    if config.task.kind == "markov":
        chain = MarkovChain.from_config(config.chain)
        model = model_from_config(config.model, chain.d)
    else:
        chain, model = task_and_model(config)
    params0 = initial_params(config, model)
    rates = RateSchedule.from_config(config.flow, model.slow_groups)
    smoothing = DepthSmoothing.from_config(config.flow, model.repeated_blocks, config.model.kind)
    try:
        if isinstance(chain, InductionTask):
            loss = make_task_loss(model, chain, config.loss.kind, config.loss.mc_samples, config.loss.mc_seed)
        else:
            loss = make_loss_function(model, chain, config.loss.kind, config.loss.s, config.loss.mc_samples, config.loss.mc_seed,
                                      kept_types=config.loss.kept_types)
        flow = GradientFlow(loss, params0, rates, smoothing)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.init.file is None and config.solver.atol > 1e-2 * config.init.eps**2:
        warnings.warn(
            f"solver.atol = {config.solver.atol:g} is not well below init.eps^2 = {config.init.eps**2:g}: "
            "the early, small-scale dynamics will be resolved poorly",
            stacklevel=2,
        )
    return PreparedRun(chain, model, flow, params0, config.save_times())


def model_description(config: RunConfig) -> str:
    """The model in words, for figure titles: "two-layer Transformer (m = 8, k = 8, ffn = mlp)"."""
    model = config.model
    name = {"one_layer": "one-layer", "two_layer": "two-layer"}.get(model.kind, model.kind)
    if config.task.kind == "induction":
        name = "positional two-layer"
    ffn = f", ffn = {model.ffn}" if model.kind == "two_layer" and model.ffn != "none" else ""
    return f"{name} Transformer (m = {model.m}, k = {model.k}{ffn}), {config.loss.kind.replace('_', '-')} loss"


def bayes_loss(config: RunConfig, data: MarkovChain | InductionTask) -> float | None:
    """The least loss any predictor reaches, where the data law gives it exactly: an induction task's, or a
    chain's entropy rate for the mean-field loss and the finite-s losses from the stationary start."""
    if isinstance(data, InductionTask):
        return data.bayes_loss
    if config.loss.kind == "mean_field" or data.start == "stationary":
        return data.entropy_rate
    return None
