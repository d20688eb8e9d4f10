"""The multi-layer study: the GPT-family configs (mlp / glu × plain / upper-Q/K schedule /
Window Smoothing) over several seeds on WikiText-2 and the TinyStories sample.

    python benchmarks/gpt_study.py [--seeds 0 1 2] [--corpus wikitext2 --corpus tinystories]
                                   [--out runs/gpt-study] [--set data.device=cuda ...]

Per corpus and variant, mean ± standard deviation over seeds (data.seed: the same seed gives
every variant the same initialisation and batches, so each variant is also compared with
gpt-mlp seed by seed): the validation loss at the last step; how far the top layer's
π-weighted attention entropy fell; when the residual stream it reads (after the block below
it) matured, per doubling of time (it turns by less than 0.1 rad between every checkpoint t
and 2t from then on) and, for comparison, relative to the end (its largest principal angle
to its final span stays below 0.1 rad); and the premature-specialisation index under each
(the entropy fall by then over the largest fall, flowsim.observe.specialisation). The mean curves of the top layer's entropy and of that basis angle
over the checkpoints go to OUT/study.json (figure 16 draws them; corpora run earlier into the same
OUT are kept); the tables to benchmarks/RESULTS.md (section gpt-study, then one section per
corpus, so a corpus can be rerun alone). Each run is a resumable bridge run directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


from flowsim.bridge.config import load_bridge_config
from flowsim.bridge.train import train
from flowsim.config import shipped_config
from flowsim.common.io import write_atomic_json
from flowsim.observe.observables import Observables, doubling_angles
from flowsim.observe.specialisation import summarise

from report import spread, write_section

CONFIGS = shipped_config("bridge")
VARIANTS = ("gpt-mlp", "gpt-mlp-qk", "gpt-mlp-smooth", "gpt-glu", "gpt-glu-qk", "gpt-glu-smooth")
RESULTS = Path(__file__).with_name("RESULTS.md")


def upper_layer_view(observables: Observables) -> Observables:
    """The top layer's attention and the residual basis it reads, under the names
    flowsim.observe.specialisation expects (attention_entropy_2, basis_angle, basis_doubling_angle)."""
    layers = sorted(int(name.rsplit("_", 1)[1]) for name in observables.columns if name.startswith("attention_entropy_"))
    top = layers[-1]
    streams = observables[f"stream_{top - 1}"]  # (T, types, width): the basis is the span of the rows
    columns = {"loss": observables["loss"], "attention_entropy_2": observables[f"attention_entropy_{top}"],
               "basis_angle": observables[f"basis_angle_{top - 1}"],
               "basis_doubling_angle": doubling_angles(observables.t, [stream.T for stream in streams])}
    return Observables(t=observables.t, columns=columns, constants={"pi": observables.constants["pi"]})


def run_row(run_dir: Path, seed: int, final_log: dict) -> dict:
    view = upper_layer_view(Observables.load(run_dir))
    summary = summarise(view)
    pi = view.constants["pi"] / view.constants["pi"].sum()
    upper = view["attention_entropy_2"] @ pi
    return {"seed": seed, "val_loss": final_log["val_loss"], "val_perplexity": final_log["val_perplexity"],
            "upper_entropy_fall": float(upper[0] - upper[-1]), "t_basis_mature": summary.t_basis_mature,
            "premature_index": summary.premature_index, "t_basis_final": summary.t_basis_final,
            "premature_index_final": summary.premature_index_final, "t_upper_specialised": summary.t_upper_specialised,
            "basis_turn_at_specialisation": summary.basis_turn_at_specialisation,
            "curve": {"t": view.t.tolist(), "upper_entropy": upper.tolist(), "basis_angle": view["basis_angle"].tolist(),
                      "basis_doubling_angle": view["basis_doubling_angle"].tolist(),
                      "val_loss": view["loss"].tolist()}}


def corpus_table(corpus: str, results: dict[str, list[dict]]) -> str:
    base = {row["seed"]: row["val_loss"] for row in results.get("gpt-mlp", [])}
    lines = [f"### {corpus}", "",
             "| variant | seeds | validation loss | paired Δ vs gpt-mlp | top-layer entropy fall | top layer specialised "
             "(t = lr × step) | basis turn over [t, 2t] there (rad) | basis mature per doubling | premature index | "
             "basis mature vs end | index vs end |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for variant, rows in results.items():
        paired = [row["val_loss"] - base[row["seed"]] for row in rows if row["seed"] in base]
        lines.append(f"| {variant} | {len(rows)} | {spread([r['val_loss'] for r in rows])} | "
                     f"{spread(paired) if variant != 'gpt-mlp' else '-'} | {spread([r['upper_entropy_fall'] for r in rows])} | "
                     f"{spread([r['t_upper_specialised'] for r in rows])} | {spread([r['basis_turn_at_specialisation'] for r in rows])} | "
                     f"{spread([r['t_basis_mature'] for r in rows])} | {spread([r['premature_index'] for r in rows])} | "
                     f"{spread([r['t_basis_final'] for r in rows])} | {spread([r['premature_index_final'] for r in rows])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--corpus", action="append", choices=["wikitext2", "tinystories"])
    parser.add_argument("--out", type=Path, default=Path("runs/gpt-study"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value for every run")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--results", type=Path, default=RESULTS, help="the markdown file whose gpt-study sections are written")
    args = parser.parse_args()
    study_file = args.out / "study.json"
    study = json.loads(study_file.read_text()) if study_file.is_file() else {}  # other corpora from earlier runs
    for corpus in args.corpus or ["wikitext2", "tinystories"]:
        results = {}
        for variant in args.variants:
            rows = []
            for seed in args.seeds:
                config = load_bridge_config(CONFIGS / f"{variant}.toml",
                                            [f"data.kind='{corpus}'", *args.overrides, f"data.seed={seed}"])
                run_dir = args.out / corpus / f"{variant}-seed{seed}"
                result = train(config, run_dir, progress=False)
                rows.append(run_row(run_dir, seed, result.log[-1]))
                print(f"{corpus:11} {variant:16} seed {seed}: validation loss {rows[-1]['val_loss']:.4f}", flush=True)
            results[variant] = rows
        study[corpus] = results
        write_atomic_json(study_file, study)
        table = corpus_table(corpus, results)
        print(table)
        write_section(args.results, f"gpt-study-{corpus}", table)  # one section per corpus: each can be rerun alone
    config = load_bridge_config(CONFIGS / f"{args.variants[0]}.toml", args.overrides)
    write_section(args.results, "gpt-study", "\n\n".join([
        "## GPT study (`python benchmarks/gpt_study.py`)",
        f"{config.model.n_layer} layers, width {config.model.d_model}, {config.model.n_head} heads, contexts of "
        f"{config.data.s}, batch {config.data.batch_size}, {config.optim.name} lr {config.optim.lr:g} for "
        f"{config.optim.steps} steps, vocabulary {config.data.vocab_size} + <unk>; seeds {args.seeds} (mean ± standard "
        "deviation; the paired difference seed by seed). The top layer's entropy is π-weighted over the probe types; "
        "'basis mature per doubling' is the first checkpoint t from which the stream below the top layer turns by less "
        "than 0.1 rad between every checkpoint t' >= t and the first checkpoint at 2t' (flowsim.observe.specialisation; at most "
        "half the horizon); 'vs end' is the first checkpoint after which it stays within 0.1 rad of its final span; "
        "'top layer specialised' is when its entropy had done 90% of its largest fall, and the basis turn is the "
        "stream's angle between that checkpoint and the first at twice its time. "
        "One table per corpus follows."]))


if __name__ == "__main__":
    main()
