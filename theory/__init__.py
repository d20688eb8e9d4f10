"""Symbolic theory of the one-layer mean-field flow: stage-wise linearisations and predicted onsets.

Stage I (``theory.origin``), Stage II (``theory.focus``), the reduced flow on the rank-r
manifolds (``theory.manifold``), the block off them (``theory.transverse``), Stage IV
(``theory.restart``) and the stages chained through every restart (``theory.cycles``). sympy
derives them (``theory.symbolic`` and the ``*_expression`` functions, d = 2 to 5) and checks the
closed forms the predictions evaluate at any vocabulary size (``theory.mean_field``);
``theory.predict`` assembles them for a run configuration.
"""

import flowsim  # noqa: F401,E402  (sets JAX to float64 before any theory module traces)
