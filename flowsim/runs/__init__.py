"""The run layer: run directories (``rundir``), running and resuming a run (``experiment``), labelling saved runs
(``labelling``), cached predictions (``predictions``), comparisons of runs (``runs_compared``), plots and sweeps
(``plots``, ``sweep``, ``sweep_backends``).

May import: every layer below (``observe``, ``solve``, ``model``, ``common``), ``flowsim.config``,
``flowsim.methods``, ``flowsim.assemble`` and ``theory``. Imported by ``flowsim.cli``, ``flowsim.bridge``,
``figures`` and the benchmarks; ``theory`` and the layers below must not import it.
"""
