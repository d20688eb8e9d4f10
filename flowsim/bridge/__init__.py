"""The torch bridge: flowsim's models in PyTorch, real pretraining runs on Markov data,
WikiText-2 and TinyStories, and their comparison with the ODE.

Needs the optional extra: ``pip install 'flowsim[bridge]'`` (torch). The package only checks that torch is there
(importing it takes seconds, which ``flowsim config --bridge`` need not spend); the modules that use it import it."""

import importlib.util

try:
    _found = importlib.util.find_spec("torch") is not None
except ImportError:  # a finder that refuses torch outright, as tests/without_torch.py installs
    _found = False
if not _found:  # pragma: no cover - exercised only without torch
    raise ImportError("flowsim.bridge needs torch; install it with: pip install 'flowsim[bridge]'")
