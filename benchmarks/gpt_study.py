"""The multi-layer study: the GPT-family configs (mlp / glu × plain / upper-Q/K schedule /
Window Smoothing) over several seeds, with validation perplexity at the last step.

    python benchmarks/gpt_study.py [--seeds 0 1 2] [--out runs/gpt-study] [--set data.device=cuda ...]

Each run is a resumable bridge run directory (an interrupted study picks up where it
stopped); the table is printed and written to OUT/study.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from flowsim.bridge.config import load_bridge_config
from flowsim.bridge.train import train
from flowsim.config import shipped_config
from flowsim.io import write_atomic_json
from flowsim.observables import Observables

CONFIGS = shipped_config("bridge")
VARIANTS = ("gpt-mlp", "gpt-mlp-qk", "gpt-mlp-smooth", "gpt-glu", "gpt-glu-qk", "gpt-glu-smooth")


def upper_entropy_fall(observables: Observables) -> float:
    """How far the top layer's π-weighted attention entropy fell from its start to its end."""
    layers = sorted(int(name.rsplit("_", 1)[1]) for name in observables.columns if name.startswith("attention_entropy_"))
    entropy = observables[f"attention_entropy_{layers[-1]}"] @ observables.constants["pi"]
    return float(entropy[0] - entropy[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("runs/gpt-study"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value for every run")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = parser.parse_args()
    results = {}
    for variant in args.variants:
        rows = []
        for seed in args.seeds:
            config = load_bridge_config(CONFIGS / f"{variant}.toml", [*args.overrides, f"data.seed={seed}"])
            result = train(config, args.out / f"{variant}-seed{seed}", progress=False)
            observables = Observables.load(args.out / f"{variant}-seed{seed}")
            rows.append({"seed": seed, "val_perplexity": result.log[-1]["val_perplexity"],
                         "upper_entropy_fall": upper_entropy_fall(observables),
                         "ffn_write_1": float(observables["ffn_write_1"][-1])})
            print(f"{variant:16} seed {seed}: perplexity {rows[-1]['val_perplexity']:.2f}", flush=True)
        results[variant] = rows
    print(f"\n{'variant':16} {'val perplexity (mean ± sd)':>28} {'upper H fall':>13} {'FFN-1 write':>12}")
    for variant, rows in results.items():
        ppl = np.array([row["val_perplexity"] for row in rows])
        print(f"{variant:16} {ppl.mean():19.2f} ± {ppl.std(ddof=1) if len(ppl) > 1 else 0.0:6.2f} "
              f"{np.mean([r['upper_entropy_fall'] for r in rows]):13.3f} {np.mean([r['ffn_write_1'] for r in rows]):12.3g}")
    write_atomic_json(args.out / "study.json", results)


if __name__ == "__main__":
    main()
