"""Model families: one row per kind of model, read wherever the run layer treats kinds differently.

A row names the model classes of its kind, whether the one-layer stage detectors read its observables, and what
its summary plot draws. Every run's observables carry their kind (the constant ``model_kind``), so a run
directory says what it holds; observables saved before the constant existed are classified by their columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowsim.models import OneLayerTransformer, PositionalTwoLayerTransformer, TwoLayerTransformer

KIND_CONSTANT = "model_kind"


@dataclass(frozen=True)
class ModelFamily:
    kind: str  # model.kind in configurations
    model_types: tuple[type, ...]
    stage_detectors_apply: bool  # the stage detectors (flowsim.stages) read its observables
    embedding: str  # the matrix whose singular values its summary plot shows
    entropy: str  # the attention-entropy column its summary plot shows per query
    lower_entropy: str | None = None  # a second layer's entropy, drawn dashed beside it


FAMILIES: dict[str, ModelFamily] = {
    "one_layer": ModelFamily("one_layer", (OneLayerTransformer,), True, "W0", "attention_entropy"),
    "two_layer": ModelFamily("two_layer", (TwoLayerTransformer, PositionalTwoLayerTransformer), False, "W_E",
                             "attention_entropy_2", lower_entropy="attention_entropy_1"),
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


def family_of_observables(constants: dict, columns: set[str] | dict) -> ModelFamily | None:
    """The family observables were computed for: their ``model_kind`` constant, or, for observables saved before
    it was recorded, their columns (the two-layer model's embedding is W_E). None: a kind flowsim does not know."""
    if KIND_CONSTANT in constants:
        return FAMILIES.get(str(constants[KIND_CONSTANT]))
    return FAMILIES["two_layer"] if "sv_W_E" in columns else FAMILIES["one_layer"] if "sv_W0" in columns else None
