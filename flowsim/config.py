"""Run configuration: TOML sections with defaults, ``--set key=value`` overrides, validation.

The default is the paper run: π = (0.75, 0.19, 0.05, 0.01), λ = 0.5, m = k = 8,
ε = 1e-3, mean-field loss, t up to 6000 with linear plus log-spaced save times.
Every error is a ``ConfigError`` whose message is one line naming the bad key and value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import tomli_w

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from flowsim.chains import MarkovChain
from flowsim.flow import DepthSmoothing, RateSchedule, SlowWindow
from flowsim.losses import LOSS_KINDS
from flowsim.models import Model, OneLayerTransformer, TwoLayerTransformer
from flowsim.solvers import DEFAULT_METHOD, METHODS, default_rtol


class ConfigError(ValueError):
    """A bad configuration: the message names the key, the value and what was expected."""


CHAIN_NULLABLE = {("chain", "pi"), ("chain", "lam"), ("chain", "P")}  # keys a schema may leave unset: its ``nullable``


@dataclass
class ChainConfig:
    pi: list[float] | None = field(default_factory=lambda: [0.75, 0.19, 0.05, 0.01])
    lam: float | None = 0.5
    P: list[list[float]] | None = None
    start: str = "stationary"


@dataclass
class ModelConfig:
    kind: str = "one_layer"  # or "two_layer" (the hierarchical model)
    m: int = 8
    k: int = 8
    value_matrix: bool = False  # one_layer options
    residual: bool = False
    logit_scale: str = "one"
    ffn: str = "none"  # two_layer: none | mlp | glu
    ffn_width: int = 16


@dataclass
class InitConfig:
    eps: float = 1e-3
    seed: int = 0
    file: str | None = None  # an .npz with W0, W_Q, W_K, W1 (and W_V) to start from instead


@dataclass
class LossConfig:
    kind: str = "mean_field"
    s: int = 64  # context length for finite and monte_carlo
    mc_samples: int = 4096
    mc_seed: int = 0


@dataclass
class FlowConfig:
    rates: dict[str, float] = field(default_factory=dict)  # constant multiplier per group, default 1
    qk_rho: float = 1.0  # Q/K slow window: multiplier rho until qk_t0, linear ramp to 1 by qk_t0 + qk_tr
    qk_t0: float = 0.0
    qk_tr: float = 0.0
    qk_groups: list[str] | None = None  # default: the model's (upper-layer) query and key
    smoothing_a: float = 0.0  # depth smoothing of same-role tensors across blocks (two_layer), in [0, 1/2]
    smoothing_variant: str = "standard"  # or "norm_preserving"


@dataclass
class SolverConfig:
    method: str = DEFAULT_METHOD
    rtol: float | None = None  # None: the method's default (flowsim.solvers.default_rtol)
    atol: float = 1e-12
    max_steps: int = 200_000
    lr: float = 0.1  # step of gradient_descent


@dataclass
class TimeConfig:
    t_end: float = 6000.0
    n_linear: int = 301
    n_log: int = 200
    t_log_min: float = 0.1


class Sections:
    """A configuration made of TOML sections (dataclass fields that are dataclasses)."""

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as nested dicts (keys with value None left out)."""
        return {
            section.name: {k: v for k, v in dataclasses.asdict(getattr(self, section.name)).items() if v is not None}
            for section in dataclasses.fields(self)
        }

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


def build_chain(chain: ChainConfig) -> MarkovChain:
    try:
        return MarkovChain(pi=chain.pi, lam=chain.lam, P=chain.P, start=chain.start)
    except ValueError as error:
        raise ConfigError(f"chain: {error}") from None


@dataclass
class RunConfig(Sections):
    chain: ChainConfig = field(default_factory=ChainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    time: TimeConfig = field(default_factory=TimeConfig)

    nullable = CHAIN_NULLABLE | {("init", "file"), ("flow", "qk_groups"), ("solver", "rtol")}

    def validate(self) -> None:
        if self.solver.rtol is None:
            self.solver.rtol = default_rtol(self.solver.method)
        _check_ranges(self)

    # ---- building the objects the run needs

    def build_chain(self) -> MarkovChain:
        return build_chain(self.chain)

    def build_model(self, d: int) -> Model:
        if self.model.kind not in ("one_layer", "two_layer"):
            raise ConfigError(f"model.kind = {self.model.kind!r} is not available; expected 'one_layer' or 'two_layer'")
        try:
            if self.model.kind == "two_layer":
                return TwoLayerTransformer(d=d, m=self.model.m, k=self.model.k, ffn=self.model.ffn,
                                           ffn_width=self.model.ffn_width)
            return OneLayerTransformer(
                d=d, m=self.model.m, k=self.model.k, value_matrix=self.model.value_matrix,
                residual=self.model.residual, logit_scale=self.model.logit_scale,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def build_smoothing(self, model: Model) -> DepthSmoothing | None:
        if self.flow.smoothing_a == 0.0 and self.flow.smoothing_variant == "standard":
            return None
        try:
            return DepthSmoothing(self.flow.smoothing_a, model.repeated_blocks, self.flow.smoothing_variant)
        except ValueError as error:
            raise ConfigError(f"{error} (model.kind = {self.model.kind!r})") from None

    def build_rates(self, model: Model) -> RateSchedule:
        try:
            window = None
            if self.flow.qk_rho != 1.0:
                groups = model.slow_groups if self.flow.qk_groups is None else tuple(self.flow.qk_groups)
                window = SlowWindow(self.flow.qk_rho, self.flow.qk_t0, self.flow.qk_tr, groups)
            return RateSchedule(constant=dict(self.flow.rates), window=window)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def save_times(self) -> np.ndarray:
        """0, a linear grid to t_end, and a log-spaced grid from t_log_min to t_end, merged."""
        time = self.time
        linear = np.linspace(0.0, time.t_end, time.n_linear)
        logarithmic = np.geomspace(time.t_log_min, time.t_end, time.n_log) if time.n_log > 0 else np.zeros(0)
        return np.unique(np.concatenate([[0.0], linear, logarithmic, [time.t_end]]))




def _expected_type(section: str, key: str, default: Any, schema: type = RunConfig) -> tuple[type, ...]:
    if isinstance(default, bool):
        return (bool,)
    if isinstance(default, float):
        return (float, int)
    if isinstance(default, int):
        return (int,)
    annotation = {f.name: f.type for f in dataclasses.fields(type(getattr(schema(), section)))}[key]
    if "list" in str(annotation):
        return (list,)
    if "dict" in str(annotation):
        return (dict,)
    if "float" in str(annotation):
        return (float, int)
    return (str,)


def _check_value(section: str, key: str, value: Any, default: Any, schema: type = RunConfig) -> Any:
    expected = _expected_type(section, key, default, schema)
    if value is None and (section, key) in getattr(schema, "nullable", ()):
        return None
    ok = isinstance(value, expected) and not (isinstance(value, bool) and bool not in expected)
    if not ok:
        names = " or ".join(t.__name__ for t in expected)
        raise ConfigError(f"{section}.{key} = {value!r} has type {type(value).__name__}, expected {names}")
    if float in expected and isinstance(value, (int, float)):
        if not np.isfinite(value):
            raise ConfigError(f"{section}.{key} = {value!r} must be finite")
        return float(value)
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``section.key=value``; the value is a TOML literal, or a bare string."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    path = [part.strip() for part in key.strip().split(".")]
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set key {key!r} must be section.key, e.g. solver.method")
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # `--set solver.method=BDF` without quotes
    return path, value


def _merge_overrides(user: dict, overrides: Sequence[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = user
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {'.'.join(path[:-1])} is not a table")
        node[path[-1]] = value
    return user


def resolve_config(user: dict, schema: type = RunConfig):
    """Validate a nested dict against ``schema`` (a dataclass of section dataclasses, with an
    optional ``validate`` method for cross-key checks) and fill in defaults."""
    defaults = schema()
    sections = {f.name for f in dataclasses.fields(schema)}
    unknown = set(user) - sections
    if unknown:
        raise ConfigError(f"unknown config section {sorted(unknown)[0]!r}; expected one of {sorted(sections)}")
    chain_user = user.get("chain", {})
    if isinstance(chain_user, dict) and "P" in chain_user:
        # A transition matrix replaces the paper family unless pi/lam are given alongside.
        chain_user.setdefault("lam", None)
        chain_user.setdefault("pi", None)
    resolved = {}
    for name in sections:
        section_default = getattr(defaults, name)
        values = user.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"config section [{name}] must be a table, got {values!r}")
        known = {f.name for f in dataclasses.fields(section_default)}
        for key in values:
            if key not in known:
                raise ConfigError(f"unknown config key {name}.{key}; known keys in [{name}]: {', '.join(sorted(known))}")
        checked = {key: _check_value(name, key, value, getattr(section_default, key), schema) for key, value in values.items()}
        resolved[name] = dataclasses.replace(section_default, **checked)
    config = schema(**resolved)
    if hasattr(config, "validate"):
        config.validate()
    return config


def raise_first_failed(checks: Sequence[tuple[bool, str, Any, str]]) -> None:
    """Raise a ConfigError naming the key, value and expectation of the first failed (ok, key, value, expected)."""
    for ok, key, value, expected in checks:
        if not ok:
            raise ConfigError(f"{key} = {value!r} is invalid; expected {expected}")


def _check_ranges(config: RunConfig) -> None:
    checks = [
        (config.chain.start in ("stationary", "uniform"), "chain.start", config.chain.start, "'stationary' or 'uniform'"),
        (config.init.eps > 0, "init.eps", config.init.eps, "a positive number"),
        (config.loss.kind in LOSS_KINDS, "loss.kind", config.loss.kind, " | ".join(LOSS_KINDS)),
        (config.loss.s >= 1, "loss.s", config.loss.s, "a positive integer"),
        (config.solver.method in METHODS, "solver.method", config.solver.method, " | ".join(METHODS)),
        (config.solver.rtol > 0, "solver.rtol", config.solver.rtol, "a positive number"),
        (config.solver.atol > 0, "solver.atol", config.solver.atol, "a positive number"),
        (config.solver.max_steps >= 1, "solver.max_steps", config.solver.max_steps, "a positive integer"),
        (config.solver.lr > 0, "solver.lr", config.solver.lr, "a positive number"),
        (config.time.t_end > 0, "time.t_end", config.time.t_end, "a positive number"),
        (config.time.n_linear >= 2, "time.n_linear", config.time.n_linear, "an integer >= 2"),
        (config.time.n_log >= 0, "time.n_log", config.time.n_log, "an integer >= 0"),
        (0 < config.time.t_log_min < config.time.t_end, "time.t_log_min", config.time.t_log_min, "a number in (0, t_end)"),
    ]
    raise_first_failed(checks)
    if config.flow.smoothing_variant not in ("standard", "norm_preserving"):
        raise ConfigError(f"flow.smoothing_variant = {config.flow.smoothing_variant!r} is invalid; expected 'standard' or 'norm_preserving'")
    for group, rate in config.flow.rates.items():
        if not isinstance(rate, (int, float)) or isinstance(rate, bool):
            raise ConfigError(f"flow.rates.{group} = {rate!r} must be a number")


def load_config(path: Path | str | None = None, overrides: Sequence[str] = (), schema: type = RunConfig):
    """Read a TOML file (or start from the defaults) and apply ``section.key=value`` overrides."""
    user: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            user = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {error}") from None
    return resolve_config(_merge_overrides(user, overrides), schema)
