"""The solve layer: integration methods and their shared loop (``integration``; ``bdf``, ``stiff``, ``rkc``,
``compiled_methods``, ``reference_methods``), the one entry point ``solvers.solve_flow``, and what a solve returns
(``trajectory``, ``status``).

May import: ``flowsim.model``, ``flowsim.common``, ``flowsim.config``, ``flowsim.methods``. Must not import:
``observe``, ``runs``, ``bridge``, ``assemble``, ``cli``.
"""
