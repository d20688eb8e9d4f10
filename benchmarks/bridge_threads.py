"""Steps per second of the bridge's SGD at one torch thread and at torch's default, quiet and beside a busy process.

    env -u OMP_NUM_THREADS python benchmarks/bridge_threads.py [--steps 200] [--examples d64 d1001]
                                                               [--loads quiet busy] [--out bench-threads.json]

For each example (``d64``: configs/bridge/wikitext2-d64.toml; ``d1001``: configs/bridge/wikitext2-onelayer.toml) and
each load (``quiet``: nothing else started; ``busy``: beside one process doing torch matrix products on torch's default
threads, as a second job on the machine would), one process builds the run's model, optimiser and batches as
``flowsim bridge train`` does and times ``--steps`` SGD steps at 1 thread and at torch's default (a thread per core),
alternating the two in four rounds so that a drift in the load reaches both alike. It prints steps per second for
each and their ratio (1 thread over the default), measured in that one process, and writes them to ``--out``.
What it measures is the machine's state at the time: run it where nothing else runs for "quiet". Cost: about
8 × steps SGD steps per example and load (warm-up included), a minute or two at d = 64, several at d = 1001.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

EXAMPLES = {"d64": "configs/bridge/wikitext2-d64.toml", "d1001": "configs/bridge/wikitext2-onelayer.toml"}
ROUNDS = 4  # alternations of the two thread counts: a load that drifts during the measurement reaches both


def busy_process(stop) -> None:
    """A second job: torch matrix products on torch's default threads until ``stop`` is set."""
    import torch

    a = torch.randn(512, 512)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def sgd_stepper(config_path: str):
    """One SGD step of the example as ``flowsim bridge train`` takes it (the batch drawn, the loss, backward, the
    update), without its checkpoints; returns (step, vocabulary size d)."""
    import torch

    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.train import Trainer, batch_loss, build_data

    config = load_bridge_config(Path(config_path), ["data.device='cpu'"])
    data = build_data(config)
    trainer = Trainer(config, Path(tempfile.mkdtemp(prefix="bridge-threads-")), data, torch.device("cpu"))
    counter = iter(range(10**9))

    def step() -> None:
        tokens = data.batch(next(counter))
        loss = batch_loss(trainer.model, tokens)
        trainer.stepper.zero_grad()
        loss.backward()
        trainer.stepper.step()

    return step, data.vocab_size


def steps_per_second(step, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - started)


def measure(example: str, load: str, steps: int) -> dict:
    """Steps per second at 1 thread and at torch's default for one example under one load, in this process."""
    import torch

    default_threads = torch.get_num_threads()  # torch's own choice in a fresh process: a thread per core
    step, d = sgd_stepper(EXAMPLES[example])
    stop, hog = None, None
    if load == "busy":
        stop = multiprocessing.get_context("spawn").Event()
        hog = multiprocessing.get_context("spawn").Process(target=busy_process, args=(stop,), daemon=True)
        hog.start()
    try:
        rates: dict[int, list[float]] = {1: [], default_threads: []}
        for threads in rates:  # warm-up: torch's first steps allocate and pick kernels
            torch.set_num_threads(threads)
            steps_per_second(step, max(1, steps // 4))
        for _ in range(ROUNDS):
            for threads in rates:
                torch.set_num_threads(threads)
                rates[threads].append(steps_per_second(step, max(1, steps // ROUNDS)))
    finally:
        if hog is not None:
            stop.set()
            hog.join(timeout=10)
    one, default = (sum(rates[t]) / len(rates[t]) for t in (1, default_threads))
    return {"example": example, "d": d, "load": load, "default_threads": default_threads,
            "steps_per_s_1_thread": one, "steps_per_s_default": default, "ratio_1_over_default": one / default}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed SGD steps per thread count (default 200)")
    parser.add_argument("--examples", nargs="+", choices=sorted(EXAMPLES), default=["d64", "d1001"])
    parser.add_argument("--loads", nargs="+", choices=["quiet", "busy"], default=["quiet", "busy"])
    parser.add_argument("--out", type=Path, default=Path("bench-threads.json"), help="where the rows are written (JSON)")
    arguments = parser.parse_args()
    if arguments.steps < 1:
        parser.error(f"--steps {arguments.steps}: expected at least 1")
    if os.environ.get("OMP_NUM_THREADS"):
        print(f"note: OMP_NUM_THREADS = {os.environ['OMP_NUM_THREADS']} sets torch's default here; unset it to "
              "measure torch's own choice", file=sys.stderr)
    rows = []
    for example in arguments.examples:
        for load in arguments.loads:
            print(f"{example} {load}: {arguments.steps} steps at each thread count ...", file=sys.stderr, flush=True)
            row = measure(example, load, arguments.steps)
            rows.append(row)
            print(f"{example} (d = {row['d']}) {load}: {row['steps_per_s_1_thread']:.2f} steps/s at 1 thread, "
                  f"{row['steps_per_s_default']:.2f} steps/s at torch's default ({row['default_threads']} threads); "
                  f"1 thread / default = {row['ratio_1_over_default']:.2f}×", flush=True)
    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
               "date": time.strftime("%Y-%m-%d"), "load_average_at_start": os.getloadavg()}
    arguments.out.write_text(json.dumps({"machine": machine, "steps": arguments.steps, "rows": rows}, indent=2) + "\n")
    print(f"written: {arguments.out}")


if __name__ == "__main__":
    main()
