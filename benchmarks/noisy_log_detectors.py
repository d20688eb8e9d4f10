"""The focus and dilution detectors on synthetic SGD-like logs: false dilutions and the error of known events, for
the noise read causally over windows of several half-widths.

    python benchmarks/noisy_log_detectors.py [--seeds 200] [--windows 0.25 0.15 0.1] [--out benchmarks/RESULTS.md]

Logs as in tests/test_stages.py (228 log-spaced checkpoints to t = 3000, one query's entropy with Gaussian noise
from t = 200 on): (a) a focus that stays low (1.6 -> 0.3 nats at t = 270): how many seeds label a dilution, and how
many miss the focus; (b) the same focus, then a 0.9-nat dilution at t = 1800: the median and largest relative error
of each against the time the detectors give the noise-free series, and how many seeds find the dilution. Each
noise level and window reads the same seeds. About a minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from report import published  # noqa: E402
from test_stages import log_ramp, noisy_entropy_log  # noqa: E402

from flowsim.observe.stages import StageThresholds, detect_stages  # noqa: E402

NOISE_LEVELS = (0.05, 0.13, 0.2, 0.3)


def onsets(log, th: StageThresholds, stage: str) -> list[float]:
    return [interval.t_start for interval in detect_stages(log, th).of(stage, query=1)]


def errors(found: list[float | None], reference: float) -> str:
    kept = np.array([abs(x - reference) / reference for x in found if x is not None])
    return "–" if not len(kept) else f"{100 * np.median(kept):.1f}%, {100 * kept.max():.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--windows", type=float, nargs="+", default=[0.25, 0.15, 0.1])
    parser.add_argument("--out", type=Path, default=None)
    arguments = parser.parse_args()
    started = time.perf_counter()
    t = np.geomspace(0.5, 3000, 228)
    stays_low = log_ramp(t, 1.6, 0.3, 270)
    cycle = np.where(t < 900, log_ramp(t, 1.6, 0.3, 270), log_ramp(t, 0.3, 1.2, 1800))
    lines = [f"{arguments.seeds} seeds per cell; errors are median, largest against the noise-free series' time", "",
             "| noise window (± decades) | noise SD | stays low: labelled diluted | stays low: focus missed "
             "| focus error | dilution found | dilution error |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for window in arguments.windows:
        th = StageThresholds(noise_window_decades=window)
        clean_focus = onsets(noisy_entropy_log(cycle, t, 0.0, 0), th, "focus")[0]
        clean_dilution = onsets(noisy_entropy_log(cycle, t, 0.0, 0), th, "dilution")[0]
        for noise in NOISE_LEVELS:
            diluted = missed = 0
            foci, dilutions = [], []
            for seed in range(arguments.seeds):
                log = noisy_entropy_log(stays_low, t, noise, seed)
                diluted += bool(onsets(log, th, "dilution"))
                missed += not onsets(log, th, "focus")
                log = noisy_entropy_log(cycle, t, noise, seed)
                foci.append(next(iter(onsets(log, th, "focus")), None))
                dilutions.append(next(iter(onsets(log, th, "dilution")), None))
            found = sum(x is not None for x in dilutions)
            lines.append(f"| {window:g} | {noise:g} | {diluted} | {missed} | {errors(foci, clean_focus)} "
                         f"| {found} | {errors(dilutions, clean_dilution)} |")
    command = "python benchmarks/noisy_log_detectors.py" + (f" --seeds {arguments.seeds}" if arguments.seeds != 200 else "")
    published(command, started, lines, arguments.out, "noisy-log-detectors")


if __name__ == "__main__":
    main()
