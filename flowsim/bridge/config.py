"""Configuration of a bridge training run: TOML sections, validated like flowsim's.

    [chain]    the Markov chain when data.kind = "markov" (flowsim's [chain] keys)
    [data]     kind (markov | wikitext2 | tinystories), data_dir, source, vocab_size, s, batch_size, seed
    [model]    kind (one_layer | two_layer | gpt), the paper models' m, k, options and init_eps;
               the GPT family's n_layer, d_model, n_head, ffn, norm, bias, ffn_mult
    [optim]    name (sgd | adamw), lr, steps, momentum, weight_decay; the upper-Q/K schedule
               qk_rho (1: off), qk_hold, qk_ramp (fractions of the steps); Window Smoothing
               smoothing_a (0: off), smoothing_variant
    [log]      n_checkpoints (log-spaced steps), val_batches, probe_per_type, fold_d
    [compare]  method (default: Tsit5 on Markov data, JaxRadau on text), rtol, atol, smoothing of the ODE beside the run
    device     under [data]: auto | cpu | cuda
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field, model_validator

from flowsim.config import (
    ChainConfig,
    FFNKind,
    ModelConfig,
    Positive,
    PositiveInt,
    Section,
    Sections,
    SmoothingVariant,
    load_config,
)
from flowsim.methods import METHODS

DATA_KINDS = ("markov", "wikitext2", "tinystories")
MODEL_KINDS = ("one_layer", "two_layer", "gpt")
Fraction = Annotated[float, Field(ge=0, le=1)]


class DataConfig(Section):
    kind: Literal[DATA_KINDS] = "markov"  # type: ignore[valid-type]
    data_dir: str | None = None  # default: $FLOWSIM_DATA_DIR or shared/data beside the repository
    source: Literal["files", "datasets_disk"] = "files"  # datasets_disk: a folder written by datasets' save_to_disk
    vocab_size: PositiveInt = 2000  # text: top-V words plus <unk>
    s: PositiveInt = 64  # context length
    batch_size: PositiveInt = 1024
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"


class BridgeModelConfig(ModelConfig):
    """flowsim's model keys (the paper models), plus the GPT family's."""

    kind: Literal[MODEL_KINDS] = "one_layer"  # type: ignore[valid-type]
    ffn: FFNKind = "mlp"  # two_layer: none | mlp | glu; gpt: mlp | glu
    init_eps: Positive = 1e-3  # paper models: flowsim's N(0, eps^2) init with data.seed
    n_layer: PositiveInt = 4
    d_model: PositiveInt = 64
    n_head: PositiveInt = 4
    norm: Literal["layernorm", "rmsnorm", "none"] | None = None  # gpt: default by ffn
    bias: bool | None = None  # gpt: default by ffn
    ffn_mult: PositiveInt = 4
    dtype: Literal["float32", "float64"] | None = None  # float64 (paper models' default) | float32 (gpt's default)

    def flowsim_keys(self) -> dict:
        """The keys of flowsim's [model] section (a paper-model run)."""
        return self.model_dump(include=set(ModelConfig.model_fields))


class OptimConfig(Section):
    name: Literal["sgd", "adamw"] = "sgd"
    lr: Positive = 0.1
    steps: PositiveInt = 1000
    momentum: Annotated[float, Field(ge=0)] = 0.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    qk_rho: Positive = 1.0
    qk_hold: Fraction = 0.04
    qk_ramp: Fraction = 0.01
    smoothing_a: Annotated[float, Field(ge=0, le=0.5)] = 0.0
    smoothing_variant: SmoothingVariant = "standard"


class LogConfig(Section):
    n_checkpoints: Annotated[int, Field(ge=3)] = 60
    val_batches: PositiveInt = 4
    probe_per_type: PositiveInt = 64
    fold_d: PositiveInt = 8  # text: the top-d tokens are tracked, the rest folded into "other"
    track: list[str] = []  # text: further words tracked on their own (e.g. a mid-frequency one)


class CompareConfig(Section):
    # default: Tsit5 for the finite-s loss of Markov runs (its exact Hessian costs hundreds of
    # gradients, so stiff solvers are slow there), JaxRadau for the mean-field surrogate of
    # text runs (d = vocab_size + 1: no dense Hessian fits)
    method: Literal[METHODS] | None = None  # type: ignore[valid-type]
    rtol: Positive = 1e-7
    atol: Positive = 1e-10
    smoothing: Annotated[float, Field(ge=0)] = 0.1  # text: additive smoothing of the surrogate's bigram counts


class BridgeConfig(Sections):
    chain: ChainConfig = ChainConfig()
    data: DataConfig = DataConfig()
    model: BridgeModelConfig = BridgeModelConfig()
    optim: OptimConfig = OptimConfig()
    log: LogConfig = LogConfig()
    compare: CompareConfig = CompareConfig()

    @model_validator(mode="after")
    def _smoothing_needs_blocks(self) -> "BridgeConfig":
        if self.optim.smoothing_a > 0 and self.model.kind == "one_layer":
            raise ValueError("optim.smoothing_a > 0 needs repeated blocks (model.kind = 'two_layer' or 'gpt')")
        return self

    @property
    def dtype(self) -> str:
        return self.model.dtype or ("float32" if self.model.kind == "gpt" else "float64")

    def checkpoint_steps(self) -> np.ndarray:
        """Log-spaced steps from 0 to optim.steps (0 and the last included)."""
        steps = np.geomspace(1, self.optim.steps, self.log.n_checkpoints - 1).round().astype(int)
        return np.unique(np.concatenate([[0], steps, [self.optim.steps]]))


def load_bridge_config(path=None, overrides=()) -> BridgeConfig:
    return load_config(path, overrides, schema=BridgeConfig)
