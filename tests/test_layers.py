"""The layers: the core (chains ... stages, and the assembly of a configuration), then ``theory`` on the core alone,
then the application (run directories, experiment, sweeps, predictions cache, plots, figures, bridge, CLI)."""

import json
import subprocess
import sys

APPLICATION = ("flowsim.rundir", "flowsim.experiment", "flowsim.labelling", "flowsim.sweep_backends", "flowsim.sweep", "flowsim.predictions", "flowsim.plots",
               "flowsim.runs_compared", "flowsim.cli", "flowsim.bridge", "figures", "matplotlib")


def modules_loaded_by(statement: str) -> list[str]:
    """The modules a fresh interpreter holds after ``statement``."""
    script = f"{statement}; import json, sys; print(json.dumps(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_the_theory_loads_no_application_module_and_no_matplotlib():
    loaded = modules_loaded_by("import theory.predict, theory.cycles, theory.pathwise")
    leaks = [name for name in loaded if name.startswith(APPLICATION)]
    assert not leaks, leaks
    assert "flowsim.assemble" in loaded  # the theory assembles its runs as the run layer does


def test_the_core_loads_no_theory_and_no_application_module():
    loaded = modules_loaded_by("import flowsim.assemble, flowsim.solvers, flowsim.observables, flowsim.stages, flowsim.families")
    leaks = [name for name in loaded if name.startswith((*APPLICATION, "theory"))]
    assert not leaks, leaks
