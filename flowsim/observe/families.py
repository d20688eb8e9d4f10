"""Model families: one row per kind of model, read wherever the run layer treats kinds differently.

A row names the model classes of its kind, how its observables are computed, whether the one-layer stage
detectors read them, which columns its sweep rows add to sweep.csv and to the printed summary, and what its
summary plot draws. ``compute_observables`` dispatches on that row and stamps the kind on the observables
(the constant ``model_kind``), so a run directory says what it holds; observables saved before the constant
existed are classified by their columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from flowsim.model.flow import GradientFlow
from flowsim.model.models import Model, OneLayerTransformer, PositionalTwoLayerTransformer, TwoLayerTransformer
from flowsim.observe.observables import Observables, one_layer_observables, positional_observables, two_layer_observables
from flowsim.observe.stages import EVENT_STAGES
from flowsim.model.tasks import SequenceLaw
from flowsim.solve.trajectory import Trajectory

KIND_CONSTANT = "model_kind"

# observables(trajectory, model, pi, flow, law, fold_d): a sequence task's models read ``law``, the others ``pi``;
# ``fold_d`` (observables.fold_d) is how many types a large vocabulary's kept attention keeps apart
ObservablesFunction = Callable[[Trajectory, Model, np.ndarray, "GradientFlow | None", "SequenceLaw | None", "int | None"],
                               Observables]


@dataclass(frozen=True)
class ModelFamily:
    kind: str  # model.kind in configurations
    model_types: tuple[type, ...]
    observables: ObservablesFunction
    stage_detectors_apply: bool  # the stage detectors (flowsim.observe.stages) read its observables
    embedding: str  # the matrix whose singular values its summary plot shows
    entropy: str  # the attention-entropy column its summary plot shows per query
    lower_entropy: str | None = None  # a second layer's entropy, drawn dashed beside it
    # sweep.csv's columns for its rows, and the printed summary's (functions: a registered stage adds its own)
    table_columns: Callable[[], tuple[str, ...]] = field(default=lambda: ())
    summary_columns: Callable[[], tuple[str, ...]] = field(default=lambda: ())


def _two_layer_observables(trajectory: Trajectory, model: Model, pi: np.ndarray, flow: GradientFlow | None,
                           law: SequenceLaw | None, fold_d: int | None = None) -> Observables:
    """Its attention is kept whole (``fold_d`` is not read): the two-layer studies are small vocabularies, and the
    memory budget refuses a large one before the run (``assemble.check_run_size``)."""
    if isinstance(model, PositionalTwoLayerTransformer):  # the model over positions reads a sequence task
        if law is None:
            raise ValueError("the observables of the positional model average over a task's contexts: pass law=task.law")
        return positional_observables(trajectory, model, law, flow)
    return two_layer_observables(trajectory, model, pi, flow)


FAMILIES: dict[str, ModelFamily] = {
    "one_layer": ModelFamily(
        "one_layer", (OneLayerTransformer,),
        lambda trajectory, model, pi, flow, law, fold_d=None: one_layer_observables(trajectory, model, pi, flow, fold_d),
        True, "W0", "attention_entropy",
        table_columns=lambda: (*(f"onset_{stage.name}" for stage in EVENT_STAGES), "end_condensation", "cycles"),
        summary_columns=lambda: tuple(stage.column for stage in EVENT_STAGES)),
    "two_layer": ModelFamily(
        "two_layer", (TwoLayerTransformer, PositionalTwoLayerTransformer), _two_layer_observables, False, "W_E",
        "attention_entropy_2", lower_entropy="attention_entropy_1",
        table_columns=lambda: ("t_basis_mature", "premature_index", "t_basis_final", "premature_index_final",
                               "t_upper_specialised", "basis_turn_at_specialisation", "bayes_loss"),
        summary_columns=lambda: ("t_basis_mature", "t_upper_specialised", "bayes_loss")),
}


def register_family(family: ModelFamily) -> None:
    """Add a kind of model (docs/extending.md); a shipped kind cannot be replaced."""
    if family.kind in FAMILIES:
        raise ValueError(f"a model family {family.kind!r} exists already")
    FAMILIES[family.kind] = family


def family_of(model: object) -> ModelFamily:
    """The family of a model object."""
    for family in FAMILIES.values():
        if isinstance(model, family.model_types):
            return family
    raise ValueError(f"{type(model).__name__} belongs to no model family; known: {sorted(FAMILIES)}")


def compute_observables(trajectory: Trajectory, model: Model, pi: np.ndarray, flow: GradientFlow | None = None,
                        law: SequenceLaw | None = None, fold_d: int | None = None) -> Observables:
    """All observables of a trajectory, by its model's family (``flowsim.observe.observables`` lists them), on a chain with
    frequencies ``pi`` or, for a sequence task, its exact law of contexts ``law``; gradient norms when ``flow`` is
    given; the attention kept over ``fold_d`` types and "other" (``observables.fold_d``; None: the family's
    default). The family's kind is recorded among the constants."""
    family = family_of(model)
    observables = family.observables(trajectory, model, pi, flow, law, fold_d)
    return Observables(observables.t, observables.columns, {**observables.constants, KIND_CONSTANT: np.asarray(family.kind)})


def family_of_observables(constants: dict, columns: set[str] | dict) -> ModelFamily | None:
    """The family observables were computed for: their ``model_kind`` constant, or, for observables saved before
    it was recorded, their columns (the two-layer model's embedding is W_E). None: a kind flowsim does not know."""
    if KIND_CONSTANT in constants:
        return FAMILIES.get(str(constants[KIND_CONSTANT]))
    return FAMILIES["two_layer"] if "sv_W_E" in columns else FAMILIES["one_layer"] if "sv_W0" in columns else None
