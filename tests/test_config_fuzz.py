"""The configuration schema under fuzzing: any --set string, valid or not, for run, sweep, predict and bridge
train is either accepted (and the run prepared within its memory budget) or refused in one line that names
the key, never with a traceback."""

import json
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowsim.config import ConfigError, RunConfig, config_reference, load_config
from flowsim.assemble import prepare

RUN_KEYS = [row.key for row in config_reference(RunConfig)]
SECTIONS = sorted({key.split(".")[0] for key in RUN_KEYS})

numbers = st.one_of(st.integers(-10**20, 10**20), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, 2, 3, 8, 64, 1e-300, 1e300, -1, 0.5, 1e-3]))
leaves = st.one_of(numbers, st.booleans(), st.text(max_size=12), st.sampled_from(["one_layer", "two_layer", "JaxRadau",
                                                                                   "Tsit5", "mean_field", "finite"]))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=5), max_leaves=12)


def toml_literal(value) -> str:
    """A value as a --set literal: TOML's spelling of numbers and booleans, JSON's of strings and lists."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(item) for item in value) + "]"
    return json.dumps(value)


keys = st.one_of(st.sampled_from(RUN_KEYS), st.sampled_from(SECTIONS).map(lambda s: f"{s}.nonsense"),
                 st.text(alphabet="abcdefghij._", min_size=1, max_size=12))
literals = st.one_of(values.map(toml_literal), st.text(max_size=16))
overrides = st.lists(st.tuples(keys, literals).map(lambda pair: f"{pair[0]}={pair[1]}"), min_size=1, max_size=3)


PLAUSIBLE = ["0", "1", "2", "3", "4", "16", "0.5", "1e-3", "1e-8", "100", "true", "false", '"finite"', '"monte_carlo"',
             '"two_layer"', '"Tsit5"', '"BDF"', '"gradient_descent"', '"induction"', '"mlp"', '"glu"', '"sqrt_k"',
             "[0.5, 0.5]", "[0.7, 0.2, 0.1]", "[[0.9, 0.1], [0.2, 0.8]]", "{W_Q = 0.5}"]
# well-typed values on known keys: most of these reach ``prepare``, where the random ones stop at the schema
plausible = st.lists(st.tuples(st.sampled_from(RUN_KEYS), st.sampled_from(PLAUSIBLE)).map(lambda pair: "=".join(pair)),
                     min_size=1, max_size=4)


def named_in(message: str, sets: list[str]) -> bool:
    """The refusal names what was wrong: a key (or section) of the overrides, or the whole --set entry."""
    names = {entry.partition("=")[0].strip() for entry in sets}
    names |= {name.split(".")[0] for name in names}
    return any(name and name in message for name in names) or any(entry in message for entry in sets)


# derandomize: the same 1500 draws on every run, so CI is repeatable; to search further, drop it and pass
# --hypothesis-seed=N (22 seeds found nothing more when this was written)
@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(overrides, plausible))
@pytest.mark.slow
def test_any_run_override_is_prepared_or_refused_in_one_line_naming_it(sets):
    try:
        config = load_config(None, sets)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepare(config)
    except ConfigError as error:
        message = str(error)
        assert message.strip() and "\n" not in message and "Traceback" not in message, (sets, message)
        assert named_in(message, sets), (sets, message)


def test_the_commands_refuse_a_fuzzed_override_in_one_line_and_leave_no_folder(tmp_path):
    """A sample of refused overrides through the command line: run, sweep, predict and bridge train each print
    one 'flowsim: error:' line, exit 2, and make no --out folder."""
    from typer.testing import CliRunner

    from flowsim.cli import app

    refused = ["init.eps=nan", "model.m=-3", "chain.pi=[0.5, 0.6]", "time.t_end=inf", "solver.method=\"nope\"",
               "loss.kind=[1, 2]", "chain.nonsense=1", "model.m=1e300", "flow.rates={W_Q = -1}", "task=3"]
    for index, entry in enumerate(refused):
        for command in (["run", "--set", entry], ["sweep", "--grid", "chain.lam=[0.3, 0.5]", "--set", entry],
                        ["predict", "--set", entry]):
            out = tmp_path / f"out{index}-{command[0]}"
            result = CliRunner().invoke(app, [*command, *(["--out", str(out)] if command[0] != "predict" else [])])
            lines = result.output.strip().splitlines()
            assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("flowsim: error: "), (command, result.output)
            assert not out.exists(), (command, entry)
    pytest.importorskip("torch")
    for index, entry in enumerate(["optim.lr=nan", "data.batch_size=0", "model.kind=3", "data.nonsense=1"]):
        out = tmp_path / f"bridge{index}"
        result = CliRunner().invoke(app, ["bridge", "train", "--set", entry, "--out", str(out)])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("flowsim: error: "), (entry, result.output)
        assert not out.exists(), entry
