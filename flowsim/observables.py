"""Observables computed along a trajectory (more arrive with the stage detectors)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flowsim.losses import mean_field_attention
from flowsim.models import OneLayerTransformer
from flowsim.trajectory import Trajectory


def singular_values(matrices: np.ndarray) -> np.ndarray:
    """Singular values, descending, of each matrix in a stack of shape (T, a, b)."""
    return np.linalg.svd(np.asarray(matrices), compute_uv=False)


def attention_along(trajectory: Trajectory, model: OneLayerTransformer, pi: np.ndarray) -> np.ndarray:
    """The mean-field attention matrix A(t) = softmax(Φ(t) + log π), shape (T, d, d)."""
    phi = jax.vmap(model.attention_logits)({name: jnp.asarray(v) for name, v in trajectory.params.items()})
    return np.asarray(jax.vmap(mean_field_attention, in_axes=(0, None))(phi, jnp.asarray(pi)))


def attention_entropy(attention: np.ndarray) -> np.ndarray:
    """Entropy (nats) of each query's attention row: -Σ_j A[i, j] log A[i, j], shape (..., d)."""
    safe = np.where(attention > 0, attention, 1.0)
    return -np.sum(attention * np.log(safe), axis=-1)
