"""Is SGD in the gradient-flow regime? Train at lr and at lr/2 (twice the steps, the same
t = lr × steps horizon, the same start) and compare the observables on the t clock.

In the flow regime the trajectory depends on lr only through t: the two runs agree up to
O(lr) discretisation and SGD noise. Each observable series x(t) of the lr run (loss, each
query's attention entropy, each singular value of W0) is compared with the lr/2 run
interpolated onto the same times (linear in log t); its deviation is

    max_t |x_{lr/2}(t) - x_lr(t)| / scale,

the largest gap on the scale of its observable: the loss's largest value, the largest
possible entropy log(key types), W0's largest singular value over the run. (A pointwise
relative error would blow up where an entropy falls to zero, and a series' own range
where it hardly moves, e.g. a singular value at its noise floor.) The run is in the flow
regime when every deviation is at most ``tolerance`` (5% by default).

    OUT/lr/         the run at lr (a bridge run directory)
    OUT/lr_half/    the run at lr/2 with twice the steps
    OUT/regime.json each series' deviation, the largest, the verdict
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from flowsim.bridge.config import BridgeConfig
from flowsim.bridge.train import train
from flowsim.io import write_atomic_json
from flowsim.observables import Observables

REGIME_JSON = "regime.json"
COMPARED_COLUMNS = ("loss", "attention_entropy", "sv_W0")
TOLERANCE = 0.05


@dataclass(frozen=True)
class SeriesDeviation:
    series: str  # e.g. "attention_entropy[2]"
    deviation: float  # largest gap / the observable's scale
    at_t: float  # where the gap is largest


@dataclass(frozen=True)
class RegimeReport:
    lr: float
    tolerance: float
    rows: list[SeriesDeviation]

    @property
    def worst(self) -> SeriesDeviation:
        return max(self.rows, key=lambda row: row.deviation)

    @property
    def in_flow_regime(self) -> bool:
        return self.worst.deviation <= self.tolerance

    def table(self) -> str:
        lines = [f"{'series':26} {'deviation':>9} {'at t':>10}"]
        for row in sorted(self.rows, key=lambda row: -row.deviation)[:12]:
            lines.append(f"{row.series[:26]:26} {100 * row.deviation:8.2f}% {row.at_t:10.4g}")
        verdict = "in" if self.in_flow_regime else "NOT in"
        lines.append(f"lr = {self.lr:g} is {verdict} the flow regime: halving it moves the observables on the "
                     f"t = lr x steps clock by at most {100 * self.worst.deviation:.2f}% of their scale "
                     f"(tolerance {100 * self.tolerance:g}%, worst: {self.worst.series} at t = {self.worst.at_t:.4g})")
        return "\n".join(lines)


def halved_learning_rate(config: BridgeConfig) -> BridgeConfig:
    """The same run at lr/2 with twice the steps: the same horizon t = lr × steps."""
    optim = config.optim.model_copy(update={"lr": config.optim.lr / 2, "steps": 2 * config.optim.steps})
    return config.model_copy(update={"optim": optim})


def _series(observables: Observables) -> dict[str, np.ndarray]:
    table = observables.scalar_columns()
    return {name: values for name, values in table.items() if name.split("[")[0] in COMPARED_COLUMNS}


def observable_deviations(reference: Observables, other: Observables) -> list[SeriesDeviation]:
    """Each compared series of ``reference`` against ``other`` interpolated (in log t) onto its times."""
    keep = reference.t > 0
    log_t = np.log(reference.t[keep])
    other_keep = other.t > 0
    mine, theirs = _series(reference), _series(other)
    scales = {"loss": float(np.max(np.abs(reference["loss"]))),
              "attention_entropy": float(np.log(reference["attention"].shape[-1])),
              "sv_W0": float(np.max(reference["sv_W0"]))}
    rows = []
    for name, values in mine.items():
        if name not in theirs:
            continue
        gap = np.abs(np.interp(log_t, np.log(other.t[other_keep]), theirs[name][other_keep]) - values[keep])
        if not np.all(np.isfinite(gap)):
            rows.append(SeriesDeviation(name, float("inf"), float(reference.t[keep][np.argmax(~np.isfinite(gap))])))
            continue
        worst = int(np.argmax(gap))
        rows.append(SeriesDeviation(name, float(gap[worst] / scales[name.split("[")[0]]), float(reference.t[keep][worst])))
    return rows


def check_flow_regime(config: BridgeConfig, out: Path, *, progress: bool = True, tolerance: float = TOLERANCE) -> RegimeReport:
    """Train ``config`` and its halved-lr twin into ``out`` (each resumable) and compare them."""
    out = Path(out)
    train(config, out / "lr", progress=progress)
    train(halved_learning_rate(config), out / "lr_half", progress=progress)
    rows = observable_deviations(Observables.load(out / "lr"), Observables.load(out / "lr_half"))
    if not rows:
        raise ValueError("the two runs share no observable series to compare")
    report = RegimeReport(config.optim.lr, tolerance, rows)
    write_atomic_json(out / REGIME_JSON, {"lr": report.lr, "tolerance": tolerance, "in_flow_regime": report.in_flow_regime,
                                         "worst": asdict(report.worst), "rows": [asdict(row) for row in rows]})
    return report
