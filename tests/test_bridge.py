"""The torch bridge: parity with flowsim, the optimizers, data, resumable runs and the
comparison with the ODE (CPU only)."""

import itertools
import json
import re
import sys
from pathlib import Path
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import random_params  # noqa: E402

import flowsim  # noqa: E402
from flowsim.bridge.config import load_bridge_config  # noqa: E402
from flowsim.bridge.data import default_data_dir, load_corpus  # noqa: E402
from flowsim.observe.observables import folded_types  # noqa: E402
from flowsim.bridge.models import GPT, GPTConfig, torch_model_for  # noqa: E402
from flowsim.bridge.optim import QKSchedule, WindowSmoothing, build_optimizer  # noqa: E402
from flowsim.bridge.train import CHECKPOINT_FILE, read_checkpoint, train  # noqa: E402
from flowsim.model.losses import population_loss_finite  # noqa: E402
from flowsim.model.models import OneLayerTransformer, TwoLayerTransformer  # noqa: E402

DATA_DIR = default_data_dir()
needs_data = pytest.mark.skipif(DATA_DIR is None, reason="the shared WikiText-2 / TinyStories files are not beside the repository")

SPECS = [
    OneLayerTransformer(d=4, m=3, k=2),
    OneLayerTransformer(d=3, m=4, k=3, value_matrix=True, residual=True, logit_scale="inv_sqrt_k"),
    TwoLayerTransformer(d=3, m=4, k=3, ffn="mlp", ffn_width=5),
    TwoLayerTransformer(d=3, m=4, k=2, ffn="glu", ffn_width=3),
]


def per_sequence_losses_flowsim(spec, params, contexts, targets):
    logits = spec.forward(params, jnp.asarray(contexts))
    return np.asarray(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, jnp.asarray(targets)[:, None], axis=1)[:, 0])


@pytest.mark.parametrize("spec", SPECS, ids=["one_layer", "one_layer_options", "two_layer_mlp", "two_layer_glu"])
@pytest.mark.slow
def test_torch_twin_matches_flowsim_per_sequence_and_in_the_exact_gradient(spec):
    params = random_params(spec, 0.7, seed=3)
    model = torch_model_for(spec).load_flowsim_params(params)
    for name, value in model.flowsim_params().items():  # the round trip is exact
        np.testing.assert_array_equal(value, np.asarray(params[name]))
    rng = np.random.default_rng(0)
    contexts, targets = rng.integers(0, spec.d, size=(64, 7)), rng.integers(0, spec.d, size=64)
    torch_losses = torch.nn.functional.cross_entropy(model(torch.as_tensor(contexts)), torch.as_tensor(targets), reduction="none")
    np.testing.assert_allclose(torch_losses.detach().numpy(), per_sequence_losses_flowsim(spec, params, contexts, targets), atol=1e-10, rtol=0)

    # the finite-s exact loss by enumerating every context, weighted by its probability
    P = rng.random((spec.d, spec.d)) + 0.3
    chain = flowsim.MarkovChain(P=P / P.sum(axis=1, keepdims=True))
    s = 4
    contexts = np.array(list(itertools.product(range(spec.d), repeat=s)))
    probability = chain.pi[contexts[:, 0]] * np.prod(chain.P[contexts[:, :-1], contexts[:, 1:]], axis=1)
    log_softmax = torch.log_softmax(model(torch.as_tensor(contexts)), dim=-1)
    loss = -(torch.as_tensor(probability)[:, None] * torch.as_tensor(chain.P[contexts[:, -1]]) * log_softmax).sum()
    loss.backward()
    expected_loss, expected_gradient = jax.value_and_grad(population_loss_finite)(params, chain, s, spec)
    assert loss.item() == pytest.approx(float(expected_loss), abs=1e-10)
    for name in spec.shapes:
        np.testing.assert_allclose(getattr(model, name).grad.numpy(), np.asarray(expected_gradient[name]), atol=1e-10, rtol=0, err_msg=name)


def test_window_smoothing_applies_the_formula_and_keeps_decay_and_other_tensors_out():
    a, lr, decay = 0.3, 0.5, 0.1
    torch.manual_seed(0)
    stack = [torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float64)) for _ in range(3)]
    other = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    before = [p.detach().clone() for p in [*stack, other]]
    gradients = [torch.randn_like(p) for p in [*stack, other]]
    base = torch.optim.SGD([*stack, other], lr=lr, weight_decay=decay)
    smoothing = WindowSmoothing(base, [stack], a)
    for p, g in zip([*stack, other], gradients):
        p.grad = g.clone()
    smoothing.step()
    u = [-lr * g for g in gradients]  # the update without its decay
    expected = [(1 - a / 2) * u[0] + a / 2 * u[1], (1 - a) * u[1] + a / 2 * (u[0] + u[2]), a / 2 * u[1] + (1 - a / 2) * u[2]]
    for p, p0, update in zip(stack, before, expected):
        torch.testing.assert_close(p.detach(), p0 + update - lr * decay * p0, rtol=0, atol=1e-14)
    torch.testing.assert_close(other.detach(), before[3] + u[3] - lr * decay * before[3], rtol=0, atol=1e-14)

    # norm-preserving: each smoothed update keeps its own norm
    for p, p0, g in zip(stack, before, gradients):
        p.data.copy_(p0)
        p.grad = g.clone()
    WindowSmoothing(torch.optim.SGD(stack, lr=lr), [stack], a, "norm_preserving").step()
    for p, p0, update, own in zip(stack, before, expected, u[:3]):
        torch.testing.assert_close(p.detach() - p0, update * own.norm() / update.norm(), rtol=1e-12, atol=1e-14)


def test_window_smoothing_with_a_zero_is_the_base_optimizer_exactly():
    config = GPTConfig(vocab_size=11, n_layer=3, d_model=8, n_head=2, seq_len=6)
    models = [GPT(config, seed=1).double() for _ in range(2)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    named = dict(models[1].named_parameters())
    wrapped = WindowSmoothing(optimizers[1], [[named[n] for n in stack] for stack in models[1].repeated_blocks], 0.0)
    tokens = torch.randint(0, 11, (5, 6), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for model, stepper in ((models[0], optimizers[0]), (models[1], wrapped)):
            stepper.zero_grad()
            model(tokens).sum().backward()
            stepper.step()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), name
    assert all(name.startswith("blocks.") for stack in models[1].repeated_blocks for name in stack)


def test_upper_qk_schedule_sets_the_effective_learning_rates():
    model = GPT(GPTConfig(vocab_size=7, n_layer=4, d_model=8, n_head=2, seq_len=4))
    schedule = QKSchedule(rho=0.25, hold_fraction=0.04, ramp_fraction=0.01, total_steps=1000)
    optimizer, scheduler = build_optimizer(model, "sgd", 0.2, 0.0, model.slow_groups, schedule)
    slow_ids = {id(p) for p in optimizer.param_groups[1]["params"]}
    slowed = {name for name, p in model.named_parameters() if id(p) in slow_ids}
    assert slowed == {f"blocks.{layer}.attn.{role}.weight" for layer in (2, 3) for role in ("W_Q", "W_K")}
    rates = []
    for _ in range(1000):
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    rates = np.array(rates)
    np.testing.assert_allclose(rates[:, 0], 0.2)
    np.testing.assert_allclose(rates[:40, 1], 0.05)  # hold: 4% of the steps at 0.25 x lr
    np.testing.assert_allclose(rates[45, 1], 0.2 * (0.25 + 0.75 * 0.5))  # half-way up the 1% ramp
    np.testing.assert_allclose(rates[50:, 1], 0.2)


@pytest.mark.parametrize("kind", ["markov_one_layer", "markov_two_layer", "markov_gpt"])
@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_same_parameters(tmp_path, kind):
    overrides = ["optim.steps=30", "log.n_checkpoints=8", "data.batch_size=64", "data.s=16", "log.probe_per_type=8"]
    if kind == "markov_two_layer":
        overrides += ["model.kind='two_layer'", "model.m=4", "model.k=3", "model.ffn_width=5", "optim.smoothing_a=0.2"]
    if kind == "markov_gpt":
        overrides += ["model.kind='gpt'", "model.n_layer=2", "model.d_model=8", "model.n_head=2", "optim.name='adamw'",
                      "optim.lr=0.01", "optim.weight_decay=0.1", "optim.qk_rho=0.25", "optim.qk_hold=0.2", "optim.qk_ramp=0.1",
                      "optim.smoothing_a=0.2"]
    config = load_bridge_config(None, overrides)
    whole = train(config, tmp_path / "whole", progress=False)
    stopped = train(config, tmp_path / "resumed", progress=False, stop_at_step=13)
    assert not stopped.finished and stopped.steps_done == 13
    assert json.loads((tmp_path / "resumed" / "meta.json").read_text())["status_name"] == "step_limit"
    resumed = train(config, tmp_path / "resumed", progress=False)
    assert resumed.finished and resumed.log == whole.log  # no logged point lost or changed
    states = [read_checkpoint(tmp_path / name / CHECKPOINT_FILE, "cpu")["model"] for name in ("whole", "resumed")]
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name
    with pytest.raises(flowsim.config.ConfigError, match=r"different configuration \(optim.lr: 0\.0?1 -> 0\.3\)"):
        train(load_bridge_config(None, [*overrides, "optim.lr=0.3"]), tmp_path / "whole", progress=False)
    moved = train(load_bridge_config(None, [*overrides, f"data.data_dir='{tmp_path}'"]), tmp_path / "whole", progress=False)
    assert moved.finished  # where a corpus lies is not what the run is: it resumes (here: is already done)
    assert train(load_bridge_config(None, [*overrides, "compare.rtol=1e-6"]), tmp_path / "whole", progress=False).finished
    assert "rtol = 1e-06" in (tmp_path / "whole" / "config.toml").read_text()  # the ODE beside it follows the new [compare]
    saved = tmp_path / "resumed" / "config.toml"  # as an older version wrote it, before data.train_on existed
    saved.write_text("".join(line for line in saved.read_text().splitlines(keepends=True) if not line.startswith("train_on")))
    assert train(config, tmp_path / "resumed", progress=False).finished
    observables = flowsim.observe.observables.Observables.load(tmp_path / "whole")
    layers = {"markov_one_layer": [""], "markov_two_layer": ["_1", "_2"], "markov_gpt": ["_1", "_2"]}[kind]
    for suffix in layers:  # per-layer attention over the 4 token types, rows summing to 1
        np.testing.assert_allclose(observables[f"attention{suffix}"].sum(axis=2), 1.0, atol=1e-6)
    if kind == "markov_gpt":
        assert observables["ffn_write_1"].shape == (8,) and np.all(observables["ffn_write_1"] > 0)
        assert observables["basis_drift_1"][0] == 0.0 and observables["basis_angle_2"][-1] == pytest.approx(0.0, abs=1e-6)


def test_bad_bridge_settings_are_named(tmp_path):
    with pytest.raises(flowsim.config.ConfigError, match="optim.smoothing_a"):
        load_bridge_config(None, ["optim.smoothing_a=0.7", "model.kind='gpt'"])
    with pytest.raises(flowsim.config.ConfigError, match="data.kind"):
        load_bridge_config(None, ["data.kind='shakespeare'"])
    with pytest.raises(flowsim.config.ConfigError, match="compare.method = 'Radau5' is invalid: input should be 'auto'"):
        load_bridge_config(None, ["compare.method='Radau5'"])
    assert load_bridge_config(None, ["compare.method='auto'"]).compare.method == "auto"
    if not torch.cuda.is_available():
        with pytest.raises(flowsim.config.ConfigError, match="no CUDA device"):
            train(load_bridge_config(None, ["data.device='cuda'"]), tmp_path / "cuda", progress=False)


def test_a_large_chains_run_folds_its_states_as_a_text_run_folds_its_tokens(tmp_path):
    """A chain above MARKOV_UNFOLDED_STATES states records attention over its 8 likeliest states and "other" (not
    d x d at every checkpoint); a smaller one keeps its states unless log.track names some."""
    from flowsim.bridge.train import MARKOV_UNFOLDED_STATES, build_data, type_names

    d = MARKOV_UNFOLDED_STATES + 6
    weights = np.random.default_rng(3).permutation(1.0 / np.arange(1, d + 1))  # the likeliest states are not 0, 1, ...
    pi = (weights / weights.sum()).tolist()
    settings = [f"chain.pi={pi}", "chain.lam=0.5", "optim.steps=6", "log.n_checkpoints=3", "data.batch_size=16",
                "data.s=8", "log.probe_per_type=4", "log.val_batches=1", "model.init_eps=0.1"]
    config = load_bridge_config(None, settings)
    fold = build_data(config).fold()
    likeliest = np.argsort(-np.asarray(pi), kind="stable")
    np.testing.assert_array_equal(fold[likeliest[:8]], np.arange(8))
    assert np.all(fold[likeliest[8:]] == 8)
    assert type_names(build_data(config)) == [str(i) for i in likeliest[:8]] + ["other"]
    train(config, tmp_path / "run", progress=False)
    attention = flowsim.observe.observables.Observables.load(tmp_path / "run")["attention"]
    assert attention.shape[1:] == (9, 9)
    np.testing.assert_allclose(attention.sum(axis=2), 1.0, atol=1e-6)

    unfolded = build_data(load_bridge_config(None, [*settings, f"log.fold_d={d - 1}"])).fold()
    assert len(np.unique(unfolded)) == d and np.all(unfolded[likeliest] == np.arange(d))
    small = lambda *more: build_data(load_bridge_config(None, list(more))).fold()  # noqa: E731  the paper chain
    np.testing.assert_array_equal(small("log.fold_d=2"), np.arange(4))
    np.testing.assert_array_equal(small("log.fold_d=2", "log.track=['3']"), [0, 1, 3, 2])
    for bad, named in ((["log.fold_d=1", "log.track=['2']"], "log.fold_d = 1 is invalid: expected an integer in [2, 3]"),
                       (["log.track=['7']"], "log.track names states outside the vocabulary: ['7']")):
        with pytest.raises(flowsim.config.ConfigError, match=re.escape(named)):
            small(*bad)
        with pytest.raises(flowsim.config.ConfigError, match=re.escape(named)):  # refused before the folder is made
            train(load_bridge_config(None, bad), tmp_path / "refused", progress=False)
        assert not (tmp_path / "refused").exists()


@needs_data
def test_corpus_statistics_match_independent_counts():
    corpus = load_corpus("wikitext2", 500, DATA_DIR)
    words = (DATA_DIR / "wikitext-2" / "valid.txt").read_text(encoding="utf-8").split()
    counts = Counter(words)
    top = [word for word, _ in counts.most_common(501) if word != "<unk>"][:500]
    assert len(corpus.train) == len(words) and len(corpus.vocabulary) == 501
    assert set(corpus.vocabulary[1:]) == set(top)
    np.testing.assert_allclose(corpus.frequencies[1:4], [counts[w] / len(words) for w in corpus.vocabulary[1:4]])
    assert corpus.frequencies[0] == pytest.approx(1 - sum(counts[w] for w in top) / len(words))

    stories = load_corpus("tinystories", 300, DATA_DIR)
    text = (DATA_DIR / "tinystories" / "valid-sample.txt").read_text(encoding="utf-8").lower()
    vocabulary = list(stories.vocabulary)
    both = np.concatenate([stories.train, stories.valid])
    assert np.sum(both == vocabulary.index(".")) == text.count(".")
    the = sum(1 for piece in re.split(r"[^a-z0-9']+", text) if piece == "the")
    assert np.sum(both == vocabulary.index("the")) == the
    assert stories.word_counts["the"] + np.sum(stories.valid == vocabulary.index("the")) == the


@needs_data
@pytest.mark.parametrize("corpus", ["wikitext2", "tinystories"])
def test_the_default_text_surrogate_at_d1001_keeps_the_corpus_frequencies_and_beats_additive_smoothing(corpus):
    """The shipped d = 1001 examples' surrogate: π within 1% of the training split's token frequencies
    (counted here from the ids, not from the chain's counts) in total variation, and a validation
    cross-entropy no worse than additive smoothing's at its best α (searched here over log α)."""
    import scipy.optimize

    from flowsim.bridge.surrogate import text_surrogate
    from flowsim.bridge.train import build_data
    from flowsim.model.chains import cross_entropy_rate

    config = load_bridge_config(None, [f"data.kind='{corpus}'", "data.vocab_size=1000", f"data.data_dir='{DATA_DIR}'"])
    assert config.compare.surrogate == "interpolated"  # the default of [compare]
    data = build_data(config)
    chain, description = text_surrogate(data.corpus, config.compare)
    frequencies = np.bincount(data.corpus.train, minlength=1001) / len(data.corpus.train)
    assert chain.d == 1001 and 0.5 * np.abs(chain.pi - frequencies).sum() < 0.01
    ids = data.corpus.train  # additive smoothing's counts, independently of flowsim.model.chains.bigram_counts
    counts = np.zeros((1001, 1001))
    np.add.at(counts, (ids[:-1], ids[1:]), 1.0)

    def additive(log_alpha: float) -> float:
        alpha = np.exp(log_alpha)
        return cross_entropy_rate((counts + alpha) / (counts + alpha).sum(axis=1, keepdims=True), data.corpus.valid)

    best = scipy.optimize.minimize_scalar(additive, bounds=(np.log(1e-4), np.log(1.0)), method="bounded")
    assert description["validation_cross_entropy"] <= best.fun
    assert description["validation_cross_entropy"] == pytest.approx(cross_entropy_rate(chain.P, data.corpus.valid), abs=1e-12)


@needs_data
def test_training_on_the_surrogate_draws_its_chain_and_keeps_the_texts_validation_and_probe_windows():
    """data.train_on = 'surrogate': every training batch is a seeded sample of the text's bigram chain (the chain of
    the ODE beside the run), whose bigram frequencies over many steps are the chain's P within sampling error;
    validation batches and probe windows are the text run's, value for value. Markov data is refused."""
    from flowsim.bridge.data import markov_batch
    from flowsim.bridge.surrogate import text_surrogate
    from flowsim.bridge.train import build_data

    settings = ["data.kind='wikitext2'", "data.vocab_size=7", f"data.data_dir='{DATA_DIR}'", "data.s=8", "data.batch_size=64",
                "log.fold_d=4"]
    text = build_data(load_bridge_config(None, settings))
    surrogate = build_data(load_bridge_config(None, settings + ["data.train_on='surrogate'"]))
    chain, _ = text_surrogate(text.corpus, text.config.compare)
    np.testing.assert_array_equal(surrogate.surrogate.P, chain.P)
    assert text.surrogate is None
    for step in (0, 1, 57):
        np.testing.assert_array_equal(surrogate.batch(step).numpy(), markov_batch(chain, 64, 9, 0, step).numpy())
        np.testing.assert_array_equal(surrogate.batch(step, "valid").numpy(), text.batch(step, "valid").numpy())
    sequences = np.concatenate([surrogate.batch(step).numpy() for step in range(300)])  # 300 × 64 × 8 transitions
    counts = np.zeros((8, 8))
    np.add.at(counts, (sequences[:, :-1].ravel(), sequences[:, 1:].ravel()), 1.0)
    visits = counts.sum(axis=1, keepdims=True)
    standard_error = np.sqrt(chain.P * (1 - chain.P) / visits)
    assert np.all(np.abs(counts / visits - chain.P) <= 5 * standard_error + 1e-12)
    probe, text_probe = surrogate.probe_set(), text.probe_set()
    np.testing.assert_array_equal(probe.contexts.numpy(), text_probe.contexts.numpy())
    np.testing.assert_array_equal(probe.pi, text_probe.pi)
    with pytest.raises(flowsim.config.ConfigError, match="data.train_on = 'surrogate' needs a text corpus"):
        load_bridge_config(None, ["data.train_on='surrogate'"])


@needs_data
def test_probe_windows_of_a_rare_word_come_from_the_whole_validation_split():
    corpus = load_corpus("wikitext2", 500, DATA_DIR)
    she = corpus.vocabulary.index("she")
    fold = folded_types(corpus.frequencies, 4, tracked=(she,))
    windows = corpus.windows_ending_in(fold, 200, 16, seed=0).numpy()
    words = (DATA_DIR / "wikitext-2" / "test.txt").read_text(encoding="utf-8").split()
    ends = [i for i, word in enumerate(words) if word == "she" and i >= 15]  # room for 15 words before
    mine = windows[fold[windows[:, -1]] == fold[she]]
    assert len(mine) == min(200, len(ends)) and len(ends) > 50
    known = set(corpus.vocabulary)
    mapped = [word if word in known else corpus.vocabulary[0] for word in words]  # out of vocabulary: <unk>
    grams = {tuple(mapped[i - 15:i + 1]) for i in ends}
    assert all(tuple(corpus.vocabulary[j] for j in window) in grams for window in mine)  # real 16-word windows
    for folded in range(fold.max() + 1):  # every type gets its share, up to the cap
        assert np.sum(fold[windows[:, -1]] == folded) == min(200, np.sum(fold[corpus.valid[15:]] == folded))


@pytest.mark.slow
def test_sgd_on_sampled_sequences_reproduces_the_finite_s_flow(tmp_path):
    from typer.testing import CliRunner

    from flowsim.cli import app

    run_dir = tmp_path / "markov"
    settings = ["data.batch_size=1024", "optim.lr=0.25", "optim.steps=600", "log.n_checkpoints=40"]
    runner = CliRunner()
    result = runner.invoke(app, ["bridge", "train", "--quiet", "--out", str(run_dir), *[a for s in settings for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    labelled = runner.invoke(app, ["stages", str(run_dir)])
    assert labelled.exit_code == 0 and "condensation" in labelled.output
    compared = runner.invoke(app, ["bridge", "compare", str(run_dir)])
    assert compared.exit_code == 0, compared.output
    rows = json.loads((run_dir / "compare.json").read_text())["rows"]
    first = {(row["stage"], row["query"]): row for row in rows if row["occurrence"] == 1}
    for key in (("condensation", None), ("focus", 0)):
        assert first[key]["rel_error"] is not None and first[key]["rel_error"] < 0.10, first[key]


@needs_data
@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["wikitext2", "tinystories"])
def test_short_text_run_trains_is_labelled_and_meets_its_surrogate(tmp_path, corpus, monkeypatch):
    import flowsim.bridge.compare
    from flowsim.bridge.compare import compare_bridge_run
    from flowsim.runs.labelling import label_run

    overrides = [f"data.kind='{corpus}'", "data.vocab_size=100", "data.s=16", "data.batch_size=64", "model.m=8", "model.k=8",
                 "model.init_eps=1e-3", "optim.lr=1.0", "optim.steps=200", "log.n_checkpoints=20", "log.fold_d=4",
                 "log.probe_per_type=16", "log.val_batches=2"]
    result = train(load_bridge_config(None, overrides), tmp_path / corpus, progress=False)
    assert result.log[-1]["val_loss"] < result.log[0]["val_loss"] - 0.5  # it learns
    observables = flowsim.observe.observables.Observables.load(tmp_path / corpus)
    assert observables["attention"].shape[1:] == (5, 5)  # 4 tracked tokens and "other"
    np.testing.assert_allclose(observables["attention"].sum(axis=2), 1.0, atol=1e-12)
    assert str(observables.constants["model_kind"]) == "one_layer"  # the kind is recorded, as flowsim's runs record it
    report = label_run(tmp_path / corpus)
    assert report.of("condensation")
    rows, agreement, description = compare_bridge_run(tmp_path / corpus)
    assert "all 101 tokens" in description["ode"] and description["surrogate_d"] == 101  # nothing folded
    condensation = [row for row in rows if row.stage == "condensation"]
    assert condensation and condensation[0].predicted is not None and condensation[0].measured is not None
    order = description["focus_order"]
    assert [row["token"] for row in order["tokens"]][:4] == list(observables.constants["type_names"][:4])
    assert (tmp_path / corpus / "compare.json").is_file()
    with monkeypatch.context() as patched:  # a second compare reads the ODE cached beside the run
        patched.setattr(flowsim.bridge.compare, "solve_flow", lambda *a, **k: pytest.fail("the cached ODE was not reused"))
        assert compare_bridge_run(tmp_path / corpus)[0] == rows

    # the ODE starts from the run's own initial parameters: a run with another start predicts otherwise
    import shutil

    other = tmp_path / f"{corpus}-other-start"
    shutil.copytree(tmp_path / corpus, other)
    with np.load(other / "trajectory.npz") as saved:
        arrays = {name: saved[name] for name in saved.files}
    for name in ("W0", "W1"):
        arrays[name] = arrays[name].copy()
        arrays[name][0] *= 3.0
    np.savez(other / "trajectory.npz", **arrays)
    moved = {row.stage: row.predicted for row in compare_bridge_run(other)[0] if row.stage == "condensation"}
    assert moved["condensation"] < 0.9 * condensation[0].predicted  # a larger start condenses sooner


VALIDATE_SMALL = ["data.vocab_size=31", "data.s=16", "data.batch_size=64", "optim.lr=0.5", "optim.steps=300",
                  "log.n_checkpoints=30", "log.probe_per_type=8", "log.val_batches=1", "log.track=[]", "log.fold_d=4",
                  "model.m=8", "model.k=8"]


@needs_data
@pytest.mark.slow
def test_bridge_validate_puts_theory_ode_and_sgd_side_by_side_and_reuses_every_part(tmp_path, monkeypatch):
    """`flowsim bridge validate` at d = 32: the ODE and SGD columns are compare.json's, the theory's condensation
    is within 10% of the exact flow's, and a second call recomputes nothing."""
    from typer.testing import CliRunner

    import flowsim.bridge.compare
    import flowsim.runs.predictions
    from flowsim.cli import app
    from flowsim.observe.observables import Observables
    from flowsim.observe.stages import detect_stages

    out = tmp_path / "validate"
    arguments = ["bridge", "validate", "tinystories", "--out", str(out), "--quiet", "--set", f"data.data_dir='{DATA_DIR}'",
                 *[item for setting in VALIDATE_SMALL for item in ("--set", setting)]]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    payload = json.loads((out / "validate.json").read_text())
    assert payload["d"] == 32 and payload["t_end"] == 150 and "interpolated" in payload["surrogate"]
    compared = {(row["stage"], row["query"], row["direction"], row["occurrence"]): row
                for row in json.loads((out / "sgd" / "compare.json").read_text())["rows"]}
    for row in payload["rows"]:
        key = (row["stage"], row["query"], row["direction"], row["occurrence"])
        assert (row["ode"], row["sgd"]) == ((compared[key]["predicted"], compared[key]["measured"]) if key in compared
                                            else (None, None))
        assert row["query"] is None or 0 <= row["query"] < 4  # a theory query folded into "other" is dropped
    condensation = next(row for row in payload["rows"] if row["stage"] == "condensation")
    # σ0(W0) reads the same on the whole vocabulary and on the probe set: the ODE's two readings agree there
    assert condensation["ode_full_vocabulary"] == pytest.approx(condensation["ode"], rel=1e-6), condensation
    assert condensation["theory_vs_ode"] < 0.10, condensation
    # the flow of the loss at the run's s beside it, cached like the first ODE and read like it
    finite = Observables.load(out / "sgd" / "ode-finite_second_order")
    finite_events = detect_stages(finite).events()
    for row in payload["rows"]:
        assert row["ode_finite_s"] == finite_events.get((row["stage"], row["query"], row["direction"], row["occurrence"]))
    assert finite["loss"][-1] != pytest.approx(Observables.load(out / "sgd" / "ode")["loss"][-1], rel=1e-3)  # another loss
    for row in payload["rows"]:  # a row the loss at s moves by more than 5% is marked as the mean-field loss's
        moved = (row["ode"] is not None and row["ode_finite_s"] is not None
                 and abs(row["ode_finite_s"] - row["ode"]) > 0.05 * row["ode"])
        assert ("mean-field prediction: the flow at s moves it" in row["note"]) == moved, row
    assert condensation["theory_vs_sgd"] == pytest.approx(abs(condensation["theory"] - condensation["sgd"]) / condensation["sgd"])
    # the formula tier's column: condensation by the closed form, its error against the ODE on the vocabulary
    assert condensation["formula"] is not None and condensation["formula_vs_ode"] == pytest.approx(
        abs(condensation["formula"] - condensation["ode_full_vocabulary"]) / condensation["ode_full_vocabulary"])
    # each part's time is recorded (which is faster is measured in benchmarks/, not asserted by a test)
    assert {"sgd", "ode", "formula", "theory"} <= set(payload["seconds"])
    assert all(np.isfinite(value) and value > 0 for value in payload["seconds"].values())
    table = (out / "validate.md").read_text()
    assert "| event | token | formula | theory |" in table and f"| condensation - #1 | - | {condensation['formula']:.4g} |" in table
    assert "| ODE at s | SGD |" in table and "derived from the mean-field (s → ∞) loss" in table
    assert (out / "sgd" / "overlay.png").is_file()
    with monkeypatch.context() as patched:  # the run, the ODE and the theory are all reused
        patched.setattr(flowsim.bridge.compare, "solve_flow", lambda *a, **k: pytest.fail("the ODE was integrated again"))
        patched.setattr(flowsim.runs.predictions, "predict_run", lambda *a, **k: pytest.fail("the theory was run again"))
        again = CliRunner().invoke(app, arguments)
    assert again.exit_code == 0, again.output
    assert json.loads((out / "validate.json").read_text())["rows"] == payload["rows"]
    # the flow at s as the run's own ODE: the same two flows, from the same caches, in the same columns
    with monkeypatch.context() as patched:
        patched.setattr(flowsim.bridge.compare, "solve_flow", lambda *a, **k: pytest.fail("a flow was integrated again"))
        patched.setattr(flowsim.runs.predictions, "predict_run", lambda *a, **k: pytest.fail("the theory was run again"))
        own_at_s = CliRunner().invoke(app, [*arguments, "--set", "compare.surrogate_loss='finite_second_order'"])
    assert own_at_s.exit_code == 0, own_at_s.output
    switched = json.loads((out / "validate.json").read_text())
    assert switched["own_loss"] == "finite_second_order" and switched["rows"] == payload["rows"]
    for row in json.loads((out / "sgd" / "compare.json").read_text())["rows"]:  # compare now shows the flow at s
        assert row["predicted"] == finite_events.get((row["stage"], row["query"], row["direction"], row["occurrence"]))
    assert "compare.surrogate_loss = 'finite_second_order'" in (out / "validate.md").read_text()


def test_bridge_validates_theory_says_it_is_at_work_while_it_predicts(monkeypatch):
    """Guards issue 84, item 3: the theory part of `bridge validate` was silent for minutes at d = 1001; it now says
    its seconds every HEARTBEAT_SECONDS (10 s; here shortened) while the prediction runs."""
    import threading
    from types import SimpleNamespace

    import flowsim.bridge.validate as validate_module
    import flowsim.runs.predictions

    said, done = [], threading.Event()

    def slow_prediction(config, progress):
        done.wait(5.0)  # until the second heartbeat, or 5 s at most
        return SimpleNamespace(rows=[], constants="")

    def progress(line):
        said.append(line)
        if len(said) >= 2:
            done.set()

    monkeypatch.setattr(validate_module, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(flowsim.runs.predictions, "cached_prediction", slow_prediction)
    assert validate_module.theory_events(None, None, progress) == ({}, {}, "")
    assert len(said) >= 2 and all(re.fullmatch(r"theory: \d+ s so far", line) for line in said), said


def test_bridge_validate_names_a_corpus_it_does_not_know(tmp_path):
    from typer.testing import CliRunner

    from flowsim.cli import app

    result = CliRunner().invoke(app, ["bridge", "validate", "shakespeare", "--out", str(tmp_path / "v")])
    assert result.exit_code != 0 and "CORPUS must be wikitext2, tinystories or a bridge config .toml, got 'shakespeare'" in result.output
    assert not (tmp_path / "v").exists()


def test_the_shipped_text_examples_run_to_the_whole_cycle_and_short_to_their_first_stages(tmp_path):
    """Each corpus has a cycle example and a --short one; TinyStories's cycle horizon (t = 3000) is the one the
    surrogate's flow put after its second foci (2087-2190), its short one the first stages' (t = 400); --short with a
    config of one's own is refused."""
    from typer.testing import CliRunner

    from flowsim.bridge.validate import example_config
    from flowsim.cli import app

    horizon = lambda path: (lambda c: c.optim.lr * c.optim.steps)(load_bridge_config(path))  # noqa: E731
    assert horizon(example_config("tinystories")) == 3000 and horizon(example_config("tinystories", short=True)) == 400
    assert example_config("wikitext2", short=True).name == "wikitext2-onelayer-short.toml"
    assert set(load_bridge_config(example_config("tinystories")).log.track) == {"day", "you", "loved", "friend"}
    own = tmp_path / "own.toml"
    own.write_text("[optim]\nsteps = 10\n")
    result = CliRunner().invoke(app, ["bridge", "validate", str(own), "--short", "--out", str(tmp_path / "v")])
    assert result.exit_code == 2 and "set its optim.steps instead" in result.output, result.output


def test_bridge_compare_of_a_run_with_too_few_checkpoints_is_refused_before_the_ode_is_solved(tmp_path, monkeypatch):
    """Two steps give two checkpoints after t = 0 (the log-spaced steps coincide): refused in one line, exit 2,
    naming the count and the remedy, with no ODE solved and nothing written beside the run."""
    from typer.testing import CliRunner

    import flowsim.bridge.compare as bridge_compare
    from flowsim.cli import app

    train(load_bridge_config(None, ["optim.steps=2", "data.batch_size=16", "data.s=8", "log.probe_per_type=4"]),
          tmp_path / "run", progress=False)
    monkeypatch.setattr(bridge_compare, "solve_flow", lambda *a, **k: pytest.fail("the ODE was solved"))
    result = CliRunner().invoke(app, ["bridge", "compare", str(tmp_path / "run")])
    assert result.exit_code == 2 and "has 2 checkpoint(s) after t = 0" in result.output and "train more steps" in result.output
    assert not (tmp_path / "run" / "ode").exists() and not (tmp_path / "run" / "compare.json").exists()


def test_a_diverging_run_stops_with_a_clear_error_and_keeps_its_last_good_state(tmp_path):
    config = load_bridge_config(None, ["optim.lr=1e12", "optim.steps=20", "data.batch_size=32", "data.s=8",
                                       "model.init_eps=1.0", "log.n_checkpoints=5", "log.probe_per_type=4"])
    with pytest.raises(FloatingPointError, match="lower optim.lr"):
        train(config, tmp_path / "diverged", progress=False)
    meta = json.loads((tmp_path / "diverged" / "meta.json").read_text())
    assert meta["status_name"] == "non_finite"
    state = read_checkpoint(tmp_path / "diverged" / CHECKPOINT_FILE, "cpu")["model"]
    assert all(torch.isfinite(value).all() for value in state.values())


def test_an_oversized_training_step_is_refused_before_any_data_or_folder(tmp_path, monkeypatch):
    import flowsim.bridge.train as bridge_train
    from flowsim.common.budget import BudgetError

    monkeypatch.setattr(bridge_train, "build_data", lambda config: pytest.fail("the data were built"))
    with pytest.raises(BudgetError, match=r"data.s = 100000.* over the memory budget.*lower data.s"):
        train(load_bridge_config(None, ["data.kind='wikitext2'", "data.s=100000"]), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    small = load_bridge_config(None, ["data.s=16", "data.batch_size=8"])
    big = load_bridge_config(None, ["data.s=32", "data.batch_size=8"])
    assert bridge_train.training_memory_bytes(big, 5) > bridge_train.training_memory_bytes(small, 5) > 0


def test_a_resumed_runs_wall_time_sums_its_sessions_and_its_progress_line_names_what_it_trains_on(tmp_path):
    """meta.json's wall_time_s was the last session's alone: a run resumed for its last steps said about 0 s. The
    progress line said "sgd on tinystories" for a run trained on the corpus's bigram surrogate."""
    settings = ["optim.steps=8", "log.n_checkpoints=4", "data.batch_size=16", "data.s=8", "log.probe_per_type=4"]
    run = tmp_path / "run"
    assert not train(load_bridge_config(None, settings), run, progress=False, stop_at_step=4).finished
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "wall_time_s": 1000.0}))  # as if the first session took 1000 s
    assert train(load_bridge_config(None, settings), run, progress=False).finished
    assert 1000.0 < json.loads((run / "meta.json").read_text())["wall_time_s"] < 1000.0 + 600
    import flowsim.bridge.train as bridge_train

    assert bridge_train.training_data_name(load_bridge_config(None, settings)) == "markov"
    text = load_bridge_config(None, ["data.kind='tinystories'", "data.train_on='surrogate'"])
    assert bridge_train.training_data_name(text) == "the bigram surrogate of tinystories"


def test_compare_on_an_unfinished_bridge_run_says_how_to_resume(tmp_path):
    from flowsim.bridge.compare import compare_bridge_run

    config = load_bridge_config(None, ["optim.steps=20", "log.n_checkpoints=5", "data.batch_size=16", "data.s=8",
                                       "log.probe_per_type=4"])
    train(config, tmp_path / "run", progress=False, stop_at_step=3)
    meta_path = tmp_path / "run" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "status_name": "running", "pid": 2**22 + 12345}))  # a process long gone
    with pytest.raises(ValueError, match=r"has not finished \(status 'interrupted'.*resume it with `flowsim bridge train"):
        compare_bridge_run(tmp_path / "run")


@pytest.mark.slow
def test_the_flow_regime_check_tells_a_small_learning_rate_from_a_large_one(tmp_path):
    """Halving lr (twice the steps) leaves a small-lr run unchanged on the t clock and moves a large-lr one."""
    from typer.testing import CliRunner

    from flowsim.bridge.regime import check_flow_regime, halved_learning_rate
    from flowsim.cli import app

    base = ["data.batch_size=1024", "data.s=16", "log.n_checkpoints=30", "log.probe_per_type=16"]
    small = load_bridge_config(None, [*base, "optim.lr=0.25", "optim.steps=600"])  # t = 150: condensation and focus
    twin = halved_learning_rate(small)
    assert (twin.optim.lr, twin.optim.steps, twin.data) == (0.125, 1200, small.data)
    report = check_flow_regime(small, tmp_path / "small", progress=False)
    assert report.in_flow_regime, report.table()
    assert {row.series.split("[")[0] for row in report.rows} == {"loss", "attention_entropy", "sv_W0"}
    ends = [{row["stage"]: row["t_end"] for row in json.loads((tmp_path / "small" / side / "stages.json").read_text())["intervals"]}
            ["condensation"] for side in ("lr", "lr_half")]  # each run's own label, written when it finished
    condensation = next(onset for onset in report.onsets if onset.event.startswith("condensation"))
    assert (condensation.t_lr, condensation.t_half) == pytest.approx(ends, rel=1e-12)
    assert condensation.shift == pytest.approx(abs(ends[0] - ends[1]) / ends[1]) and condensation.shift < 0.05
    assert "stage events on both runs" in report.table()
    large = [*base, "optim.lr=5.0", "optim.steps=30"]  # the same horizon in 30 steps
    result = CliRunner().invoke(app, ["bridge", "train", "--check-flow-regime", "--quiet", "--out", str(tmp_path / "large"),
                                      *[item for s in large for item in ("--set", s)]])
    assert result.exit_code == 1 and "NOT in the flow regime" in result.output, result.output
    saved = json.loads((tmp_path / "large" / "regime.json").read_text())
    assert saved["in_flow_regime"] is False and saved["worst"]["deviation"] > 0.05


def test_a_corpus_too_small_or_not_utf8_is_refused_naming_it_and_leaving_no_folder(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from flowsim.cli import app

    data = tmp_path / "data" / "wikitext-2"
    data.mkdir(parents=True)
    (data / "valid.txt").write_text("just one line\n")
    (data / "test.txt").write_text("and another\n")
    with pytest.raises(ValueError, match=r"has 3 words, 3 distinct.*data.vocab_size = 100 needs at least"):
        load_corpus("wikitext2", 100, tmp_path / "data")
    (data / "valid.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"valid.txt is not UTF-8 text \(byte 0xe9"):
        load_corpus("wikitext2", 2, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bridge", "train", "--set", "data.kind='wikitext2'", "--set", f"data.data_dir='{tmp_path / 'data'}'"])
    assert result.exit_code == 2 and "is not UTF-8 text" in result.output
    assert not any((tmp_path / "runs").iterdir())


def test_sigint_stops_a_bridge_run_which_the_same_command_continues(tmp_path):
    import signal
    import sys

    from conftest import interrupt_once

    command = [sys.executable, "-m", "flowsim.cli", "bridge", "train", "--out", str(tmp_path / "run"),
               "--set", "optim.steps=200000", "--set", "data.batch_size=16", "--set", "data.s=8", "--set", "log.probe_per_type=4"]
    def training(progress: bytes) -> bool:  # the progress line (stderr is a pipe), labelled with the optimiser, the data and lr
        return b"sgd on markov, lr = 0.1:" in progress and b"/200000 step" in progress

    returncode, stderr = interrupt_once(command, training, signal.SIGINT)
    assert returncode == 130, stderr.decode()
    assert b"interrupted at step" in stderr and f"--out {tmp_path / 'run'} continues it".encode() in stderr
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status_name"] == "interrupted" and 0 <= meta["steps_done"] < 200000  # the signal may come before step 1


@pytest.mark.slow
@needs_data
def test_the_d64_text_example_labels_condensation_beside_the_ode(tmp_path):
    """The shipped WikiText-2 example at d = 64, trained to t = 30 (its condensation ends near t = 13): the run and
    the exact flow of the corpus's bigram surrogate both label condensation, within 15% of each other."""
    from flowsim.bridge.compare import compare_bridge_run

    config = load_bridge_config("configs/bridge/wikitext2-d64.toml", ["optim.steps=600", "log.n_checkpoints=40",
                                                                        f"data.data_dir='{DATA_DIR}'"])
    assert config.data.vocab_size == 63 and config.optim.lr == 0.05
    train(config, tmp_path / "run", progress=False)
    rows, _, _ = compare_bridge_run(tmp_path / "run")
    condensation = [row for row in rows if row.stage == "condensation"]
    assert condensation and condensation[0].predicted is not None and condensation[0].measured is not None, rows
    assert condensation[0].rel_error < 0.15, condensation[0]
    assert (tmp_path / "run" / "overlay.png").stat().st_size > 10_000  # the run beside the ODE


def tiny_surrogate_ode(tmp_path, settings: list[str]):
    """A 20-step WikiText-2 run at d = 8, s = 6 and the surrogate's ODE beside it under ``settings``: (config, the ODE's
    observables, its description, the run's θ(0), the surrogate chain)."""
    from flowsim.bridge.compare import ode_beside
    from flowsim.bridge.surrogate import text_surrogate
    from flowsim.bridge.train import build_data
    from flowsim.runs.rundir import TRAJECTORY_FILE
    from flowsim.solve.trajectory import Trajectory

    config = load_bridge_config(None, ["data.kind='wikitext2'", "data.vocab_size=7", f"data.data_dir='{DATA_DIR}'", "data.s=6",
                                       "data.batch_size=32", "log.fold_d=4", "log.n_checkpoints=4", "log.probe_per_type=4",
                                       "log.val_batches=1", "optim.steps=20", "model.m=4", "model.k=3",
                                       "compare.method='Tsit5'", *settings])
    train(config, tmp_path / "run", progress=False)
    ode, description = ode_beside(tmp_path / "run")
    params0 = Trajectory.load(tmp_path / "run" / TRAJECTORY_FILE).at(0)
    return config, ode, description, params0, text_surrogate(build_data(config).corpus, config.compare)[0]


@needs_data
def test_the_sampled_surrogate_ode_follows_the_chains_loss_at_the_runs_context_length(tmp_path):
    """compare.surrogate_loss = 'sampled': the ODE beside a text run follows the surrogate chain's loss at the run's s on
    compare.samples seeded sequences. Its loss at t = 0 is the torch twin's batch loss on those sequences (another
    route), not the mean-field loss of the same chain."""
    from flowsim.bridge.compare import ode_beside
    from flowsim.bridge.train import batch_loss
    from flowsim.model.losses import population_loss_mean_field

    _, ode, description, params0, chain = tiny_surrogate_ode(tmp_path, ["model.init_eps=0.3", "compare.surrogate_loss='sampled'",
                                                                            "compare.samples=300"])
    assert description["ode"].startswith("loss at s = 6 on 300 sampled sequences of the bigram chain")
    model = OneLayerTransformer(d=8, m=4, k=3)
    twin = torch_model_for(model).load_flowsim_params(params0)
    sampled = batch_loss(twin, torch.as_tensor(chain.sample(300, 7, 0))).item()
    assert float(ode["loss"][0]) == pytest.approx(sampled, rel=1e-10)
    assert abs(sampled - float(population_loss_mean_field(params0, chain, model))) > 1e-4

    # a sample over the memory budget is refused in the bridge's own settings
    from flowsim.config import ConfigError

    config_file = tmp_path / "run" / "config.toml"
    assert "samples = 300" in config_file.read_text()
    config_file.write_text(config_file.read_text().replace("samples = 300", "samples = 1000000000000"))
    with pytest.raises(ConfigError, match=r"over the memory budget .*: lower compare.samples or data.s$"):
        ode_beside(tmp_path / "run")


@needs_data
def test_the_second_order_surrogate_ode_follows_the_chains_loss_at_the_runs_context_length(tmp_path):
    """compare.surrogate_loss = 'finite_second_order': the ODE beside a text run follows the surrogate chain's loss at
    the run's s to second order; its loss at t = 0 is within Monte Carlo error of the torch twin's loss on 20 000
    sequences of the chain, and the description says which loss it is."""
    from flowsim.bridge.train import batch_loss

    _, ode, description, params0, chain = tiny_surrogate_ode(tmp_path, ["model.init_eps=0.5",
                                                                       "compare.surrogate_loss='finite_second_order'"])
    assert description["ode"].startswith("loss at s = 6 to second order in the window's composition on the bigram chain")
    twin = torch_model_for(OneLayerTransformer(d=8, m=4, k=3)).load_flowsim_params(params0)
    sequences = torch.as_tensor(chain.sample(20_000, 7, 1))
    losses = torch.nn.functional.cross_entropy(twin(sequences[:, :-1]), sequences[:, -1], reduction="none")
    sampled, stderr = losses.mean().item(), losses.std().item() / np.sqrt(20_000)
    assert abs(float(ode["loss"][0]) - sampled) < 4 * stderr
    assert batch_loss(twin, sequences).item() == pytest.approx(sampled, rel=1e-10)


def test_the_window_loss_is_the_torch_batch_loss_over_all_windows():
    """flowsim's full-batch window loss against the torch twin's training loss on the same windows, and its
    gradient against the twin's autograd gradient."""
    from flowsim.bridge.train import batch_loss
    from flowsim.model.losses import make_window_loss

    model = OneLayerTransformer(d=5, m=4, k=3)
    params = random_params(model, 0.5, 1)
    windows = np.random.default_rng(2).integers(0, 5, size=(64, 9))
    loss = make_window_loss(model, windows)
    twin = torch_model_for(model).load_flowsim_params(params)
    expected = batch_loss(twin, torch.as_tensor(windows))
    assert float(loss(params)) == pytest.approx(expected.item(), rel=1e-12)
    expected.backward()
    gradient = jax.grad(loss)(params)
    for name, parameter in twin.named_parameters():
        np.testing.assert_allclose(np.asarray(gradient[name]), parameter.grad.numpy(), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="window tokens must lie in 0 .. 4, got 0 .. 5"):
        make_window_loss(model, np.full((3, 4), 5) - np.eye(3, 4, dtype=int) * 5)


@pytest.mark.slow
@needs_data
def test_the_surrogate_gap_benchmark_puts_four_routes_to_one_event_side_by_side(tmp_path):
    """benchmarks/surrogate_gap.py at a tiny size (d = 16, t = 10, 256 windows): the surrogate's flow, the window flow,
    SGD on the text and SGD on the surrogate chain, four independent routes, condense within 5% of each other, and
    σ1 at the end is read off each."""
    from surrogate_gap import four_routes, table

    overrides = ["optim.steps=400", "data.vocab_size=15", "log.track=[]"]
    rows, final = four_routes("wikitext2", overrides, 256, tmp_path, "d64")
    routes = ("surrogate", "text", "sgd", "surrogate_sgd")
    condensation = next(row for row in rows if row["event"].startswith("condensation"))
    sides = [condensation[side] for side in routes]
    assert all(value is not None for value in sides), rows
    assert max(sides) / min(sides) - 1 < 0.05, rows
    assert final["stats"].nfev > 0 and final["windows"] == 256
    assert all(0 < final["σ1 at t_end"][side] < final["restart level"] for side in routes), final
    assert "| condensation - |" in table("wikitext2", rows, final)


@pytest.mark.slow
@needs_data
def test_the_device_check_script_runs_end_to_end_within_its_budget(tmp_path):
    """benchmarks/gpu_validation.sh on this CPU at a tiny size (d = 32, t = 8; a 2-layer GPT of width 16): both
    corpora at three learning rates beside their ODE, the GPT study, and the few small files it promises."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_validation.sh"
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_BUDGET": "400", "FLOWSIM_DATA_DIR": str(DATA_DIR),
           # the script calls `python`: this interpreter's, whether or not its environment is activated
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "GPU_CHECK_TEXT": "--set data.vocab_size=31 --set log.track=[] --set optim.steps=64",
           "GPU_CHECK_GPT": "--set model.n_layer=2 --set model.d_model=16 --set model.n_head=2 --set optim.steps=20 "
                            "--set data.vocab_size=31"}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(script), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(path.name for path in out.iterdir()) == ["gpt-study.json", "log.txt", "summary.md",
                                                           "tinystories-overlay.png", "wikitext2-overlay.png"]
    summary = (out / "summary.md").read_text()
    assert summary.count("| run lr | run lr/2 | run 2 lr |") == 2 and "### tinystories" in summary and "### wikitext2" in summary
    assert "gpt-mlp" in summary and "no table" not in summary
    assert set(json.loads((out / "gpt-study.json").read_text())) == {"tinystories"}
    assert "cut at" not in (out / "log.txt").read_text().split("--- ")[0]


def test_a_full_disk_during_bridge_training_is_one_line_and_the_run_continues_later(tmp_path, monkeypatch):
    """ENOSPC on the first checkpoint of a small Markov run: one line naming the file, exit 1; the same command
    afterwards trains the run to its end."""
    import errno

    from typer.testing import CliRunner

    import flowsim.bridge.train as bridge_train
    from flowsim.cli import app

    real = bridge_train.write_atomic_bytes

    def full(path, *args, **kwargs):
        if str(path).endswith(CHECKPOINT_FILE):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    command = ["bridge", "train", "--quiet", "--out", str(tmp_path / "run"), "--set", "optim.steps=40", "--set",
               "data.batch_size=16", "--set", "data.s=8", "--set", "log.probe_per_type=4"]
    with monkeypatch.context() as patched:
        patched.setattr(bridge_train, "write_atomic_bytes", full)
        result = CliRunner().invoke(app, command)
    last = result.output.strip().splitlines()[-1]
    assert result.exit_code == 1 and last.startswith("flowsim: error: no space left on device while writing "), result.output
    assert CHECKPOINT_FILE in last and "make room and run the same command again" in last
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0 and json.loads((tmp_path / "run" / "meta.json").read_text())["status_name"] == "finished", result.output


def test_a_bridge_run_whose_summary_could_not_be_written_is_not_called_finished(tmp_path, monkeypatch):
    """The disk fills while the summary figure is written: meta.json does not say "finished", and the same command
    afterwards writes the figure and then says so."""
    import errno

    from typer.testing import CliRunner

    import flowsim.runs.plots as plots
    from flowsim.cli import app

    def full(observables, path, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    command = ["bridge", "train", "--quiet", "--out", str(tmp_path / "run"), "--set", "optim.steps=40", "--set",
               "data.batch_size=16", "--set", "data.s=8", "--set", "log.probe_per_type=4"]
    with monkeypatch.context() as patched:
        patched.setattr(plots, "plot_run_summary", full)
        assert CliRunner().invoke(app, command).exit_code == 1
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["status_name"] != "finished"
    assert not (tmp_path / "run" / "summary.png").exists()
    assert CliRunner().invoke(app, command).exit_code == 0
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["status_name"] == "finished"
    assert (tmp_path / "run" / "summary.png").stat().st_size > 0


@pytest.mark.slow  # a SIGINT mid-run and its resume are checked in the default selection above
def test_a_bridge_run_killed_at_a_random_moment_resumes_to_the_uninterrupted_observables(tmp_path):
    """SIGKILL (no chance to save) at a seeded random moment after the first checkpoint, then the same command:
    the final observables and log equal an uninterrupted run's bit for bit on this CPU (batches are drawn by step,
    and the checkpoint holds the model, optimiser and scheduler)."""
    import signal
    import subprocess
    import sys
    import time

    import numpy as np

    # long enough that the kill, up to 2 s after the first checkpoint, lands before the last step (1500 steps did not)
    settings = ["--set", "optim.steps=6000", "--set", "data.batch_size=16", "--set", "data.s=8", "--set", "log.probe_per_type=4"]
    base = [sys.executable, "-m", "flowsim.cli", "bridge", "train", "--quiet", *settings]
    subprocess.run([*base, "--out", str(tmp_path / "whole")], check=True, capture_output=True)
    killed = tmp_path / "killed"
    process = subprocess.Popen([*base, "--out", str(killed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while not (killed / CHECKPOINT_FILE).is_file():
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    time.sleep(np.random.default_rng(7).uniform(0.0, 2.0))
    process.send_signal(signal.SIGKILL)
    process.wait()
    steps_done = json.loads((killed / "meta.json").read_text()).get("steps_done")
    subprocess.run([*base, "--out", str(killed)], check=True, capture_output=True)
    assert steps_done is not None and steps_done < 6000
    whole, resumed = np.load(tmp_path / "whole" / "observables.npz"), np.load(killed / "observables.npz")
    assert sorted(whole.files) == sorted(resumed.files)
    for name in whole.files:
        assert np.array_equal(whole[name], resumed[name]), name
    assert (tmp_path / "whole" / "log.csv").read_text() == (killed / "log.csv").read_text()


def test_a_stop_request_during_the_odes_solve_stops_bridge_compare_with_nothing_written(tmp_path, monkeypatch):
    """A Ctrl-C while `flowsim bridge compare` solves the ODE reaches the solver (a diffrax solve is one compiled call,
    which the signal handler alone cannot enter): the solve stops at its first poll, nothing is cached or written,
    one line says so, exit 130."""
    import contextlib

    from typer.testing import CliRunner

    import flowsim.bridge.compare as bridge_compare
    from flowsim.cli import app
    from flowsim.common.interrupts import StopRequest

    config = load_bridge_config(None, ["optim.steps=40", "data.batch_size=16", "data.s=8", "log.n_checkpoints=4",
                                       "log.probe_per_type=4", "compare.method='Tsit5'"])
    train(config, tmp_path / "run", progress=False)

    class AskedAtOnce(StopRequest):  # as if Ctrl-C came as the solve began; counts who asks
        asked = 0

        def __call__(self) -> bool:
            AskedAtOnce.asked += 1
            return True

    monkeypatch.setattr(bridge_compare, "stop_requests", lambda: contextlib.nullcontext(AskedAtOnce()))
    result = CliRunner().invoke(app, ["bridge", "compare", str(tmp_path / "run")])
    assert result.exit_code == 130, result.output
    assert result.output.strip().splitlines()[-1] == ("flowsim: interrupted before the ODE was solved: nothing was "
                                                      "written; the same command solves it again")
    assert AskedAtOnce.asked >= 2  # the solver polled it (diffrax's event), then the command read it
    assert not (tmp_path / "run" / bridge_compare.ODE_DIR / bridge_compare.ODE_JSON).exists()
    assert not (tmp_path / "run" / bridge_compare.BRIDGE_COMPARE_JSON).exists()


@pytest.mark.slow
def test_bridge_train_logged_to_a_file_writes_a_line_every_five_percent(tmp_path):
    """stderr redirected to a file: the training's progress is at most 20 plain lines, not a redrawn bar."""
    import subprocess
    import sys

    settings = ["--set", "optim.steps=400", "--set", "data.batch_size=16", "--set", "data.s=8", "--set", "log.probe_per_type=4"]
    with open(tmp_path / "log", "w") as log:
        subprocess.run([sys.executable, "-m", "flowsim", "bridge", "train", *settings, "--out", str(tmp_path / "run")],
                       stderr=log, stdout=subprocess.DEVNULL, check=True, timeout=300)
    text = (tmp_path / "log").read_text()
    lines = [line for line in text.splitlines() if line.startswith("sgd on markov, lr = ")]
    assert "\r" not in text and len(lines) == 21, text  # a first line at 0%, then one every 5%
    assert lines[-1].startswith("sgd on markov, lr = 0.1: 100% (400/400 step, t = lr × step = 40; validation loss "), lines[-1]
    for line in lines[1:]:  # t is the step's own, the loss's t its checkpoint's (once the last checkpoint's t for both)
        step, t, checkpoint_t = re.search(r"\((\d+)/400 step, t = lr × step = ([\d.]+); validation loss [\d.]+ at the "
                                          r"last checkpoint \(t = ([\d.]+)\)\)", line).groups()
        assert float(t) == pytest.approx(0.1 * int(step)) and float(checkpoint_t) <= float(t), line


def test_bridge_training_on_a_cpu_runs_one_torch_thread_unless_told(tmp_path, monkeypatch):
    """torch's default of a thread per core made a step 20-35 times slower on a shared machine: a CPU run trains on
    one thread, says so in meta.json, and $FLOWSIM_TORCH_THREADS sets another count (a bad one is named)."""
    import torch

    from flowsim.bridge.train import THREADS_VARIABLE

    settings = ["optim.steps=4", "data.batch_size=8", "data.s=8", "log.probe_per_type=4", "log.n_checkpoints=3",
                "data.device='cpu'"]
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(THREADS_VARIABLE, raising=False)
    try:
        torch.set_num_threads(2)
        train(load_bridge_config(None, settings), tmp_path / "one", progress=False)
        assert torch.get_num_threads() == 1
        assert json.loads((tmp_path / "one" / "meta.json").read_text())["torch_threads"] == 1
        monkeypatch.setenv(THREADS_VARIABLE, "2")
        train(load_bridge_config(None, settings), tmp_path / "two", progress=False)
        assert json.loads((tmp_path / "two" / "meta.json").read_text())["torch_threads"] == 2
        monkeypatch.setenv(THREADS_VARIABLE, "many")
        with pytest.raises(flowsim.config.ConfigError, match=r"\$FLOWSIM_TORCH_THREADS = 'many': expected a number of threads >= 1"):
            train(load_bridge_config(None, settings), tmp_path / "bad", progress=False)
        assert not (tmp_path / "bad").exists()
    finally:
        torch.set_num_threads(before)


def test_a_corpus_of_your_own_trains_as_data_kind_text(tmp_path):
    """data.kind = 'text': two UTF-8 files, tokenised as TinyStories (lower-cased words, punctuation marks), train a
    one-layer run; the kind needs both files, and the files need the kind."""
    story = "the cat sat on the mat. the dog saw the cat, and the cat ran. a bird sang to the dog.\n\n"
    (tmp_path / "train.txt").write_text(story * 40)
    (tmp_path / "valid.txt").write_text(story * 4)
    settings = ["data.kind='text'", f"data.train_file='{tmp_path / 'train.txt'}'", f"data.valid_file='{tmp_path / 'valid.txt'}'",
                "data.vocab_size=8", "data.s=8", "data.batch_size=16", "optim.steps=20", "log.n_checkpoints=5",
                "log.probe_per_type=4", "log.fold_d=4"]
    config = load_bridge_config(None, settings)
    assert config.data.train_file == str(tmp_path / "train.txt")
    relative = load_bridge_config(None, ["data.kind='text'", "data.train_file='t.txt'", "data.valid_file='v.txt'"])
    assert relative.data.train_file == str(Path.cwd() / "t.txt")  # saved absolute: resumable from anywhere
    corpus = load_corpus("text", 8, files=(tmp_path / "train.txt", tmp_path / "valid.txt"))
    assert corpus.vocabulary[:4] == ("<unk>", "the", "cat", ".") and len(corpus.train) == 40 * 25
    assert train(config, tmp_path / "run", progress=False).finished
    with pytest.raises(ValueError, match="data.kind = 'text' reads your own corpus: set data.train_file and data.valid_file"):
        load_bridge_config(None, ["data.kind='text'"])
    with pytest.raises(ValueError, match="read with data.kind = 'text' only, got data.kind = 'wikitext2'"):
        load_bridge_config(None, ["data.kind='wikitext2'", "data.train_file='a.txt'", "data.valid_file='b.txt'"])
    with pytest.raises(flowsim.config.ConfigError, match="text: data.train_file .*nowhere.txt' not found; expected a UTF-8 text file"):
        train(load_bridge_config(None, [*settings[:1], "data.train_file='nowhere.txt'", *settings[2:]]), tmp_path / "x", progress=False)


def test_a_row_the_flow_at_s_moves_by_more_than_5_percent_is_marked_a_mean_field_prediction():
    from flowsim.bridge.validate import loss_moves

    assert loss_moves(100.0, 104.9) == "" and loss_moves(None, 300.0) == "" and loss_moves(100.0, None) == ""
    assert loss_moves(1400.0, 250.0) == "mean-field prediction: the flow at s moves it 82%"


@needs_data
@pytest.mark.slow
def test_the_folded_surrogate_ode_runs_on_jaxbdf_with_exact_products_and_matches_an_explicit_solve(tmp_path):
    """compare.kept_types below d: the surrogate's second-order loss with the folded covariance, whose Hessian leaves
    the traces' curvature out, is integrated by JaxBDF with exact products ("auto"); its losses along the flow are an
    explicit method's (Tsit5, which uses no Jacobian) on the same loss, and its start is that loss at θ(0)."""
    from flowsim.model.flow import GradientFlow
    from flowsim.model.losses import make_loss_function
    from flowsim.solve.solvers import solve_flow

    config, ode, description, params0, chain = tiny_surrogate_ode(
        tmp_path, ["model.init_eps=0.5", "compare.surrogate_loss='finite_second_order'", "compare.kept_types=3",
                   "compare.method='auto'"])
    assert "(Markov correlations among the 3 most frequent types)" in description["ode"]
    assert description["method"] == "JaxBDF"
    loss = make_loss_function(OneLayerTransformer(d=8, m=4, k=3), chain, "finite_second_order", 6, kept_types=3)
    assert float(ode["loss"][0]) == pytest.approx(float(loss(params0)), rel=1e-12)
    explicit = solve_flow(GradientFlow(loss, params0), params0, np.asarray(ode.t), method="Tsit5", rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.asarray(ode["loss"]), np.asarray(explicit.trajectory.loss), rtol=1e-5)


def test_the_flow_at_s_is_folded_where_its_covariance_does_not_fit_only_when_asked(monkeypatch):
    """validate's flow at s: every type's correlations where the d³ covariance fits; over the memory budget, none
    unless --flow-at-s asks, then FINITE_S_KEPT types', and the note says which; an explicit compare.kept_types
    is used as given."""
    from flowsim.bridge import validate as validate_module
    from flowsim.common.budget import BUDGET_VARIABLE

    config = load_bridge_config(None, ["data.kind='wikitext2'", "data.vocab_size=31", "model.m=4", "model.k=3", "data.s=16"])
    assert validate_module.flow_at_s_fold(config, folded=False) == (None, "")
    monkeypatch.setenv(BUDGET_VARIABLE, "0.0005")  # 500 kB: d = 32's d³ covariance (1 MB) does not fit, its fold does
    monkeypatch.setattr(validate_module, "FINITE_S_KEPT", 8)
    kept, note = validate_module.flow_at_s_fold(config, folded=False)
    assert kept is None and note.startswith("no finite-s flow") and note.endswith("--flow-at-s folds it to the 8 most "
                                                                                  "frequent types")
    assert validate_module.flow_at_s_fold(config, folded=True) == (
        8, "the flow at s keeps the Markov correlations among the 8 most frequent types only")
    explicit = load_bridge_config(None, ["data.kind='wikitext2'", "data.vocab_size=31", "model.m=4", "model.k=3",
                                         "data.s=16", "compare.kept_types=4"])
    assert validate_module.flow_at_s_fold(explicit, folded=False)[0] == 4


def test_a_cached_flow_is_keyed_only_on_the_compare_settings_its_loss_reads():
    """Changing compare.samples does not recompute the mean-field or second-order flow, compare.kept_types not the
    mean-field or sampled one; each changes the key of the loss that reads it."""
    from flowsim.bridge.compare import settings_read
    from flowsim.bridge.config import CompareConfig

    def key(**settings):
        return settings_read(CompareConfig(**settings))

    assert key(samples=1024) == key() and key(kept_types=32) == key()
    assert key(surrogate_loss="finite_second_order", samples=1024) == key(surrogate_loss="finite_second_order")
    assert key(surrogate_loss="finite_second_order", kept_types=32) != key(surrogate_loss="finite_second_order")
    assert key(surrogate_loss="finite_control_variate", samples=1024) != key(surrogate_loss="finite_control_variate")
    assert key(surrogate_loss="sampled", kept_types=32) == key(surrogate_loss="sampled")
    assert key(rtol=1e-6) != key()  # a setting every flow reads


class _RunsCode:
    """A pickle payload that calls os.makedirs(path) when unpickled without restriction."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        import os

        return os.makedirs, (self.path,)


def test_a_checkpoint_is_loaded_without_running_anything_in_it(tmp_path, monkeypatch):
    """Guards issue 83, item 1: resuming read checkpoint.pt with weights_only=False, so a checkpoint whose pickle
    calls os.makedirs ran it. Now such a file, and one that loads but is not the checkpoint mapping, is named as
    damaged in one line (exit 2) and nothing in it runs; a checkpoint written by this code still resumes."""
    from typer.testing import CliRunner

    from flowsim.cli import app

    settings = ["optim.steps=12", "log.n_checkpoints=4", "data.batch_size=16", "data.s=8", "log.probe_per_type=4"]
    run = tmp_path / "run"
    assert not train(load_bridge_config(None, settings), run, progress=False, stop_at_step=5).finished
    good = (run / CHECKPOINT_FILE).read_bytes()
    command = ["bridge", "train", "--quiet", "--out", str(run), *(arg for s in settings for arg in ("--set", s))]
    marker = tmp_path / "made-by-the-checkpoint"
    torch.save({"model": _RunsCode(str(marker))}, run / CHECKPOINT_FILE)
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2 and not marker.exists(), result.output
    assert re.search(r"checkpoint.pt is damaged \(it names (os|posix).makedirs, code that loading would run: refused\)",
                     result.output)
    assert len(result.output.strip().splitlines()) == 1
    for payload, found in (([1, 2, 3], "a list"), ({"model": {}, "step": "5"}, "no optimizer, scheduler, step")):
        torch.save(payload, run / CHECKPOINT_FILE)
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2 and f"not a bridge checkpoint: {found}" in result.output, result.output
    (run / CHECKPOINT_FILE).write_bytes(good)
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0 and "finished at step 12" in result.output, result.output


def test_a_text_of_your_own_is_cut_into_words_of_any_script_and_ascii_text_as_before():
    """Guards issue 83, item 10: data.kind = 'text' was tokenised with [a-z0-9']+, so "Привет" became six tokens and
    "café" `caf` + `é`, silently. Now its words are Unicode words (letters, digits, combining marks, apostrophes within
    them), NFC first; on ASCII text the tokens are TinyStories' as before, shown on the ASCII lines of the shared
    corpora (TinyStories keeps its own tokenizer: its sample's mis-encoded quotes would glue to words)."""
    from flowsim.bridge.data import ASCII_WORDS, tokenize

    text = "Le café d'Émile, über-groß! Привет, мир: Ёлка's. Cafe\u0301 ça_va"
    assert tokenize("text", text) == ["le", "café", "d'émile", ",", "über", "-", "groß", "!", "привет", ",", "мир", ":",
                                      "ёлка's", ".", "café", "ça", "_", "va"]
    assert tokenize("tinystories", "café") == ["caf", "é"]  # unchanged: its shipped runs were measured with it
    lines = ["Once upon a time, Tom's dog ran_away -- fast!!! 3.14 'quoted' [x] {y} #tag @me ~ok~"]
    if DATA_DIR is not None:
        for name in ("tinystories/valid-sample.txt", "wikitext-2/valid.txt"):
            lines += [line for line in (DATA_DIR / name).read_text(encoding="utf-8").splitlines()[:20000] if line.isascii()]
    assert len(lines) > 1 or DATA_DIR is None
    for line in lines:
        assert tokenize("text", line) == ASCII_WORDS.findall(line.lower()), line


def test_a_text_too_short_for_a_window_is_refused_before_the_folder_is_written(tmp_path):
    """Guards issue 83, item 11: a validation file shorter than a window was refused only after config.toml was
    written, so the corrected command (a smaller data.s) was then refused as "a different configuration"; with exactly
    s + 1 words the message read "9 tokens, fewer than a window of 9". Now it is refused before anything is written,
    saying how many tokens a window needs, and the corrected command runs in the same folder."""
    from typer.testing import CliRunner

    from flowsim.cli import app

    (tmp_path / "train.txt").write_text("the cat sat on the mat . the dog saw the cat , and the cat ran .\n" * 40)
    (tmp_path / "valid.txt").write_text("one two three four five six seven eight nine")
    run = tmp_path / "run"
    command = ["bridge", "train", "--quiet", "--out", str(run)] + [arg for s in (
        "data.kind='text'", f"data.train_file='{tmp_path / 'train.txt'}'", f"data.valid_file='{tmp_path / 'valid.txt'}'",
        "data.vocab_size=8", "data.batch_size=16", "optim.steps=10", "log.n_checkpoints=4", "log.probe_per_type=4",
        "log.fold_d=4") for arg in ("--set", s)]
    result = CliRunner().invoke(app, [*command, "--set", "data.s=8"])
    assert result.exit_code == 2, result.output
    assert (f"the validation text ({tmp_path / 'valid.txt'}) has 9 tokens; windows of data.s + 1 = 9 tokens at random "
            "offsets need at least 10: lower data.s or use a longer text") in result.output
    assert not (run / "config.toml").exists()
    result = CliRunner().invoke(app, [*command, "--set", "data.s=4"])
    assert result.exit_code == 0 and "finished at step 10" in result.output, result.output


def test_a_text_runs_files_are_checked_as_files_and_followed_when_they_move(tmp_path, monkeypatch):
    """Guards issue 83, item 12: data.train_file naming a folder, /dev/null or "" said "not found"; valid_file equal to
    train_file passed without a note; a text run would not resume once its files moved (their paths were part of the
    run's identity). Now each is named for what it is, the shared file is a warning, and a moved corpus resumes while
    a changed one is refused."""
    from typer.testing import CliRunner

    from flowsim.cli import app

    text = "the cat sat on the mat . the dog saw the cat , and the cat ran .\n"
    (tmp_path / "train.txt").write_text(text * 40)
    (tmp_path / "valid.txt").write_text(text * 4)
    base = ["data.kind='text'", "data.vocab_size=8", "data.s=8", "data.batch_size=16", "optim.steps=10",
            "log.n_checkpoints=4", "log.probe_per_type=4", "log.fold_d=4"]

    def bridge(out, train_file, valid_file, *more):
        sets = [*base, f"data.train_file='{train_file}'", f"data.valid_file='{valid_file}'", *more]
        return CliRunner().invoke(app, ["bridge", "train", "--quiet", "--out", str(out), *(a for s in sets for a in ("--set", s))])

    for bad, said in ((tmp_path, "is a folder; expected a UTF-8 text file"),
                      ("/dev/null", "is not a regular file (a device or a FIFO); expected a UTF-8 text file"),
                      ("", "data.train_file is empty: expected the path of a UTF-8 text file")):
        result = bridge(tmp_path / "bad", bad, tmp_path / "valid.txt")
        assert result.exit_code == 2 and said in result.output and "not found" not in result.output, result.output
    same = bridge(tmp_path / "same", tmp_path / "train.txt", tmp_path / "train.txt", "optim.steps=2")
    assert same.exit_code == 0, same.output
    assert "flowsim: warning: data.valid_file is data.train_file: the validation loss is measured on the training text" in same.output
    run = tmp_path / "run"
    assert train(load_bridge_config(None, [*base, f"data.train_file='{tmp_path / 'train.txt'}'",
                                           f"data.valid_file='{tmp_path / 'valid.txt'}'"]), run, progress=False, stop_at_step=4)
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("train.txt", "valid.txt"):
        (tmp_path / name).rename(moved / name)
    resumed = bridge(run, moved / "train.txt", moved / "valid.txt")
    assert resumed.exit_code == 0 and "finished at step 10" in resumed.output, resumed.output
    assert f"train_file = \"{moved / 'train.txt'}\"" in (run / "config.toml").read_text()  # the run now names where they lie
    (moved / "other.txt").write_text(text.replace("cat", "cow") * 4)
    changed = bridge(run, moved / "train.txt", moved / "other.txt")
    assert changed.exit_code == 2, changed.output
    assert f"data.valid_file '{moved / 'other.txt'}' holds another text than {run} was trained on" in changed.output


def test_the_shipped_text_example_trains_on_any_utf8_file_named_on_the_command_line(tmp_path, monkeypatch):
    """configs/bridge/text-example.toml with its two files given as bare --set words, as its header shows (here at a
    small size): the paths are read from the working directory and saved absolute."""
    from typer.testing import CliRunner

    from flowsim.cli import app

    story = "Don't stop. The cat sat on the mat; the dog saw the cat, and the cat ran. A bird sang to the dog.\n"
    (tmp_path / "mine.txt").write_text(story * 60)
    (tmp_path / "mine-valid.txt").write_text(story * 6)
    monkeypatch.chdir(tmp_path)
    small = ["data.vocab_size=8", "data.s=8", "optim.steps=20", "log.n_checkpoints=5", "log.fold_d=4", "log.probe_per_type=4"]
    arguments = ["bridge", "train", "configs/bridge/text-example.toml", "--set", "data.train_file=mine.txt",
                 "--set", "data.valid_file=mine-valid.txt", *[item for s in small for item in ("--set", s)], "--out", "run",
                 "--quiet"]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    saved = load_bridge_config(tmp_path / "run" / "config.toml")
    assert saved.data.kind == "text" and saved.data.train_file == str(tmp_path / "mine.txt")
