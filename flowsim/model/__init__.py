"""The model layer: Markov chains and tasks, the Transformers, their exact population losses and the gradient flow
(``chains``, ``tasks``, ``models``, ``losses``, ``flow``).

May import: ``flowsim.common``, ``flowsim.config``. Must not import: ``solve``, ``observe``, ``runs``, ``bridge``,
``assemble``, ``cli`` (nothing that integrates, observes or writes runs).
"""
