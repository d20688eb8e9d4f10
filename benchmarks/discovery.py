"""Wall time of the commands that only print text: `flowsim --help`, `figures --list`, `config`, `config --bridge data`
and `data where wikitext2`, each a fresh process as a user starts it.

    python benchmarks/discovery.py [--repeats 5]

Each command runs ``--repeats`` times (``python -m flowsim ARGS``, output discarded); it prints the median and the
slowest wall time of each, in seconds, with the machine's load average at the start, since the goal (under 1 s) is
for a quiet machine. None of them imports JAX or torch (tests/test_cli.py checks that); what is left is Python's
start, typer and pydantic. Cost: about 5 × repeats process starts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

COMMANDS = (["--help"], ["figures", "--list"], ["config"], ["config", "--bridge", "data"], ["data", "where", "wikitext2"])


def wall_seconds(arguments: list[str]) -> float:
    """One fresh `python -m flowsim ARGUMENTS`, from its start to its exit."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "flowsim", *arguments], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (default 5)")
    arguments = parser.parse_args()
    if arguments.repeats < 1:
        parser.error(f"--repeats {arguments.repeats}: expected at least 1")
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f} (1 min) at the start, {time.strftime('%Y-%m-%d')}; "
          f"{arguments.repeats} runs of each command")
    for command in COMMANDS:
        times = [wall_seconds(command) for _ in range(arguments.repeats)]
        print(f"flowsim {' '.join(command)}: median {statistics.median(times):.2f} s, slowest {max(times):.2f} s "
              "(wall time of the whole process)")


if __name__ == "__main__":
    main()
