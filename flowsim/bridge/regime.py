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

A steep event (a focus whose entropy falls by a nat within a few percent of t) turns a small
shift in time into a large vertical gap, so the report also gives each stage event labelled on
both runs (flowsim's detectors) and its shift |t_lr - t_{lr/2}| / t_{lr/2}: the clock on which
onsets are predicted. The verdict stays the observables' own.

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
from flowsim.common.io import write_atomic_json
from flowsim.observe.observables import Observables
from flowsim.observe.stages import detect_stages, event_label

REGIME_JSON = "regime.json"
COMPARED_COLUMNS = ("loss", "attention_entropy", "sv_W0")
TOLERANCE = 0.05


@dataclass(frozen=True)
class SeriesDeviation:
    series: str  # e.g. "attention_entropy[2]"
    deviation: float  # largest gap / the observable's scale
    at_t: float  # where the gap is largest


@dataclass(frozen=True)
class OnsetShift:
    event: str  # e.g. "focus q3 #1"
    t_lr: float
    t_half: float

    @property
    def shift(self) -> float:
        return abs(self.t_lr - self.t_half) / self.t_half


@dataclass(frozen=True)
class RegimeReport:
    lr: float
    tolerance: float
    rows: list[SeriesDeviation]
    onsets: tuple[OnsetShift, ...] = ()

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
        if self.onsets:
            worst = max(self.onsets, key=lambda onset: onset.shift)
            lines.append(f"stage events on both runs: {len(self.onsets)}; the largest shift is {100 * worst.shift:.2f}% "
                         f"({worst.event}: {worst.t_lr:.4g} at lr, {worst.t_half:.4g} at lr/2)")
        return "\n".join(lines)


def scaled_learning_rate(config: BridgeConfig, factor: float) -> BridgeConfig:
    """The same run at factor × lr with steps / factor: the same horizon t = lr × steps (ValueError where
    steps / factor is not a whole number)."""
    steps = round(config.optim.steps / factor)
    if steps < 1 or not np.isclose(steps * factor, config.optim.steps):
        raise ValueError(f"lr × {factor:g}: {config.optim.steps} steps / {factor:g} is not a whole number of steps")
    optim = config.optim.model_copy(update={"lr": config.optim.lr * factor, "steps": steps})
    return config.model_copy(update={"optim": optim})


def halved_learning_rate(config: BridgeConfig) -> BridgeConfig:
    """The same run at lr/2 with twice the steps."""
    return scaled_learning_rate(config, 0.5)


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


def onset_shifts(reference: Observables, other: Observables) -> tuple[OnsetShift, ...]:
    """The stage events flowsim's detectors label on both runs, with their times on each (t = lr × steps)."""
    mine, theirs = detect_stages(reference).events(), detect_stages(other).events()
    common = sorted(set(mine) & set(theirs), key=lambda event: mine[event])
    return tuple(OnsetShift(event_label(event), mine[event], theirs[event]) for event in common if theirs[event] > 0)


def check_flow_regime(config: BridgeConfig, out: Path, *, progress: bool = True, tolerance: float = TOLERANCE) -> RegimeReport:
    """Train ``config`` and its halved-lr twin into ``out`` (each resumable) and compare them."""
    out = Path(out)
    train(config, out / "lr", progress=progress)
    train(halved_learning_rate(config), out / "lr_half", progress=progress)
    at_lr, at_half = Observables.load(out / "lr"), Observables.load(out / "lr_half")
    rows = observable_deviations(at_lr, at_half)
    if not rows:
        raise ValueError("the two runs share no observable series to compare")
    report = RegimeReport(config.optim.lr, tolerance, rows, onset_shifts(at_lr, at_half))
    write_atomic_json(out / REGIME_JSON, {"lr": report.lr, "tolerance": tolerance, "in_flow_regime": report.in_flow_regime,
                                         "worst": asdict(report.worst), "rows": [asdict(row) for row in rows],
                                         "onsets": [{**asdict(onset), "shift": onset.shift} for onset in report.onsets]})
    return report
