"""Run configuration: one schema of TOML sections, ``--set key=value`` overrides, validation.

The schema declares every key's type, default, range and choices (pydantic, strict: no
silent conversion of "3" to 3); ``flowsim run``, ``flowsim sweep`` and the bridge
(``flowsim.bridge.config``, which adds its own sections) share it. Objects are built from
a configuration beside the objects themselves (``MarkovChain.from_config``,
``models.model_from_config``, ``RateSchedule.from_config``, ...), not here.

The default is the paper run: π = (0.75, 0.19, 0.05, 0.01), λ = 0.5, m = k = 8,
ε = 1e-3, mean-field loss, t up to 6000 with linear plus log-spaced save times.
Every error is a ``ConfigError`` whose message is one line naming the bad key and value.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence, TypeVar

import numpy as np
import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from flowsim.methods import DEFAULT_METHOD, METHODS, default_rtol


class ConfigError(ValueError):
    """A bad configuration: the message names the key, the value and what was expected."""


# The choices of the objects' options, spelled once: the schema validates against them and
# the objects check themselves against them (``typing.get_args``).
StartLaw = Literal["stationary", "uniform"]
LogitScale = Literal["one", "inv_sqrt_k"]
FFNKind = Literal["none", "mlp", "glu"]
LossKind = Literal["mean_field", "finite", "monte_carlo"]
SmoothingVariant = Literal["standard", "norm_preserving"]


Positive = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(ge=1)]


class Section(BaseModel):
    """A TOML table: unknown keys are errors, types are strict, numbers finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ChainConfig(Section):
    pi: list[float] | None = [0.75, 0.19, 0.05, 0.01]
    lam: float | None = 0.5
    P: list[list[float]] | None = None
    start: StartLaw = "stationary"

    @model_validator(mode="before")
    @classmethod
    def _matrix_replaces_the_family(cls, data: Any) -> Any:
        """A transition matrix replaces the paper family unless pi/lam are given alongside."""
        if isinstance(data, dict) and "P" in data:
            data = {"pi": None, "lam": None, **data}
        return data


class TaskConfig(Section):
    """The data: a Markov chain ([chain], the default) or a sequence task (flowsim.tasks)."""

    kind: Literal["markov", "induction"] = "markov"
    d: Annotated[int, Field(ge=2)] = 3  # induction: tokens
    s: Annotated[int, Field(ge=2)] = 6  # induction: context length (the model's positions)
    noise: Annotated[float, Field(ge=0, lt=1)] = 0.1  # induction: chance of a uniform next token


class ModelConfig(Section):
    kind: Literal["one_layer", "two_layer"] = "one_layer"
    m: PositiveInt = 8
    k: PositiveInt = 8
    value_matrix: bool = False  # one_layer options
    residual: bool = False
    logit_scale: LogitScale = "one"
    ffn: FFNKind = "none"  # two_layer
    ffn_width: PositiveInt = 16


class InitConfig(Section):
    eps: Annotated[float, Field(gt=0, le=1e3)] = 1e-3  # the initial scale; far above 1 the flow starts saturated
    seed: Annotated[int, Field(ge=0)] = 0
    file: str | None = None  # an .npz with W0, W_Q, W_K, W1 (and W_V) to start from instead


class LossConfig(Section):
    kind: LossKind = "mean_field"
    s: PositiveInt = 64  # context length for finite and monte_carlo
    mc_samples: Annotated[int, Field(ge=2)] = 4096
    mc_seed: int = 0


class FlowConfig(Section):
    rates: dict[str, Annotated[float, Field(ge=0)]] = {}  # constant multiplier per group, default 1
    qk_rho: Positive = 1.0  # Q/K slow window: multiplier rho until qk_t0, linear ramp to 1 by qk_t0 + qk_tr
    qk_t0: Annotated[float, Field(ge=0)] = 0.0
    qk_tr: Annotated[float, Field(ge=0)] = 0.0
    qk_groups: list[str] | None = None  # default: the model's (upper-layer) query and key
    smoothing_a: Annotated[float, Field(ge=0, le=0.5)] = 0.0  # depth smoothing across blocks (two_layer); S is PSD for a <= 1/2
    smoothing_variant: SmoothingVariant = "standard"


class SolverConfig(Section):
    method: Literal[METHODS] = DEFAULT_METHOD  # type: ignore[valid-type]
    # None: the method's default (flowsim.methods.default_rtol); below 1e-14 (about 100 machine epsilons) no step meets it
    rtol: Annotated[float, Field(ge=1e-14)] | None = None
    atol: Positive = 1e-12
    max_steps: PositiveInt = 200_000
    lr: Positive = 0.1  # step of gradient_descent

    @model_validator(mode="after")
    def _default_rtol(self) -> "SolverConfig":
        if self.rtol is None:
            self.rtol = default_rtol(self.method)
        return self


class TimeConfig(Section):
    t_end: Positive = 6000.0
    n_linear: Annotated[int, Field(ge=2)] = 301
    n_log: Annotated[int, Field(ge=0)] = 200
    t_log_min: Positive = 0.1

    @model_validator(mode="after")
    def _log_grid_inside(self) -> "TimeConfig":
        if not self.t_log_min < self.t_end:
            raise ValueError(f"time.t_log_min = {self.t_log_min!r} is invalid: it must be below time.t_end = {self.t_end!r}")
        return self

    def save_times(self) -> np.ndarray:
        """0, a linear grid to t_end, and a log-spaced grid from t_log_min to t_end, merged."""
        linear = np.linspace(0.0, self.t_end, self.n_linear)
        logarithmic = np.geomspace(self.t_log_min, self.t_end, self.n_log) if self.n_log > 0 else np.zeros(0)
        return np.unique(np.concatenate([[0.0], linear, logarithmic, [self.t_end]]))


class Sections(Section):
    """A configuration made of sections."""

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as nested dicts (keys with value None left out)."""
        return self.model_dump(exclude_none=True)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


class RunConfig(Sections):
    task: TaskConfig = TaskConfig()
    chain: ChainConfig = ChainConfig()
    model: ModelConfig = ModelConfig()
    init: InitConfig = InitConfig()
    loss: LossConfig = LossConfig()
    flow: FlowConfig = FlowConfig()
    solver: SolverConfig = SolverConfig()
    time: TimeConfig = TimeConfig()

    def save_times(self) -> np.ndarray:
        return self.time.save_times()


# ---------------------------------------------------------------------------------
# Reading: TOML file + overrides -> validated schema, every error one line


def _key(location: tuple) -> str:
    """('chain', 'P', 0, 1) -> 'chain.P[0][1]'."""
    key = ""
    for part in location:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key


TYPE_NAMES = {"float_type": "float or int", "int_type": "int", "bool_type": "bool", "string_type": "str",
              "list_type": "list", "dict_type": "table", "model_type": "table", "model_attributes_type": "table"}


def _one_line(error: ValidationError, schema: type[Sections]) -> str:
    """The first error of a validation, in flowsim's one-line form."""
    first = error.errors()[0]
    kind, location, value = first["type"], first["loc"], first.get("input")
    key = _key(location)
    if kind == "extra_forbidden":
        if len(location) == 1:
            return f"unknown config section {location[0]!r}; expected one of {sorted(schema.model_fields)}"
        section = schema.model_fields[location[0]].annotation
        return f"unknown config key {key}; known keys in [{location[0]}]: {', '.join(sorted(section.model_fields))}"
    if kind in TYPE_NAMES:
        return f"{key} = {value!r} has type {type(value).__name__}, expected {TYPE_NAMES[kind]}"
    if kind == "value_error":  # a cross-key check: its message is already the whole line
        return str(first["ctx"]["error"])
    message = first["msg"]
    return f"{key} = {value!r} is invalid: {message[0].lower()}{message[1:]}"


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


Schema = TypeVar("Schema", bound=Sections)


def resolve_config(user: dict, schema: type[Schema] = RunConfig) -> Schema:
    """Validate a nested dict against ``schema`` and fill in defaults."""
    try:
        return schema.model_validate(user)
    except ValidationError as error:
        raise ConfigError(_one_line(error, schema)) from None


def shipped_config(name: str) -> Path:
    """A config shipped with flowsim, e.g. ``shipped_config("two_layer/baseline.toml")``
    (package data, so it is found after any kind of install, from any directory)."""
    return Path(str(resources.files("flowsim").joinpath("configs", *Path(name).parts)))


def find_config(path: Path | str) -> Path:
    """``path`` itself if it is a file, else a shipped config of that name: ``configs/NAME``
    (as the README writes it) or ``NAME``, relative to the shipped folder."""
    path = Path(path)
    if path.is_file() or path.is_absolute():
        return path
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    shipped = shipped_config(str(Path(*parts))) if parts else path
    return shipped if shipped.is_file() else path


def load_config(path: Path | str | None = None, overrides: Sequence[str] = (), schema: type[Schema] = RunConfig) -> Schema:
    """Read a TOML file (or start from the defaults) and apply ``section.key=value`` overrides.
    A relative path that is not a file here names a shipped config (``find_config``)."""
    user: dict = {}
    if path is not None:
        path = find_config(path)
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a folder; expected a TOML file")
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            user = tomllib.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {error.object[error.start]:#04x} "
                              f"at offset {error.start}); TOML files are UTF-8") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {error}") from None
    return resolve_config(_merge_overrides(user, overrides), schema)
