"""flowsim.config: one schema for every command, every bad value one clear line."""

import numpy as np
import pytest

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from flowsim.model.chains import MarkovChain
from flowsim.config import (
    ConfigError,
    ModelConfig,
    RunConfig,
    find_config,
    load_config,
    parse_override,
    shipped_config,
)
from flowsim.methods import METHODS, default_rtol


def test_overrides_and_general_P(tmp_path):
    config = load_config(None, ["chain.P=[[0.5,0.5],[0.2,0.8]]", "solver.method=BDF", "flow.rates.W1=2"])
    assert config.chain.lam is None and config.chain.pi is None
    assert config.solver.method == "BDF" and config.flow.rates == {"W1": 2}
    np.testing.assert_allclose(MarkovChain.from_config(config.chain).pi, [2 / 7, 5 / 7])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["solver.method=Euler"], "solver.method = 'Euler' is invalid"),
        (["solver.metod=BDF"], "unknown config key solver.metod"),
        (["chain.pi=[0.5,0.6]"], "chain: pi sums to 1.1"),
        (["init.eps='small'"], "init.eps = 'small' has type str"),
        (["time.t_end=-1.0"], "time.t_end = -1.0 is invalid"),
        (["loss.kind='exact'"], "loss.kind = 'exact' is invalid"),
        (["solver"], "--set expects key=value"),
    ],
)
def test_bad_config_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError) as error:
        config = load_config(None, overrides)
        MarkovChain.from_config(config.chain)
    assert message in str(error.value)


@pytest.mark.parametrize("override, message", [
    ("model.m=8.0", "model.m = 8.0 has type float, expected int"),  # strict: no silent float -> int
    ("model.value_matrix=1", "model.value_matrix = 1 has type int, expected bool"),
    ("init.seed='3'", "init.seed = '3' has type str, expected int"),
    ("chain.P=[[0.5,'x'],[0.5,0.5]]", "chain.P[0][1] = 'x' has type str"),
    ("flow.rates.W1=-1.0", "flow.rates.W1 = -1.0 is invalid"),
    ("flow.smoothing_a=0.7", "flow.smoothing_a = 0.7 is invalid: input should be less than or equal to 0.5"),
    ("time.t_log_min=7000.0", "time.t_log_min = 7000.0 is invalid: it must be below time.t_end"),
    ("time.t_end=inf", "time.t_end = inf is invalid"),
    ("nosuch.key=1", "unknown config section 'nosuch'"),
])
def test_schema_errors_name_key_value_and_expectation(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_defaults_are_the_paper_run_and_rtol_follows_the_method():
    config = load_config()
    assert config == RunConfig()
    assert config.chain.pi == [0.75, 0.19, 0.05, 0.01] and config.chain.lam == 0.5
    assert config.solver.rtol == default_rtol(config.solver.method)
    for method in METHODS:
        assert load_config(None, [f"solver.method={method}"]).solver.rtol == default_rtol(method)
    assert load_config(None, ["solver.rtol=1e-5"]).solver.rtol == 1e-5  # an explicit value wins
    times = config.save_times()
    assert times[0] == 0 and times[-1] == 6000 and np.all(np.diff(times) > 0)
    assert len(times) <= config.time.n_linear + config.time.n_log + 1


def test_toml_round_trip_and_overrides(tmp_path):
    config = load_config(None, ["model.kind='two_layer'", "model.ffn=glu", "flow.qk_rho=0.25", "flow.rates.W_E=2"])
    (tmp_path / "c.toml").write_text(config.to_toml())
    assert load_config(tmp_path / "c.toml") == config
    assert load_config(tmp_path / "c.toml", ["model.ffn='mlp'"]).model.ffn == "mlp"
    assert parse_override("solver.method=BDF") == (["solver", "method"], "BDF")  # a bare word is a string
    assert parse_override("chain.pi=[0.5, 0.5]") == (["chain", "pi"], [0.5, 0.5])
    (tmp_path / "bad.toml").write_text("[chain\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


def test_shipped_configs_are_found_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = shipped_config("two_layer/baseline.toml")
    assert path.is_file() and path.parent.parent.name == "configs"
    assert find_config("configs/two_layer/baseline.toml") == path == find_config("two_layer/baseline.toml")
    assert load_config("configs/two_layer/glu.toml").model.ffn == "glu"
    (tmp_path / "configs" / "two_layer").mkdir(parents=True)  # a file of that name here wins
    (tmp_path / "configs" / "two_layer" / "glu.toml").write_text("[model]\nkind = 'two_layer'\nffn = 'mlp'\n")
    assert load_config("configs/two_layer/glu.toml").model.ffn == "mlp"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/two_layer/nothing.toml")


def test_bridge_schema_extends_the_flowsim_sections():
    pytest.importorskip("torch")
    from flowsim.bridge.config import BridgeModelConfig, load_bridge_config

    assert issubclass(BridgeModelConfig, ModelConfig)
    config = load_bridge_config("configs/bridge/markov-default.toml", ["chain.lam=0.3"])
    assert MarkovChain.from_config(config.chain).lam == 0.3
    # the model keys of a paper-model bridge run are a valid flowsim [model] section
    assert RunConfig.model_validate({"model": config.model.flowsim_keys()}).model.m == config.model.m
    with pytest.raises(ConfigError, match="optim.smoothing_a > 0 needs repeated blocks"):
        load_bridge_config(None, ["optim.smoothing_a=0.1"])
    with pytest.raises(ConfigError, match="compare.method = 'Euler' is invalid"):
        load_bridge_config(None, ["compare.method='Euler'"])


@pytest.mark.parametrize("schema_name", ["run", "bridge"])
def test_config_reference_names_every_key_and_reads_back_as_the_defaults(schema_name):
    """`flowsim config` is a TOML file of the defaults: every key has a meaning and a type, and
    the file read back resolves to the default configuration."""
    from typer.testing import CliRunner

    from flowsim.cli import app
    from flowsim.config import config_reference, resolve_config

    schema = RunConfig
    if schema_name == "bridge":
        pytest.importorskip("torch")
        from flowsim.bridge.config import BridgeConfig as schema
    result = CliRunner().invoke(app, ["config"] + (["--bridge"] if schema_name == "bridge" else []))
    assert result.exit_code == 0, result.output
    rows = config_reference(schema)
    keys = {f"{section}.{name}" for section, table in schema.model_fields.items()
            for name in table.annotation.model_fields}
    assert {row.key for row in rows} == keys
    assert all(row.meaning and row.type for row in rows), [row.key for row in rows if not row.meaning]
    for row in rows:
        section, name = row.key.split(".", 1)
        assert f"{name} = " in result.output or f"# {name} =" in result.output, row.key
    read_back = resolve_config(tomllib.loads(result.output), schema)
    assert read_back.to_dict() == schema().to_dict()
    assert "[float (> 0, <= 1000)]" in CliRunner().invoke(app, ["config", "init"]).output or schema_name == "bridge"


def test_config_reference_of_one_section_and_of_an_unknown_one():
    from typer.testing import CliRunner

    from flowsim.cli import app

    solver = CliRunner().invoke(app, ["config", "solver"])
    assert solver.exit_code == 0 and solver.output.startswith("[solver]") and "[chain]" not in solver.output
    assert "method = \"auto\"" in solver.output and "# rtol =" in solver.output
    unknown = CliRunner().invoke(app, ["config", "solvers"])
    assert unknown.exit_code == 2 and "unknown config section 'solvers'" in unknown.output


def test_a_long_bad_value_is_cut_in_its_one_line_message():
    """A π of hundreds of entries written with numpy's repr (not TOML) is named, cut, and said not to be TOML."""
    long_value = "[np.float64(0.2), " + ", ".join(["0.001"] * 300) + "]"
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"chain.pi={long_value}"])
    message = str(caught.value)
    assert message.startswith("chain.pi = '[np.float64(0.2)") and "(it is not a TOML literal)" in message
    assert f"({len(repr(long_value))} characters)" in message and len(message) < 250
