"""SGD's own seed-to-seed spread of σ1's departure at d = 1001, with SGD on the surrogate chain beside it.

    python benchmarks/sigma1_seeds.py [--corpus wikitext2] [--seeds 0,1,2,3,4,5] [--t-end 1500] [--checkpoints 300]
                                      [--set key=value ...] [--work runs/sigma1-seeds] [--out benchmarks/RESULTS.md]

The protocol, fixed before any run: the d = 1001 example (configs/bridge/CORPUS-onelayer.toml, its lr and batch)
is trained at each seed (``data.seed``: the initial draw and the batches) to t = ``--t-end``, on the text and
with ``data.train_on = "surrogate"`` (sequences of its bigram chain, the chain the surrogate's ODE integrates;
same start, lr, batch and seed). On both routes the times at which W0's raw σ1 first exceeds 2, 3 and 5 times
its start are read, and condensation (the detectors'). The table gives every seed, each route's mean, standard
deviation and range over the seeds, and the surrogate route's mean against the text's. Nothing is fitted. A
time that is not reached by t_end is censored: a mean is given only where every seed reached it.

``--checkpoints`` sets ``log.n_checkpoints`` (log-spaced steps): at the defaults the readings are 3.2% apart, twice
as fine as the shipped example's, and each checkpoint costs about a third of a second at d = 1001. The runs are
kept in ``--work`` and reused; a line is printed as each finishes (2-4 minutes each on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from report import write_section
from surrogate_gap import DEPARTURE_FACTORS, sigma1_departures

MARKER = "sigma1-seeds"
ROUTES = {"text": [], "surrogate chain": ["data.train_on='surrogate'"]}
CONDENSATION = ("condensation", None, None, 1)


def run_events(corpus: str, seed: int, route: str, t_end: float, checkpoints: int, work: Path,
               overrides: tuple[str, ...] = ()) -> dict:
    """Train (or reuse) one seed of one route and read its events: {event name: time or None}."""
    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.train import train
    from flowsim.observe.observables import Observables
    from flowsim.observe.stages import detect_stages

    config_path = f"configs/bridge/{corpus}-onelayer.toml"
    lr = load_bridge_config(config_path, list(overrides)).optim.lr
    overrides = [*overrides, f"data.seed={seed}", f"optim.steps={int(round(t_end / lr))}",
                 f"log.n_checkpoints={checkpoints}", *ROUTES[route]]
    run_dir = work / f"{corpus}-{route.replace(' ', '-')}-seed{seed}"
    train(load_bridge_config(config_path, overrides), run_dir, progress=False)
    observables = Observables.load(run_dir)
    departures = sigma1_departures(observables)
    events = {"condensation": detect_stages(observables).events().get(CONDENSATION)}
    for factor in DEPARTURE_FACTORS:
        events[f"σ1 > {factor:g} ×"] = departures.get((f"σ1 > {factor:g} × start", None, None, 1))
    events["σ1 at t_end"] = float(np.asarray(observables["sv_W0"])[-1, 1])
    return events


def summary(values: list[float | None]) -> tuple[str, float | None]:
    """'mean ± SD (min-max)' over the seeds, and the mean; censored (a seed that never reached it) if any is None."""
    reached = [v for v in values if v is not None]
    if not reached:
        return "–", None
    spread = f"{min(reached):.4g}-{max(reached):.4g}"
    if len(reached) < len(values):
        return f"{len(reached)} of {len(values)} reached ({spread})", None
    mean = float(np.mean(values))
    sd = np.std(values, ddof=1) if len(values) > 1 else 0.0
    return f"{mean:.4g} ± {sd:.2g} ({spread})" if sd < 10 else f"{mean:.4g} ± {sd:.0f} ({spread})", mean


def table(corpus: str, seeds: list[int], events: dict[tuple[str, int], dict], t_end: float) -> str:
    """One row per route and seed, then each route's mean ± SD (range) over the seeds, then the means' error."""
    names = list(next(iter(events.values())))
    show = lambda value: "–" if value is None else f"{value:.4g}"  # noqa: E731
    lines = [f"### {corpus}, d = 1001, to t = {t_end:g}", "",
             "| route | seed | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for route in ROUTES:
        lines += [f"| {route} | {seed} | " + " | ".join(show(events[route, seed][name]) for name in names) + " |"
                  for seed in seeds]
    means = {}
    for route in ROUTES:
        shown = []
        for name in names:
            cell, means[route, name] = summary([events[route, seed][name] for seed in seeds])
            shown.append(cell)
        lines.append(f"| {route} | mean ± SD (range) | " + " | ".join(shown) + " |")
    text, chain = ROUTES
    errors = ["–" if means[text, name] is None or means[chain, name] is None
              else f"{(means[chain, name] - means[text, name]) / means[text, name]:+.1%}" for name in names]
    lines.append(f"| {chain} vs {text} | means | " + " | ".join(errors) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="wikitext2", choices=("wikitext2", "tinystories"))
    parser.add_argument("--seeds", default="0,1,2,3,4,5", help="comma-separated data.seed values")
    parser.add_argument("--t-end", type=float, default=1500.0, help="horizon on the t = lr × steps clock")
    parser.add_argument("--checkpoints", type=int, default=300, help="log.n_checkpoints of every run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="bridge config override (repeatable)")
    parser.add_argument("--work", type=Path, default=Path("runs/sigma1-seeds"), help="where the runs are kept")
    parser.add_argument("--out", type=Path, default=None, help="write the table into this markdown file (its own section)")
    args = parser.parse_args()
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    events = {}
    for seed in seeds:
        for route in ROUTES:
            started = time.perf_counter()
            events[route, seed] = run_events(args.corpus, seed, route, args.t_end, args.checkpoints, args.work,
                                               tuple(args.overrides))
            print(f"seed {seed}, {route}: {time.perf_counter() - started:.0f} s, {events[route, seed]}", flush=True)
    text = table(args.corpus, seeds, events, args.t_end)
    print(text)
    if args.out is not None:
        command = "python benchmarks/sigma1_seeds.py " + " ".join(sys.argv[1:])
        write_section(args.out, f"{MARKER}-{args.corpus}",
                      f"## σ1's departure across SGD's seeds\n\nProduced by `{command}`.\n\n{text}")


if __name__ == "__main__":
    main()
