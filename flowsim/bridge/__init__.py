"""The torch bridge: flowsim's models in PyTorch, real pretraining runs on Markov data,
WikiText-2 and TinyStories, and their comparison with the ODE.

Needs the optional extra: ``pip install 'flowsim[bridge]'`` (torch)."""

try:
    import torch  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only without torch
    raise ImportError("flowsim.bridge needs torch; install it with: pip install 'flowsim[bridge]'") from error
