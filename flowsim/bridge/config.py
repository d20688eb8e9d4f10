"""Configuration of a bridge training run: TOML sections, validated like flowsim's.

    [chain]    the Markov chain when data.kind = "markov" (flowsim's [chain] keys)
    [data]     kind (markov | wikitext2 | tinystories | text), data_dir, train_file, valid_file, source, vocab_size, s, batch_size, seed,
               train_on (text | surrogate)
    [model]    kind (one_layer | two_layer | gpt), the paper models' m, k, options and init_eps;
               the GPT family's n_layer, d_model, n_head, ffn, norm, bias, ffn_mult
    [optim]    name (sgd | adamw), lr, steps, momentum, weight_decay; the upper-Q/K schedule
               qk_rho (1: off), qk_hold, qk_ramp (fractions of the steps); Window Smoothing
               smoothing_a (0: off), smoothing_variant
    [log]      n_checkpoints (log-spaced steps), val_batches, probe_per_type, fold_d
    [compare]  method (default: Tsit5 on Markov data, "auto" on text), rtol, atol, the text surrogate's estimator
               and loss (mean-field, or sampled at the run's s)
    device     under [data]: auto | cpu | cuda
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, ValidationInfo, field_validator, model_validator

from flowsim.config import (
    ChainConfig,
    FFNKind,
    ModelConfig,
    Positive,
    PositiveInt,
    Section,
    Sections,
    SmoothingVariant,
    key,
    load_config,
)
from flowsim.methods import check_method

DATA_KINDS = ("markov", "wikitext2", "tinystories", "text")
MODEL_KINDS = ("one_layer", "two_layer", "gpt")
Fraction = Annotated[float, Field(ge=0, le=1)]


class DataConfig(Section):
    """Where the training sequences come from."""

    kind: Literal[DATA_KINDS] = key("markov", "markov: sequences of [chain]; wikitext2 or tinystories: a local "  # type: ignore[valid-type]
                                              "corpus, word-level; text: your own corpus, data.train_file and "
                                              "data.valid_file (UTF-8; lower-cased words and punctuation marks)")
    train_file: str | None = key(None, "text: the training text file (relative to the working directory; saved absolute)")
    valid_file: str | None = key(None, "text: the validation text file (relative to the working directory; saved absolute)")
    data_dir: str | None = key(None, "folder of the corpora; default: the first of $FLOWSIM_DATA_DIR, the user data folder "
                                      "(flowsim data fetch) and shared/data beside the repository that holds them")
    source: Literal["files", "datasets_disk"] = key("files", "files: the plain-text files; datasets_disk: a folder written "
                                                             "by datasets' save_to_disk")
    vocab_size: PositiveInt = key(2000, "text: the top-V words plus <unk> (the surrogate chain has d = V + 1)")
    s: PositiveInt = key(64, "context length")
    batch_size: PositiveInt = key(1024, "sequences per step")
    seed: int = key(0, "seed of the batches and of the paper models' initial draw")
    train_on: Literal["text", "surrogate"] = key(
        "text", "text corpora: train on the text, or on sequences of its bigram surrogate chain ([compare]'s "
                "estimator, the chain of the ODE beside the run); validation and probe windows stay the text's")
    device: Literal["auto", "cpu", "cuda"] = key("auto", "torch device; auto: cuda when available")

    @field_validator("train_file", "valid_file")
    @classmethod
    def _absolute(cls, path: str | None, info: ValidationInfo) -> str | None:
        """Saved absolute, so a run resumes and compares from any working directory; an empty path is refused (it
        would name the working directory)."""
        if path is not None and not path.strip():
            raise ValueError(f"data.{info.field_name} is empty: expected the path of a UTF-8 text file")
        return None if path is None else str(Path(path).expanduser().absolute())


class BridgeModelConfig(ModelConfig):
    """flowsim's model keys (the paper models), plus the GPT family's."""

    kind: Literal[MODEL_KINDS] = key("one_layer", "the model: flowsim's one_layer or two_layer, or a GPT")  # type: ignore[valid-type]
    ffn: FFNKind = key("mlp", "two_layer: none, mlp or glu; gpt: mlp or glu")
    init_eps: Positive = key(1e-3, "paper models: flowsim's N(0, ε²) initial draw, seeded by data.seed")
    n_layer: PositiveInt = key(4, "gpt: blocks")
    d_model: PositiveInt = key(64, "gpt: width")
    n_head: PositiveInt = key(4, "gpt: attention heads")
    norm: Literal["layernorm", "rmsnorm", "none"] | None = key(None, "gpt: normalisation; default by ffn")
    bias: bool | None = key(None, "gpt: biases in linear layers; default by ffn")
    ffn_mult: PositiveInt = key(4, "gpt: the feed-forward block's width as a multiple of d_model")
    dtype: Literal["float32", "float64"] | None = key(None, "default: float64 for the paper models, float32 for gpt")

    def flowsim_keys(self) -> dict:
        """The keys of flowsim's [model] section (a paper-model run)."""
        return self.model_dump(include=set(ModelConfig.model_fields))


class OptimConfig(Section):
    """The optimiser and its schedules."""

    name: Literal["sgd", "adamw"] = key("sgd", "optimiser (sgd follows the flow at t = lr × steps)")
    lr: Positive = key(0.1, "learning rate")
    steps: PositiveInt = key(1000, "optimiser steps")
    momentum: float = key(0.0, "sgd: momentum", ge=0)
    weight_decay: float = key(0.0, "weight decay", ge=0)
    qk_rho: Positive = key(1.0, "upper-layer Q/K learning-rate multiplier during the hold (1: off)")
    qk_hold: Fraction = key(0.04, "fraction of the steps the Q/K multiplier holds")
    qk_ramp: Fraction = key(0.01, "fraction of the steps over which it ramps back to 1")
    smoothing_a: float = key(0.0, "Window Smoothing across blocks (0: off; needs two_layer or gpt)", ge=0, le=0.5)
    smoothing_variant: SmoothingVariant = key("standard", "standard or norm_preserving smoothing")


class LogConfig(Section):
    """What the run records."""

    n_checkpoints: int = key(60, "log-spaced steps at which the observables are recorded", ge=3)
    val_batches: PositiveInt = key(4, "batches of the validation loss at each checkpoint")
    probe_per_type: PositiveInt = key(64, "two_layer/gpt: probe sequences per type")
    fold_d: PositiveInt = key(8, "the top-d token types are tracked, the rest folded into 'other' (text; a Markov chain "
                                 "above 64 states or with log.track set)")
    track: list[str] = key([], "further words (text) or states (Markov, by number) tracked on their own")


class CompareConfig(Section):
    """The flow integrated beside the run by flowsim bridge compare."""

    # Tsit5 for the finite-s loss of Markov runs (its exact Hessian costs hundreds of gradients, so stiff
    # solvers are slow there), "auto" for the mean-field surrogate of text runs (JaxBDF at the real vocabulary)
    method: str | None = key(None, "default: Tsit5 on Markov data, auto (by the flow's size) on text")
    rtol: Positive = key(1e-7, "relative tolerance")
    atol: Positive = key(1e-10, "absolute tolerance")
    surrogate: Literal["interpolated", "additive"] = key(
        "interpolated", "text: the bigram estimator of the surrogate chain: 'interpolated' with the unigram law "
        "(π is the corpus's token frequencies) or 'additive' smoothing")
    unigram_weight: float | None = key(
        None, "text, interpolated: the unigram law's weight in every row (default: the weight of least "
        "cross-entropy on the validation split)", ge=0, le=1)
    smoothing: float = key(0.1, "text, additive: the pseudo-count added to every bigram count", ge=0)
    surrogate_loss: Literal["mean_field", "finite_second_order", "finite_control_variate", "sampled"] = key(
        "mean_field", "text: the surrogate chain's loss the ODE follows: 'mean_field' (s -> ∞, exact), "
        "'finite_second_order' (its loss at the run's context length s to O(1/s²), from the window composition's "
        "exact mean and covariance: no sampling, O(d³) memory), 'finite_control_variate' (that plus its remainder "
        "on compare.samples windows of the chain: unbiased) or 'sampled', its loss at s on compare.samples "
        "sequences of the chain (seeded, so each flow is deterministic)")
    samples: PositiveInt = key(32768, "text, sampled and finite_control_variate: sequences of the surrogate chain")
    kept_types: PositiveInt | None = key(None, "text, finite_second_order: keep the window covariance's Markov "
                                               "correlations among this many most frequent types only (O(d K²) memory; "
                                               "default all, d³)")


    @field_validator("method")
    @classmethod
    def _known_method(cls, name: str | None) -> str | None:
        return None if name is None else check_method(name, "compare.method")


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

    @model_validator(mode="after")
    def _text_files_with_kind_text(self) -> "BridgeConfig":
        given = self.data.train_file is not None and self.data.valid_file is not None
        if self.data.kind == "text" and not given:
            raise ValueError("data.kind = 'text' reads your own corpus: set data.train_file and data.valid_file")
        if self.data.kind != "text" and (self.data.train_file is not None or self.data.valid_file is not None):
            raise ValueError(f"data.train_file and data.valid_file are read with data.kind = 'text' only, got data.kind = "
                             f"{self.data.kind!r}")
        return self

    @model_validator(mode="after")
    def _surrogate_needs_text(self) -> "BridgeConfig":
        if self.data.train_on == "surrogate" and self.data.kind == "markov":
            raise ValueError("data.train_on = 'surrogate' needs a text corpus (data.kind = 'wikitext2', 'tinystories' or 'text'); "
                             "Markov data is its own chain")
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
