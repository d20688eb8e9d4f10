"""The observe layer: observables of a trajectory (``observables``, per model family in ``families``), the stage
detectors (``stages``) and the two-layer specialisation measures (``specialisation``).

May import: ``flowsim.solve``, ``flowsim.model``, ``flowsim.common``, ``flowsim.config``. Must not import: ``runs``,
``bridge``, ``assemble``, ``cli``.
"""
