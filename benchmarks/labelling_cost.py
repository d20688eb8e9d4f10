"""What `flowsim run` costs after the solve, at large vocabularies: each part's time, the peak memory, the folder.

    python benchmarks/labelling_cost.py [--dims 64,256,1000] [--out benchmarks/RESULTS.md]

Each d is one `flowsim run` in a fresh process (a Zipf π ∝ 1/(i+1), λ = 0.5, m = k = 16, ε = 1e-3, t_end = 6000,
the default 501 save times), so its peak resident memory is that run's alone (``os.wait4``). The parts' times
come from the run's meta.json (compile and solve from the solver's statistics; observables, stage labels and the
summary figure from ``outputs``); "whole" is the command's wall time from start to exit, imports included. The
ratio is (compile + solve + the three output phases) over the solve. Run it on a quiet machine: a second busy
process slows JAX's compiled loops and the phases unevenly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import write_section

PHASES = ("observables", "stage_labels", "summary_figure")


def zipf_config(d: int) -> str:
    """The run's TOML: a Zipf π over d tokens, the paper family's λ, m = k = 16."""
    weights = [1.0 / (i + 1) for i in range(d)]
    pi = [w / sum(weights) for w in weights]
    return (f"[chain]\npi = [{', '.join(repr(p) for p in pi)}]\nlam = 0.5\n\n[model]\nm = 16\nk = 16\n\n"
            "[time]\nt_end = 6000.0\n")


def measure(d: int, folder: Path) -> dict:
    """One `flowsim run` at d in a fresh process: the parts' seconds, its peak memory and its folder's size."""
    config, run_dir = folder / f"zipf-d{d}.toml", folder / f"run-d{d}"
    config.write_text(zipf_config(d))
    started = time.perf_counter()
    with open(folder / "stderr.txt", "w+b") as stderr_file:  # files, not pipes: a full pipe would stall the run
        process = subprocess.Popen([sys.executable, "-m", "flowsim", "run", str(config), "--out", str(run_dir),
                                    "--quiet"], stdout=subprocess.DEVNULL, stderr=stderr_file)
        _, status, usage = os.wait4(process.pid, 0)
        whole = time.perf_counter() - started
        stderr = (folder / "stderr.txt").read_text()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"flowsim run at d = {d} failed: {stderr[-2000:]}")
    meta = json.loads((run_dir / "meta.json").read_text())
    outputs = meta.get("outputs", {})  # not recorded before the outputs were timed (a flowsim of before, on PYTHONPATH)
    size = sum(path.stat().st_size for path in run_dir.iterdir() if path.is_file())
    return {"d": d, "n_saved": meta["n_saved"], "steps": meta["n_steps"], "compile": meta["compile_seconds"],
            "solve": meta["solve_seconds"], **{phase: outputs.get(f"{phase}_seconds", float("nan")) for phase in PHASES},
            "whole": whole, "peak_mb": usage.ru_maxrss / 1e3,
            "after_solve_mb": outputs.get("peak_memory_mb_after_solve", float("nan")),
            "folder_mb": size / 1e6, "observables_mb": (run_dir / "observables.npz").stat().st_size / 1e6}


def table(rows: list[dict]) -> str:
    header = ("| d | saves | steps | compile s | solve s | observables s | labels s | figure s | (compile + solve + "
              "outputs) / solve | whole command s | peak memory MB (after the solve) | folder MB (observables.npz) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        parts = row["compile"] + row["solve"] + sum(row[phase] for phase in PHASES)
        lines.append(f"| {row['d']} | {row['n_saved']} | {row['steps']} | {row['compile']:.1f} | {row['solve']:.1f} | "
                     f"{row['observables']:.1f} | {row['stage_labels']:.1f} | {row['summary_figure']:.1f} | "
                     f"{parts / row['solve']:.2f} | {row['whole']:.1f} | {row['peak_mb']:.0f} ({row['after_solve_mb']:.0f}) | "
                     f"{row['folder_mb']:.0f} ({row['observables_mb']:.1f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", default="64,256,1000", help="comma-separated vocabulary sizes")
    parser.add_argument("--out", type=Path, default=None, help="a markdown file to write the table into (its section)")
    arguments = parser.parse_args()
    try:
        dims = [int(text) for text in arguments.dims.split(",")]
    except ValueError:
        parser.error(f"--dims must be comma-separated integers, got {arguments.dims!r}")
    with tempfile.TemporaryDirectory() as folder:
        rows = []
        for d in dims:
            rows.append(measure(d, Path(folder)))
            print(json.dumps(rows[-1]), flush=True)
    text = table(rows)
    print(text)
    if arguments.out is not None:
        write_section(arguments.out, "labelling-cost", f"`python benchmarks/labelling_cost.py --dims {arguments.dims}`\n\n{text}")


if __name__ == "__main__":
    main()
