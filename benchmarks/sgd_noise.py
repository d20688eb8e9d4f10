"""Step or noise: which of SGD's two departures from the flow moves an event, read off runs at lr / a and batch b × B.

    python benchmarks/sgd_noise.py --corpus wikitext2 --variants lr/2 lr/4 lr/8 2B [--out benchmarks/RESULTS.md]

Each variant is a shipped example (``flowsim bridge validate CORPUS``, SGD and the ODE only) run to the same t:
``lr/a`` at a times the steps, ``bB`` at b times the batch (the same steps), ``lr/a,bB`` both. Halving lr halves both
the step and the noise temperature lr/B; doubling B halves the temperature alone. So an event that doubling B moves
as far as halving lr is decided by the noise, one that doubling B leaves where it was by the step. Runs are cached
in FOLDER-VARIANT (lr/2 and lr/4 share ``text_cycle.py``'s FOLDER-half and FOLDER-quarter); the baseline
(lr, B) is FOLDER itself, run by ``text_cycle.py`` or here.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from report import write_section
from text_cycle import example_name_and_folder, example_parser, key, relative

SHARED_FOLDERS = {(2, 1): "half", (4, 1): "quarter"}  # text_cycle.py's caches


def parse_variant(text: str) -> tuple[int, int]:
    """'lr/8' -> (8, 1), '2B' -> (1, 2), 'lr/2,2B' -> (2, 2)."""
    divisor, multiplier = 1, 1
    for part in text.split(","):
        if match := re.fullmatch(r"lr/(\d+)", part.strip()):
            divisor = int(match.group(1))
        elif match := re.fullmatch(r"(\d+)B", part.strip()):
            multiplier = int(match.group(1))
        else:
            raise argparse.ArgumentTypeError(f"a variant is lr/A, bB or lr/A,bB with whole A and b, got {text!r}")
    if divisor < 1 or multiplier < 1:
        raise argparse.ArgumentTypeError(f"A and b must be at least 1, got {text!r}")
    return divisor, multiplier


def variant_name(divisor: int, multiplier: int) -> str:
    return ",".join(([f"lr/{divisor}"] if divisor > 1 else ["lr"]) + ([f"{multiplier}B"] if multiplier > 1 else []))


def noise_rows(runs: dict[tuple[int, int], dict]) -> list[dict]:
    """One row per event any run has: its SGD time in each run and how far each variant moved it from (lr, B)."""
    base = {key(row): row for row in runs[(1, 1)]["rows"]}
    events = list(dict.fromkeys(event for payload in runs.values() for event in (key(row) for row in payload["rows"])))
    rows = []
    for event in events:
        times = {variant: next((row["sgd"] for row in payload["rows"] if key(row) == event), None)
                 for variant, payload in runs.items()}
        token = next(row["token"] for payload in runs.values() for row in payload["rows"] if key(row) == event)
        rows.append({"event": event, "token": token, "times": times,
                     "ode": base[event]["ode"] if event in base else None,
                     "moved": {variant: relative(time, times[(1, 1)]) for variant, time in times.items() if variant != (1, 1)}})
    return rows


def noise_table(rows: list[dict], runs: dict[tuple[int, int], dict]) -> str:
    from flowsim.observe.stages import event_label

    show = lambda value: "–" if value is None else f"{value:.4g}"  # noqa: E731
    percent = lambda value: "–" if value is None else f"{100 * value:.1f}%"  # noqa: E731
    base = runs[(1, 1)]
    variants = list(runs)
    moved = [variant for variant in variants if variant != (1, 1)]
    batch = base.get("batch_size")
    lines = [f"{base['corpus']}, d = {base['d']}, to t = {base['t_end']:g}: lr = {base['lr']:g}"
             + (f", B = {batch}" if batch else "") + "; a variant's shift is from (lr, B)", "",
             "| event | token | ODE (probe set) | " + " | ".join(f"SGD {variant_name(*v)}" for v in variants)
             + " | " + " | ".join(f"{variant_name(*v)} moved it" for v in moved) + " |",
             "|---|---|---:|" + "---:|" * (len(variants) + len(moved))]
    for row in rows:
        lines.append(f"| {event_label(row['event'])} | {row['token']} | {show(row['ode'])} | "
                     + " | ".join(show(row["times"][v]) for v in variants) + " | "
                     + " | ".join(percent(row["moved"][v]) for v in moved) + " |")
    return "\n".join(lines)


def main() -> None:
    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.validate import example_config, validate

    parser = example_parser(__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", type=parse_variant, required=True, help="lr/A, bB or lr/A,bB")
    arguments = parser.parse_args()
    name, folder = example_name_and_folder(arguments)
    config = load_bridge_config(example_config(arguments.corpus))
    report = lambda message: print(f"{name}: {message}", flush=True)  # noqa: E731
    runs = {(1, 1): validate(arguments.corpus, folder, theory=False, progress=report)}
    for divisor, multiplier in arguments.variants:
        suffix = SHARED_FOLDERS.get((divisor, multiplier), variant_name(divisor, multiplier).replace("/", "").replace(",", "-"))
        overrides = [f"optim.lr={config.optim.lr / divisor}", f"optim.steps={divisor * config.optim.steps}",
                     f"data.batch_size={multiplier * config.data.batch_size}"]
        runs[(divisor, multiplier)] = validate(arguments.corpus, Path(f"{folder}-{suffix}"), overrides, theory=False,
                                               progress=report)
    runs[(1, 1)].setdefault("batch_size", config.data.batch_size)
    text = noise_table(noise_rows(runs), runs)
    print(text)
    print("seconds:", {variant_name(*variant): payload["seconds"] for variant, payload in runs.items()})
    if arguments.out is not None:
        command = f"python benchmarks/sgd_noise.py --corpus {arguments.corpus} --variants " + " ".join(
            variant_name(*variant) for variant in arguments.variants)
        write_section(arguments.out, f"noise-{name}", f"`{command}`\n\n{text}")


if __name__ == "__main__":
    main()
