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

import types
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Sequence, TypeVar

import numpy as np
import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from flowsim.methods import DEFAULT_METHOD, METHODS, check_method, default_rtol


class ConfigError(ValueError):
    """A bad configuration: the message names the key, the value and what was expected."""


# The choices of the objects' options, spelled once: the schema validates against them and
# the objects check themselves against them (``typing.get_args``).
StartLaw = Literal["stationary", "uniform"]
LogitScale = Literal["one", "inv_sqrt_k"]
FFNKind = Literal["none", "mlp", "glu"]
LossKind = Literal["mean_field", "finite", "finite_second_order", "finite_control_variate", "monte_carlo"]
SmoothingVariant = Literal["standard", "norm_preserving"]


Positive = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(ge=1)]


def key(default: Any, meaning: str, **constraints: Any) -> Any:
    """A config key's default, its meaning (``flowsim config`` prints it) and its range (pydantic's gt, ge, le, lt)."""
    return Field(default, description=meaning, **constraints)


class Section(BaseModel):
    """A TOML table: unknown keys are errors, types are strict, numbers finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ChainConfig(Section):
    """The Markov chain: the paper family P = λ I + (1 - λ) 1 πᵀ, or a transition matrix P."""

    pi: list[float] | None = key([0.75, 0.19, 0.05, 0.01], "stationary law π of the paper family (d = its length)")
    lam: float | None = key(0.5, "the paper family's λ in P = λ I + (1 - λ) 1 πᵀ")
    P: list[list[float]] | None = key(None, "a d × d row-stochastic transition matrix; replaces pi and lam")
    start: StartLaw = key("stationary", "law of a sequence's first token (finite-s losses)")

    @model_validator(mode="before")
    @classmethod
    def _matrix_replaces_the_family(cls, data: Any) -> Any:
        """A transition matrix replaces the paper family unless pi/lam are given alongside."""
        if isinstance(data, dict) and "P" in data:
            data = {"pi": None, "lam": None, **data}
        return data


class TaskConfig(Section):
    """The data: a Markov chain ([chain], the default) or a sequence task (flowsim.model.tasks).
    A Markov run's config.toml keeps this section with its defaults; only kind is read there."""

    kind: Literal["markov", "induction"] = key("markov", "markov: the chain of [chain]; induction: the induction-head task "
                                                         "(d, s, noise below; needs model.kind = 'two_layer')")
    d: int = key(3, "induction: number of tokens", ge=2)
    s: int = key(6, "induction: context length (the model's positions)", ge=2)
    noise: float = key(0.1, "induction: chance that the next token is uniform instead of the copied one", ge=0, lt=1)


class ModelConfig(Section):
    """The paper's one-layer attention-only Transformer, or the two-layer one."""

    kind: Literal["one_layer", "two_layer"] = key("one_layer", "the model")
    m: PositiveInt = key(8, "embedding width m (W0 is d × m)")
    k: PositiveInt = key(8, "query/key width k (W_Q, W_K are m × k)")
    value_matrix: bool = key(False, "one_layer: a value matrix W_V between attention and the unembedding")
    residual: bool = key(False, "one_layer: a residual connection around attention")
    logit_scale: LogitScale = key("one", "one_layer: attention logits scaled by 1 or by 1/√k")
    ffn: FFNKind = key("none", "two_layer: feed-forward block after each attention (none, mlp or glu)")
    ffn_width: PositiveInt = key(16, "two_layer: the feed-forward block's hidden width")


MIN_INIT_EPS = 1e-75  # ε⁴, the scale of the attention logits at the start, stays above float64's smallest normal


class InitConfig(Section):
    """The initial point."""

    eps: float = key(1e-3, "initial scale ε: every weight drawn from N(0, ε²); far above 1 the flow starts saturated, "
                           f"and below {MIN_INIT_EPS:g} the attention logits (order ε⁴) underflow float64", gt=0, le=1e3)
    seed: int = key(0, "seed of the initial draw", ge=0)
    file: str | None = key(None, "an .npz with W0, W_Q, W_K, W1 (and W_V) to start from instead of the draw")

    @field_validator("eps")
    @classmethod
    def _eps_does_not_underflow(cls, eps: float) -> float:
        if eps < MIN_INIT_EPS:
            raise ValueError(f"init.eps = {eps!r} is invalid: below {MIN_INIT_EPS:g} the attention logits, of order ε⁴ at "
                             "the start, underflow float64")
        return eps


class LossConfig(Section):
    """The loss the flow descends."""

    kind: LossKind = key("mean_field", "mean_field: the s -> infinity population loss; finite: exact at context "
                                       "length s; finite_second_order: at context length s to O(1/s²), from the "
                                       "window composition's exact mean and covariance (one-layer model); "
                                       "finite_control_variate: that plus its remainder on mc_samples sampled windows "
                                       "(unbiased); monte_carlo: sampled at length s")
    s: PositiveInt = key(64, "context length of the finite-s losses (every kind but mean_field)")
    mc_samples: int = key(4096, "monte_carlo and finite_control_variate: sequences drawn", ge=2)
    mc_seed: int = key(0, "monte_carlo and finite_control_variate: seed of the sequences")
    kept_types: PositiveInt | None = key(None, "finite_second_order: keep the window covariance's Markov correlations "
                                               "among this many most frequent types only, the rest as independent "
                                               "tokens (O(d K²) memory; default all, d³)")


class FlowConfig(Section):
    """Per-group time rescalings of the gradient flow."""

    rates: dict[str, Annotated[float, Field(ge=0)]] = key({}, "constant rate per parameter group, e.g. {W_Q = 0.1}; default 1")
    qk_rho: Positive = key(1.0, "Q/K slow window: rate rho until qk_t0, then a linear ramp to 1 by qk_t0 + qk_tr")
    qk_t0: float = key(0.0, "Q/K slow window: end of the slow phase", ge=0)
    qk_tr: float = key(0.0, "Q/K slow window: length of the ramp back to rate 1", ge=0)
    qk_groups: list[str] | None = key(None, "groups the Q/K window slows; default: the (upper-layer) query and key")
    smoothing_a: float = key(0.0, "two_layer: depth smoothing a across blocks (S is PSD for a <= 1/2)", ge=0, le=0.5)
    smoothing_variant: SmoothingVariant = key("standard", "two_layer: standard or norm_preserving smoothing")


class SolverConfig(Section):
    """The integrator (flowsim.methods)."""

    method: str = key(DEFAULT_METHOD, f"integration method: auto (JaxBDF), {', '.join(METHODS)}, or one registered "
                                      "(flowsim.methods)")
    # below 1e-14 (about 100 machine epsilons) no step meets it
    rtol: float | None = key(None, "relative tolerance; default: the method's (flowsim.methods.default_rtol)", ge=1e-14)
    atol: Positive = key(1e-12, "absolute tolerance")
    max_steps: PositiveInt = key(200_000, "steps before the solve stops with status max_steps")
    lr: Positive = key(0.1, "gradient_descent: the step (t advances by lr per step)")

    @field_validator("method")
    @classmethod
    def _known_method(cls, name: str) -> str:
        return check_method(name)

    @model_validator(mode="after")
    def _default_rtol(self) -> "SolverConfig":
        if self.rtol is None:
            self.rtol = default_rtol(self.method)
        return self


class TimeConfig(Section):
    """The horizon and the saved times."""

    t_end: Positive = key(6000.0, "the horizon")
    n_linear: int = key(301, "saved times on a linear grid from 0 to t_end", ge=2)
    n_log: int = key(200, "saved times on a log grid from t_log_min to t_end (merged with the linear grid)", ge=0)
    t_log_min: Positive = key(0.1, "first time of the log grid")

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


class ObservablesConfig(Section):
    """What a run keeps of its observables (flowsim.observe.observables); the stage detectors read every query either way."""

    fold_d: int | None = key(None, "the attention over token types is kept for the fold_d most frequent types, the "
                                   "rest folded into 'other' (display only); default: whole up to d = 16, else 16",
                             ge=2)


class Sections(Section):
    """A configuration made of sections."""

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as nested dicts (keys with value None left out, and so sections left empty:
        a run saved before a section existed keeps its digest)."""
        return {name: value for name, value in self.model_dump(exclude_none=True).items() if value != {}}

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
    observables: ObservablesConfig = ObservablesConfig()

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


SHOWN_VALUE_CHARS = 120  # a value longer than this (a π of a thousand entries) is cut in messages


def _shown(value: Any) -> str:
    """``repr(value)``, cut to SHOWN_VALUE_CHARS with its full length said."""
    text = repr(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else f"{text[:SHOWN_VALUE_CHARS - 20]}...{text[-12:]} ({len(text)} characters)"


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
        # a --set value that is not a TOML literal arrives as a string: say so where it looks like an array or table
        unparsed = " (it is not a TOML literal)" if isinstance(value, str) and value.lstrip()[:1] in ("[", "{") else ""
        return f"{key} = {_shown(value)} has type {type(value).__name__}{unparsed}, expected {TYPE_NAMES[kind]}"
    if kind == "value_error":  # a cross-key check: its message is already the whole line
        return str(first["ctx"]["error"])
    message = first["msg"]
    return f"{key} = {_shown(value)} is invalid: {message[0].lower()}{message[1:]}"


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


def flat_settings(tree: dict, prefix: str = "") -> dict:
    """Nested settings as {"section.key": value} (tables within a key, like flow.rates, flattened further)."""
    flat = {}
    for key, value in tree.items():
        flat.update(flat_settings(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def changed_keys(old: dict, new: dict) -> str:
    """"section.key: old -> new" for every key whose value differs between two resolved configurations."""
    before, after = flat_settings(old), flat_settings(new)
    keys = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    return ", ".join(f"{key}: {before.get(key)!r} -> {after.get(key)!r}" for key in keys) or "the recorded config is missing"


def transition_override(P: np.ndarray) -> str:
    """The --set override that gives the chain of transition matrix P."""
    return "chain.P=[" + ", ".join("[" + ", ".join(repr(float(x)) for x in row) + "]" for row in np.asarray(P)) + "]"


def load_config(path: Path | str | None = None, overrides: Sequence[str] = (), schema: type[Schema] = RunConfig) -> Schema:
    """Read a TOML file (or start from the defaults) and apply ``section.key=value`` overrides.
    A relative path that is not a file here names a shipped config (``find_config``)."""
    user: dict = {}
    if path is not None:
        path = find_config(path)
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a folder; expected a TOML file")
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} is not a regular file (a FIFO or a device); expected a TOML file")
        try:
            user = tomllib.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {error.object[error.start]:#04x} "
                              f"at offset {error.start}); TOML files are UTF-8") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {error}") from None
        except RecursionError:
            raise ConfigError(f"config file {str(path)!r} nests its values too deep to be a config; expected a flowsim "
                              "TOML config (`flowsim config` lists its keys)") from None
    return resolve_config(_merge_overrides(user, overrides), schema)


# ---------------------------------------------------------------------------------
# The reference: every key with its type, default and meaning (``flowsim config``)


class KeyReference(NamedTuple):
    key: str  # section.key
    type: str  # e.g. "float > 0", "one of 'one_layer', 'two_layer'"
    default: Any
    meaning: str


BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _type_name(annotation: Any) -> str:
    """A key's type as a reader writes it: float, list of float, 'a' | 'b', ... (None left out: it is the default)."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(repr(value) for value in arguments)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in arguments if a is not type(None))
    if origin is Annotated:
        return _type_name(arguments[0])
    if origin is list:
        return f"list of {_type_name(arguments[0])}"
    if origin is dict:
        return f"table of {_type_name(arguments[1])}"
    return getattr(annotation, "__name__", str(annotation))


def config_reference(schema: type[Sections] = RunConfig) -> list[KeyReference]:
    """Every key of ``schema`` in file order, with its type (and range), default and meaning."""
    rows = []
    for section_name, section in schema.model_fields.items():
        for name, field in section.annotation.model_fields.items():
            bounds = [f"{symbol} {getattr(item, bound):g}" for item in field.metadata
                      for bound, symbol in BOUNDS.items() if getattr(item, bound, None) is not None]
            kind = _type_name(field.annotation) + (f" ({', '.join(bounds)})" if bounds else "")
            rows.append(KeyReference(f"{section_name}.{name}", kind, field.default, field.description or ""))
    return rows


def reference_toml(schema: type[Sections] = RunConfig, section: str | None = None) -> str:
    """Every key as a TOML file of the defaults, each under a comment with its meaning and type; keys without
    a default are commented out. Read back, it is the default configuration."""
    rows = [row for row in config_reference(schema) if section is None or row.key.split(".")[0] == section]
    if not rows:
        raise ConfigError(f"unknown config section {section!r}; expected one of {list(schema.model_fields)}")
    lines, current = [], None
    for row in rows:
        section_name, name = row.key.split(".", 1)
        if section_name != current:
            doc = (schema.model_fields[section_name].annotation.__doc__ or "").split("\n")[0]
            lines += ([""] if lines else []) + [f"[{section_name}]  # {doc}".rstrip(" #")]
            current = section_name
        lines.append(f"# {row.meaning}  [{row.type}]")
        lines.append(f"{name} = {_toml_value(row.default)}" if row.default is not None else f"# {name} =")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    """A TOML literal on one line (tomli_w spreads arrays over lines)."""
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{name} = {_toml_value(item)}" for name, item in value.items()) + "}"
    return tomli_w.dumps({"value": value}).split("=", 1)[1].strip()
