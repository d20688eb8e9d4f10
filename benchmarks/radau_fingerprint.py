"""Fingerprints of JaxRadau solves: a hash of every saved array and the step statistics.

    python benchmarks/radau_fingerprint.py > before.json   # on one revision
    python benchmarks/radau_fingerprint.py > after.json    # on another
    diff before.json after.json                             # empty: the same steps, bit for bit

Cases: the default one-layer run (t = 6000), its stiff variant, and the two-layer
baseline (real eigensystem) and depth-smoothed (complex eigensystem) configs.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

os.environ.setdefault("FLOWSIM_COMPILATION_CACHE", "off")

from flowsim.config import load_config  # noqa: E402
from flowsim.assemble import prepare  # noqa: E402
from flowsim.solve.solvers import solve_flow  # noqa: E402

CASES = {
    "one_layer_default": (None, []),
    "one_layer_stiff": (None, ["time.t_end=400", "init.eps=1e-6", "chain.lam=0.9", "solver.atol=1e-18", "solver.rtol=1e-8"]),
    "two_layer_baseline": ("configs/two_layer/baseline.toml", []),
    "two_layer_smoothing": ("configs/two_layer/smoothing_0.2.toml", ["time.t_end=40"]),
}


def fingerprint(config, overrides) -> dict:
    resolved = load_config(config, overrides)
    prepared = prepare(resolved)
    result = solve_flow(prepared.flow, prepared.params0, prepared.times, method="JaxRadau",
                        rtol=resolved.solver.rtol, atol=resolved.solver.atol)
    digest = hashlib.sha256()
    for array in (result.trajectory.t, result.trajectory.loss, *result.trajectory.params.values()):
        digest.update(np.ascontiguousarray(array).tobytes())
    stats = result.stats
    return {"status": result.status_name, "t_reached": result.t_reached, "n_saved": len(result.trajectory),
            "n_steps": stats.n_steps, "n_rejected": stats.n_rejected, "nfev": stats.nfev, "njev": stats.njev,
            "final_loss": float(result.trajectory.loss[-1]).hex(), "sha256": digest.hexdigest()}


if __name__ == "__main__":
    print(json.dumps({name: fingerprint(*case) for name, case in CASES.items()}, indent=1))
