"""Configuration of a bridge training run: TOML sections, validated like flowsim's.

    [chain]    the Markov chain when data.kind = "markov" (flowsim's [chain] keys)
    [data]     kind (markov | wikitext2 | tinystories), data_dir, source, vocab_size, s, batch_size, seed
    [model]    kind (one_layer | two_layer | gpt), the paper models' m, k, options and init_eps;
               the GPT family's n_layer, d_model, n_head, ffn, norm, bias, ffn_mult
    [optim]    name (sgd | adamw), lr, steps, momentum, weight_decay; the upper-Q/K schedule
               qk_rho (1: off), qk_hold, qk_ramp (fractions of the steps); Window Smoothing
               smoothing_a (0: off), smoothing_variant
    [log]      n_checkpoints (log-spaced steps), val_batches, probe_per_type, fold_d
    [compare]  method (default: Tsit5 on Markov data, LSODA on text), rtol, atol of the ODE beside the run
    device     under [data]: auto | cpu | cuda
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flowsim.config import CHAIN_NULLABLE, ChainConfig, ConfigError, Sections, build_chain, load_config, raise_first_failed
from flowsim.models import OneLayerTransformer, TwoLayerTransformer

DATA_KINDS = ("markov", "wikitext2", "tinystories")
MODEL_KINDS = ("one_layer", "two_layer", "gpt")


@dataclass
class DataConfig:
    kind: str = "markov"
    data_dir: str | None = None  # default: $FLOWSIM_DATA_DIR or shared/data beside the repository
    source: str = "files"  # or "datasets_disk": a folder written by datasets' save_to_disk
    vocab_size: int = 2000  # text: top-V words plus <unk>
    s: int = 64  # context length
    batch_size: int = 1024
    seed: int = 0
    device: str = "auto"


@dataclass
class BridgeModelConfig:
    kind: str = "one_layer"
    m: int = 8
    k: int = 8
    value_matrix: bool = False
    residual: bool = False
    logit_scale: str = "one"
    ffn: str = "mlp"  # two_layer: none | mlp | glu; gpt: mlp | glu
    ffn_width: int = 16
    init_eps: float = 1e-3  # paper models: flowsim's N(0, eps^2) init with data.seed
    n_layer: int = 4
    d_model: int = 64
    n_head: int = 4
    norm: str | None = None  # gpt: layernorm | rmsnorm | none (default by ffn)
    bias: bool | None = None  # gpt: default by ffn
    ffn_mult: int = 4
    dtype: str | None = None  # float64 (paper models' default) | float32 (gpt's default)


@dataclass
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.1
    steps: int = 1000
    momentum: float = 0.0
    weight_decay: float = 0.0
    qk_rho: float = 1.0
    qk_hold: float = 0.04
    qk_ramp: float = 0.01
    smoothing_a: float = 0.0
    smoothing_variant: str = "standard"


@dataclass
class LogConfig:
    n_checkpoints: int = 60
    val_batches: int = 4
    probe_per_type: int = 64
    fold_d: int = 8  # text: the top-d tokens are tracked, the rest folded into "other"
    track: list[str] = field(default_factory=list)  # text: further words tracked on their own (e.g. a mid-frequency one)


@dataclass
class CompareConfig:
    # default: Tsit5 for the finite-s loss of Markov runs (its exact Hessian costs hundreds of
    # gradients, so stiff solvers are slow there), LSODA for the mean-field surrogate of text runs
    method: str | None = None
    rtol: float = 1e-7
    atol: float = 1e-10


@dataclass
class BridgeConfig(Sections):
    chain: ChainConfig = field(default_factory=ChainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: BridgeModelConfig = field(default_factory=BridgeModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)

    nullable = CHAIN_NULLABLE | {("data", "data_dir"), ("model", "norm"), ("model", "bias"), ("model", "dtype"),
                                 ("compare", "method")}

    def validate(self) -> None:
        checks = [
            (self.data.kind in DATA_KINDS, "data.kind", self.data.kind, " | ".join(DATA_KINDS)),
            (self.data.device in ("auto", "cpu", "cuda"), "data.device", self.data.device, "auto | cpu | cuda"),
            (self.data.s >= 1, "data.s", self.data.s, "a positive integer"),
            (self.data.batch_size >= 1, "data.batch_size", self.data.batch_size, "a positive integer"),
            (self.model.kind in MODEL_KINDS, "model.kind", self.model.kind, " | ".join(MODEL_KINDS)),
            (self.model.init_eps > 0, "model.init_eps", self.model.init_eps, "a positive number"),
            (self.model.dtype in (None, "float32", "float64"), "model.dtype", self.model.dtype, "float32 | float64"),
            (self.optim.name in ("sgd", "adamw"), "optim.name", self.optim.name, "sgd | adamw"),
            (self.optim.lr > 0, "optim.lr", self.optim.lr, "a positive number"),
            (self.optim.steps >= 1, "optim.steps", self.optim.steps, "a positive integer"),
            (self.optim.qk_rho > 0, "optim.qk_rho", self.optim.qk_rho, "a positive number"),
            (0 <= self.optim.smoothing_a <= 0.5, "optim.smoothing_a", self.optim.smoothing_a, "a number in [0, 1/2]"),
            (self.log.n_checkpoints >= 3, "log.n_checkpoints", self.log.n_checkpoints, "an integer >= 3"),
            (self.log.probe_per_type >= 1, "log.probe_per_type", self.log.probe_per_type, "a positive integer"),
        ]
        raise_first_failed(checks)
        if self.optim.smoothing_a > 0 and self.model.kind == "one_layer":
            raise ConfigError("optim.smoothing_a > 0 needs repeated blocks (model.kind = 'two_layer' or 'gpt')")

    @property
    def dtype(self) -> str:
        return self.model.dtype or ("float32" if self.model.kind == "gpt" else "float64")

    def checkpoint_steps(self) -> np.ndarray:
        """Log-spaced steps from 0 to optim.steps (0 and the last included)."""
        steps = np.geomspace(1, self.optim.steps, self.log.n_checkpoints - 1).round().astype(int)
        return np.unique(np.concatenate([[0], steps, [self.optim.steps]]))

    def build_chain(self):
        return build_chain(self.chain)

    def flowsim_spec(self, d: int):
        """The flowsim model of a paper-model run over d token types."""
        try:
            if self.model.kind == "one_layer":
                return OneLayerTransformer(d=d, m=self.model.m, k=self.model.k, value_matrix=self.model.value_matrix,
                                           residual=self.model.residual, logit_scale=self.model.logit_scale)
            return TwoLayerTransformer(d=d, m=self.model.m, k=self.model.k, ffn=self.model.ffn, ffn_width=self.model.ffn_width)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def load_bridge_config(path=None, overrides=()) -> BridgeConfig:
    return load_config(path, overrides, schema=BridgeConfig)
