"""The run summary figure: loss, singular values of W0, attention entropy per query."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: runs happen on machines without a screen
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from flowsim.observables import Observables  # noqa: E402


def plot_run_summary(observables: Observables, path: Path, title: str = "") -> Path:
    """Three panels against t (log axis, t > 0): loss; σ_i(W0); entropy of each query's attention."""
    keep = observables.t > 0
    t = observables.t[keep]
    sigma = observables["sv_W0"][keep]
    entropy = observables["attention_entropy"][keep]
    pi = observables.constants["pi"]

    figure, axes = plt.subplots(3, 1, figsize=(7.5, 8.5), sharex=True, constrained_layout=True)
    axes[0].plot(t, observables["loss"][keep], color="black")
    axes[0].set_ylabel("population loss")
    for i in range(sigma.shape[1]):
        axes[1].plot(t, sigma[:, i], label=f"σ{i + 1}")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("singular values of W0")
    axes[1].legend(fontsize="small", ncol=min(4, sigma.shape[1]))
    for query in range(entropy.shape[1]):
        axes[2].plot(t, entropy[:, query], label=f"query {query} (π={pi[query]:.3g})")
    axes[2].axhline(np.log(len(pi)), color="grey", lw=0.5, ls=":")
    axes[2].set_ylabel("attention entropy (nats)")
    axes[2].set_xlabel("t (learning rate × steps)")
    axes[2].set_xscale("log")
    axes[2].legend(fontsize="small")
    if title:
        axes[0].set_title(title, fontsize="medium")
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    temporary.replace(path)
    return path
