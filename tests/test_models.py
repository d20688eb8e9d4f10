"""flowsim.model.models: the type-weight route equals the positional forward pass, models are built
from their [model] section, small products fuse without changing the function."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_params

from flowsim.config import ConfigError, load_config
from flowsim.model.models import OneLayerTransformer, TwoLayerTransformer, model_from_config


@pytest.mark.parametrize("model", [OneLayerTransformer(d=4, m=3, k=2), OneLayerTransformer(d=4, m=3, k=2, residual=True,
                                   value_matrix=True, logit_scale="inv_sqrt_k"), TwoLayerTransformer(d=4, m=3, k=2, ffn="glu")],
                         ids=["one_layer", "one_layer_options", "two_layer_glu"])
def test_logits_depend_on_a_context_only_through_counts_and_query(model):
    """The positional forward pass over a sequence equals attention over its type counts."""
    params = random_params(model, scale=0.8, seed=1)
    tokens = np.random.default_rng(2).integers(0, 4, size=(6, 7))
    counts = np.stack([np.bincount(row, minlength=4) for row in tokens]).astype(float)
    with np.errstate(divide="ignore"):
        log_counts = np.log(counts)
    positional = model.forward(params, jnp.asarray(tokens))
    by_types = model.logits_over_types(params, jnp.asarray(log_counts), jnp.asarray(tokens[:, -1]))
    np.testing.assert_allclose(positional, by_types, rtol=1e-12, atol=1e-12)
    shuffled = np.concatenate([np.random.default_rng(3).permuted(tokens[:, :-1], axis=1), tokens[:, -1:]], axis=1)
    np.testing.assert_allclose(model.forward(params, jnp.asarray(shuffled)), positional, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model", [OneLayerTransformer(d=5, m=3, k=2), OneLayerTransformer(d=5, m=3, k=2, residual=True,
                                   value_matrix=True, logit_scale="inv_sqrt_k")], ids=["one_layer", "one_layer_options"])
def test_the_mean_field_logits_are_every_querys_type_weight_logits_at_pi(model):
    """The mean field uses Φ whole; the type-weight route gathers it per query. Values and gradients agree."""
    import jax

    params = random_params(model, scale=0.8, seed=5)
    pi = jnp.asarray([0.35, 0.25, 0.2, 0.15, 0.05])

    def per_query(params):
        return model.logits_over_types(params, jnp.broadcast_to(jnp.log(pi), (5, 5)), jnp.arange(5))

    np.testing.assert_allclose(model.mean_field_logits(params, pi), per_query(params), rtol=1e-13, atol=1e-14)
    weights = jnp.asarray(np.random.default_rng(6).normal(size=(5, 5)))
    gradient = jax.grad(lambda params: jnp.sum(weights * model.mean_field_logits(params, pi)))(params)
    expected = jax.grad(lambda params: jnp.sum(weights * per_query(params)))(params)
    for name in params:
        np.testing.assert_allclose(gradient[name], expected[name], rtol=1e-12, atol=1e-13)


def test_models_are_built_from_their_section():
    one = model_from_config(load_config(None, ["model.m=3", "model.residual=true", "model.ffn=glu"]).model, 5)
    assert one == OneLayerTransformer(d=5, m=3, k=8, residual=True)  # a one-layer model has no FFN: ignored
    two = model_from_config(load_config(None, ["model.kind=two_layer", "model.ffn=mlp", "model.ffn_width=7"]).model, 3)
    assert two == TwoLayerTransformer(d=3, ffn="mlp", ffn_width=7) and "W_in" in two.shapes
    with pytest.raises(ConfigError, match="model.d must be >= 2"):
        model_from_config(load_config().model, 1)


def test_fused_products_are_an_evaluation_choice_of_the_same_model():
    model = TwoLayerTransformer(d=4, m=3, k=2, ffn="mlp")
    fused = TwoLayerTransformer(d=4, m=3, k=2, ffn="mlp", fused_products=True)
    params = random_params(model, scale=0.8, seed=4)
    pi = jnp.asarray([0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(fused.mean_field_logits(params, pi), model.mean_field_logits(params, pi), rtol=1e-13)
    assert fused.shapes == model.shapes


def test_bad_parameters_are_named():
    model = OneLayerTransformer(d=4, m=3, k=2)
    params = random_params(model, scale=1.0, seed=0)
    with pytest.raises(ValueError, match=r"W_Q has shape \(3, 3\), expected \(3, 2\)"):
        model.check_params({**params, "W_Q": np.zeros((3, 3))})
    with pytest.raises(ValueError, match="do not match"):
        model.check_params({name: value for name, value in params.items() if name != "W1"})
    with pytest.raises(ValueError, match="init.eps"):
        model.init(-1.0, 0)
