"""Symbolic theory of the one-layer mean-field flow: stage-wise linearisations and predicted onsets.

Stage I (``theory.origin``), Stage II (``theory.focus``), the reduced flow on the rank-r
manifolds (``theory.manifold``), the block off them (``theory.transverse``), Stage IV
(``theory.restart``) and the stages chained through every restart (``theory.cycles``), all
built on the sympy model of ``theory.symbolic``; ``theory.predict`` assembles them for a run
configuration.
"""

import flowsim  # noqa: F401,E402  (sets JAX to float64 before any theory module traces)
