"""Symbolic theory of the one-layer mean-field flow: stage-wise linearisations and predicted onsets.

Stage I (``theory.origin``), Stage II (``theory.focus``), the reduced flow on the rank-r
manifolds (``theory.manifold``), Stage IV (``theory.restart``), all built on the sympy
model of ``theory.symbolic``; ``theory.predict`` assembles them for a run configuration.
"""
