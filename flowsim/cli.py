"""The ``flowsim`` command line."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import typer

from flowsim.common.interrupts import INTERRUPTED_STARTING

# rich_markup_mode=None: help texts show [v1, v2, ...] and the like as written.
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True, rich_markup_mode=None,
                  help="flowsim: exact gradient flows of small Transformers on Markov chains.")
EXIT_INTERRUPTED = 130  # as a shell reports a process stopped by SIGINT
_interrupt_reported = False  # a command said what its interruption kept (else ``main`` says it was interrupted)


def _stop_interrupted(message: str) -> None:
    """Say what an interrupted command kept and exit 130."""
    global _interrupt_reported
    _interrupt_reported = True
    typer.echo(message, err=True)
    raise typer.Exit(code=EXIT_INTERRUPTED)


def _fail(message: str, code: int = 2) -> None:
    """One line on stderr; exit 2 for bad input, 1 for a run that failed."""
    typer.echo(f"flowsim: error: {message}", err=True)
    raise typer.Exit(code=code)


FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def _fail_writing(error: OSError, kept: str) -> None:
    """One line for a write the file system refused (a full disk, a quota, a read-only folder), exit 1."""
    if error.errno not in FULL_DISK_ERRNOS:
        raise error
    _fail(f"{error.strerror.lower()} while writing {error.filename or 'an output'}: {kept}; make room and run the "
          "same command again to continue", code=1)


@contextlib.contextmanager
def _warnings_as_lines():
    """Inside the block a Python warning is printed as it comes, in one line: `flowsim: warning: MESSAGE` (no
    source line or category, as `run` prints the warnings of its set-up)."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, *_: typer.echo(f"flowsim: warning: {message}", err=True)
        yield


def _progress(message: str) -> None:
    typer.echo(f"flowsim: {message} ...", err=True)


def _working(seconds: float) -> None:
    """The heartbeat of a long step (``flowsim.common.progress.ticking``)."""
    typer.echo(f"flowsim: {seconds:.0f} s", err=True)


@app.command(short_help="Integrate a flow into a run directory and label its stages.")
def run(
    config: Optional[Path] = typer.Argument(None, help="TOML config; the paper default when omitted."),
    set_: List[str] = typer.Option([], "--set", help="Override a key: section.key=TOML-literal (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (default: runs/NAME-TIMESTAMP)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the interrupted run in this directory."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Integrate a gradient flow and write a run directory with a summary figure.

    Ctrl-C (SIGINT) or SIGTERM stops it within about a second, keeping every point computed
    so far; `flowsim run --resume DIR` continues it."""
    from flowsim.config import ConfigError, load_config
    from flowsim.assemble import prepare
    from flowsim.runs.experiment import OutputsInterrupted, OutputWriteError, execute_run, resume_run
    from flowsim.common.io import DamagedFileError
    from flowsim.runs.rundir import check_output_dir, new_run_dir

    if resume is not None:
        if config is not None or set_ or out is not None:
            _fail("--resume continues a run with its own config.toml: give no CONFIG, --set or --out with it")
        try:
            result, exact = resume_run(resume, progress=not quiet)
        except OutputsInterrupted as error:
            _stop_interrupted(f"flowsim: {error}")
        except OutputWriteError as error:
            _fail(str(error), code=1)
        except (ConfigError, DamagedFileError, FileNotFoundError, ValueError) as error:
            _fail(str(error))
        if not exact:
            typer.echo(f"flowsim: note: {result.method} resumed afresh from the last saved point; its steps differ "
                       "from an uninterrupted run's (JaxBDF and JaxRadau with their saved state, and gradient descent, resume "
                       "exactly)",
                       err=True)
        _report_run(result, resume)
        return
    try:
        resolved = load_config(config, set_)
        if out is not None:
            check_output_dir(out)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepared = prepare(resolved)  # validate everything before a folder is made
        for warning in caught:
            typer.echo(f"flowsim: warning: {warning.message}", err=True)
    except (ConfigError, ValueError) as error:
        _fail(str(error))
    if out is None:
        try:
            run_dir = new_run_dir(Path("runs"), config.stem if config else "default")
        except (ValueError, OSError) as error:
            _fail(f"cannot make a run directory under 'runs': {error}")
    else:
        if out.exists() and any(out.iterdir()):
            _fail(f"--out {str(out)!r} exists and is not empty; choose a new folder")
        run_dir = out
    try:
        result = execute_run(resolved, run_dir, progress=not quiet, prepared=prepared)
    except OutputsInterrupted as error:
        _stop_interrupted(f"flowsim: {error}")
    except OutputWriteError as error:
        _fail(str(error), code=1)
    except ConfigError as error:  # the folder is in use by another process
        _fail(str(error))
    _report_run(result, run_dir)


def _report_run(result, run_dir: Path) -> None:
    """The stage table, the status line and the run directory; the exit status says how it ended."""
    from flowsim.solve.status import Status

    if result.status == Status.INTERRUPTED:
        _stop_interrupted(f"interrupted at t = {result.t_reached:.6g} ({len(result.trajectory)} points saved in {run_dir}); "
                          f"continue with: flowsim run --resume {run_dir}")
    if (run_dir / "stages.txt").is_file():
        typer.echo((run_dir / "stages.txt").read_text().rstrip())
    stats = result.stats
    rejected = "" if stats.n_rejected is None else f" ({stats.n_rejected} rejected)"
    typer.echo(
        f"{result.status_name}: {result.message}\n"
        f"  method {result.method}, {stats.n_steps} steps{rejected}, nfev {stats.nfev}, njev {stats.njev}; "
        f"compiling {stats.compile_seconds:.1f} s, solving {stats.solve_seconds:.2f} s; "
        f"final loss {result.trajectory.loss[-1]:.6g} at t = {result.trajectory.t[-1]:g}\n"
        f"  run directory: {run_dir}"
    )
    if not result.success:
        raise typer.Exit(code=1)


@app.command(short_help="Label the stages of a run directory.")
def stages(run_dir: Path = typer.Argument(..., help="A run directory written by `flowsim run`.")) -> None:
    """Label the stages of a run (condensation, focus, dilution, restart, plateau) and print them."""
    from flowsim.config import ConfigError
    from flowsim.runs.labelling import label_run, partial_note
    from flowsim.runs.rundir import check_not_in_use

    try:
        check_not_in_use(run_dir)  # its stages.json would go stale as the run goes on
        report = label_run(run_dir)
        note = partial_note(run_dir)
    except KeyboardInterrupt:  # observables.npz (a cache) and stages.json are written whole or not at all
        _stop_interrupted(f"flowsim: interrupted while labelling {run_dir}: stages.json was not written; the same "
                          "command labels it again")
    except (FileNotFoundError, ConfigError, ValueError) as error:
        _fail(str(error))
    if note:
        typer.echo(note)
    typer.echo(report.table())
    typer.echo(f"written: {run_dir / 'stages.json'}")


@app.command(short_help="The theory's predicted stage times for a configuration.")
def predict(
    config: Optional[Path] = typer.Argument(None, help="TOML config; the paper default when omitted."),
    set_: List[str] = typer.Option([], "--set", help="Override a key: section.key=TOML-literal (repeatable)."),
    tier: str = typer.Option("both", "--tier", help="both: the formulas and the reduced flows (about 7 s at d = 4, "
                             "minutes at d = 1001); formula: the closed forms alone, no flow integrated (2 s at d = 4)."),
) -> None:
    """Print the theory's predicted stage onsets for a configuration (mean-field one-layer model)."""
    from flowsim.config import ConfigError, load_config
    from flowsim.runs.predictions import cached_prediction
    from flowsim.common.progress import TICK_SECONDS, ticking
    from theory.predict import formula_line, predict_formulas_only, table

    if tier not in ("both", "formula"):
        _fail(f"--tier must be 'both' or 'formula', got {tier!r}")
    if tier == "formula":
        try:
            with _warnings_as_lines():
                rows, formulas = predict_formulas_only(load_config(config, set_))
        except (ConfigError, ValueError) as error:
            _fail(str(error))
        except RuntimeError as error:  # the curvature's linear solve
            _fail(f"the formulas failed: {error}", code=1)
        typer.echo(table(rows, measured=False))
        typer.echo(formula_line(formulas))
        return
    try:
        with ticking(_working, every=2 * TICK_SECONDS), _warnings_as_lines():
            prediction = cached_prediction(load_config(config, set_), progress=_progress)
    except KeyboardInterrupt:  # a prediction is cached whole or not at all
        _stop_interrupted("flowsim: interrupted while predicting: nothing was cached; the same command predicts again")
    except ConfigError as error:
        _fail(str(error))
    except RuntimeError as error:  # a numerical failure of the theory's own integrations
        _fail(f"the prediction failed: {error}", code=1)
    typer.echo(table(prediction.rows, measured=False))
    typer.echo(prediction.constants)


@app.command(short_help="Predicted stage times beside those a run shows.")
def compare(run_dir: Path = typer.Argument(..., help="A run directory written by `flowsim run`.")) -> None:
    """Put predicted stage onsets beside the detected ones; writes compare.json in the run directory."""
    from flowsim.config import ConfigError
    from flowsim.runs.labelling import check_labelable, partial_note
    from flowsim.runs.rundir import check_not_in_use, load_run
    from flowsim.runs.predictions import COMPARE_JSON, compare_run
    from flowsim.common.progress import TICK_SECONDS, ticking
    from theory.predict import table

    try:
        check_not_in_use(run_dir)  # its compare.json would go stale as the run goes on
        check_labelable(run_dir)
        load_run(run_dir)  # every file checked before the (slower) predictions
        note = partial_note(run_dir)
        with ticking(_working, every=2 * TICK_SECONDS), _warnings_as_lines():
            rows, prediction = compare_run(run_dir, progress=_progress)
    except KeyboardInterrupt:
        _stop_interrupted(f"flowsim: interrupted while predicting: nothing was cached and {COMPARE_JSON} was not written; "
                          "the same command predicts again")
    except (FileNotFoundError, ConfigError, ValueError) as error:
        _fail(str(error))
    except RuntimeError as error:  # a numerical failure of the theory's own integrations
        _fail(f"the prediction failed: {error}", code=1)
    if note:
        typer.echo(note)
    typer.echo(table(rows))
    typer.echo(prediction.constants)
    typer.echo(f"written: {run_dir / COMPARE_JSON}")


@app.command("compare-runs")
def compare_runs(
    run_dirs: List[Path] = typer.Argument(..., help="Run directories (one-layer or two-layer)."),
    loss_target: Optional[float] = typer.Option(None, "--loss-target", help="Report when each run's loss first reaches this."),
    figure: Path = typer.Option(Path("compare-runs.png"), "--figure",
                                help="Where the one-layer runs' overlay figure goes (loss, σ(W0), attention entropies)."),
) -> None:
    """Runs side by side. One-layer runs (up to four): final loss, stage onsets and an overlay figure.
    Two-layer runs: the premature-specialisation probes and the pathwise growth factors (cached in each
    run's pathwise.npz)."""
    from flowsim.config import ConfigError, load_config
    from flowsim.runs.rundir import CONFIG_FILE

    if loss_target is not None and not math.isfinite(loss_target):
        _fail(f"--loss-target {loss_target} is not a finite number; expected a loss value such as 0.5")
    try:
        kinds = {run_dir: load_config(run_dir / CONFIG_FILE).model.kind for run_dir in run_dirs}
    except (FileNotFoundError, ConfigError) as error:
        _fail(str(error))
    one_layer = [run_dir for run_dir in run_dirs if kinds[run_dir] == "one_layer"]
    two_layer = [run_dir for run_dir in run_dirs if kinds[run_dir] != "one_layer"]
    if one_layer:
        from flowsim.runs.runs_compared import compare_one_layer_runs

        if figure.is_dir() or not figure.parent.is_dir():  # the figure is drawn for one-layer runs only
            _fail(f"--figure {figure} is not a file in an existing folder; expected a path such as compare-runs.png")
        try:
            table, written = compare_one_layer_runs(one_layer, figure, loss_target)
        except KeyboardInterrupt:  # each run's observables.npz (a cache) and the figure are written whole or not at all
            _stop_interrupted(f"flowsim: interrupted while comparing the runs: {figure} was not written; the same command "
                              "compares them again")
        except (FileNotFoundError, ConfigError, ValueError) as error:
            _fail(str(error))
        typer.echo(table)
        typer.echo(f"written: {written}")
    if two_layer:
        if one_layer:
            typer.echo("")
        from flowsim.runs.runs_compared import compare_two_layer_runs

        try:
            typer.echo(compare_two_layer_runs(two_layer, loss_target))
        except (FileNotFoundError, ConfigError, ValueError) as error:
            _fail(str(error))


@app.command(short_help="Regenerate the paper figures.")
def figures(
    only: List[str] = typer.Option([], "--only", help="Build only this figure (repeatable; --list names them); default: all."),
    out: Path = typer.Option(Path("figures-out"), "--out", help="Where the PNG, PDF and caption files go."),
    cache: Path = typer.Option(Path("runs/figures"), "--cache", help="Run directories the figures read (computed when missing)."),
    tiny: bool = typer.Option(False, "--tiny", help="Short runs instead of the paper's: a quick check that every figure builds."),
    list_: bool = typer.Option(False, "--list", help="Name every figure (the names --only takes), what it shows and its cost."),
) -> None:
    """Regenerate the paper figures (running the simulations they need once, then only redrawing)."""
    from figures import FigureInputError, build_figures, figure_list

    from flowsim.runs.rundir import check_output_dir

    built_now: list[str] = []  # the figures this command finished, for an interrupt's message

    def report(line: str) -> None:
        name, _, rest = line.partition(": ")
        if not rest.startswith(("building", "not built")):  # "NAME: 1.2 s  caption": finished
            built_now.append(name)
        typer.echo(line)

    try:
        if list_:
            typer.echo("\n".join(figure_list(out)))
            return
        check_output_dir(out)
        check_output_dir(cache, "--cache")
        build_figures(out, cache, only, tiny=tiny, report=report)
    except (ValueError, FigureInputError) as error:
        _fail(str(error))
    except KeyboardInterrupt:
        built = [name for name in built_now if (out / f"{name}.png").is_file()]
        done = f"{', '.join(built)} written in {out}" if built else "no figure was written"
        _stop_interrupted(f"interrupted: {done}; the same command builds the figures again from the runs cached so far")
    typer.echo(f"written: {out}")


DATA_DIR_HELP = ("Folder of the corpora (data.data_dir); default: the first of $FLOWSIM_DATA_DIR, the user data folder "
                 "(flowsim data fetch) and shared/data beside the repository that holds them.")


def _data_dir_override(data_dir: Optional[Path]) -> list[str]:
    """--data-dir as the --set it stands for (a TOML string literal)."""
    return [] if data_dir is None else [f"data.data_dir={json.dumps(str(data_dir))}"]


data_app = typer.Typer(no_args_is_help=True, help="The text corpora: where flowsim finds them, and fetching them.")
app.add_typer(data_app, name="data", short_help="Fetch the text corpora (WikiText-2, TinyStories).")


@data_app.command("fetch", short_help="Download a corpus into the user data folder (needs the network).")
def data_fetch(
    corpus: str = typer.Argument(..., help="wikitext2 or tinystories."),
    to: Optional[Path] = typer.Option(None, "--to", help="Folder to write into (default: the user data folder, searched by the bridge)."),
    from_: Optional[str] = typer.Option(None, "--from", help="A mirror holding the same file names: its https:// or file: URL, or a local folder."),
) -> None:
    """Download a corpus and prepare it as the bridge reads it, checking every file; files already there are kept
    once checked."""
    from flowsim.common.interrupts import signals_interrupt
    from flowsim.corpora import fetch

    try:
        with signals_interrupt():
            folder = fetch(corpus, to, from_, say=lambda line: typer.echo(f"flowsim: {line}", err=True))
    except KeyboardInterrupt:  # each file is put in place whole or not at all
        _stop_interrupted(f"flowsim: interrupted while fetching {corpus}: the file being downloaded was not kept (files "
                          "already complete are); the same command fetches the rest")
    except ValueError as error:
        _fail(str(error))
    except (ConnectionError, OSError) as error:
        _fail(str(error), code=1)
    typer.echo(f"written: {folder}")


@data_app.command("where", short_help="Where the bridge looks for a corpus, and where it finds it.")
def data_where(corpus: str = typer.Argument(..., help="wikitext2 or tinystories.")) -> None:
    """Print the search order, each folder with whether it holds the corpus, and the one the bridge would read."""
    from flowsim.corpora import CORPUS_FILES, data_dir_candidates, holds

    if corpus not in CORPUS_FILES:
        _fail(f"no such corpus {corpus!r}; known: {sorted(CORPUS_FILES)}")
    found = None
    for origin, folder in data_dir_candidates():
        here = holds(folder, corpus)
        found = found or (folder if here else None)
        typer.echo(f"{'holds it' if here else 'lacks it'}: {folder} ({origin})")
    if found is None:
        _fail(f"{corpus} is in none of these folders: `flowsim data fetch {corpus}` downloads it", code=1)
    typer.echo(f"the bridge reads {corpus} from {found}")


bridge_app = typer.Typer(no_args_is_help=True, help="PyTorch pretraining runs beside the ODE (needs the bridge extra: torch).")
app.add_typer(bridge_app, name="bridge", short_help="PyTorch pretraining beside the ODE (the bridge extra).")


@bridge_app.command("train", short_help="Train a torch model into a resumable run directory.")
def bridge_train(
    config: Optional[Path] = typer.Argument(None, help="Bridge TOML config; the default Markov run when omitted."),
    set_: List[str] = typer.Option([], "--set", help="Override a key: section.key=TOML-literal (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory; an existing one with the same config resumes."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help=DATA_DIR_HELP),
    check_flow_regime: bool = typer.Option(False, "--check-flow-regime",
                                           help="Also train at lr/2 for twice the steps and compare on the t = lr x steps clock "
                                                "(OUT/lr, OUT/lr_half, OUT/regime.json); exit 1 outside the flow regime."),
) -> None:
    """Train a torch model (seeded, resumable) and write a run directory flowsim can label."""
    from flowsim.config import ConfigError
    from flowsim.runs.rundir import check_output_dir, new_run_dir

    made: Path | None = None  # a folder this command made, removed again if the run fails before writing to it
    run_dir = out
    try:
        if out is not None:
            check_output_dir(out)  # before the bridge's import: a wrong --out is named with or without torch
        from flowsim.bridge.config import load_bridge_config
        from flowsim.bridge.train import train

        resolved = load_bridge_config(config, [*set_, *_data_dir_override(data_dir)])
        if out is None:
            made = run_dir = new_run_dir(Path("runs"), f"bridge-{config.stem if config else 'markov'}")
        else:
            run_dir = out
        if check_flow_regime:
            from flowsim.bridge.regime import REGIME_JSON, check_flow_regime as check

            report = check(resolved, run_dir, progress=not quiet)
        else:
            with _warnings_as_lines():
                result = train(resolved, run_dir, progress=not quiet)
    except (ConfigError, ImportError, FileNotFoundError, FloatingPointError, ValueError) as error:
        if made is not None and made.is_dir() and not any(made.iterdir()):
            made.rmdir()  # the folder made for this run holds nothing: leave no trace
        _fail(str(error))
    except OSError as error:
        _fail_writing(error, f"the run as of its last checkpoint is kept in {run_dir or 'runs'}")
    if check_flow_regime:
        typer.echo(report.table())
        typer.echo(f"written: {run_dir / REGIME_JSON}")
        if not report.in_flow_regime:
            raise typer.Exit(code=1)
        return
    if result.interrupted:
        _stop_interrupted(f"interrupted at step {result.steps_done} (everything saved in {run_dir}); the same command "
                          f"with --out {run_dir} continues it")
    if (run_dir / "stages.txt").is_file():
        typer.echo((run_dir / "stages.txt").read_text().rstrip())
    last = result.log[-1]
    typer.echo(f"{'finished' if result.finished else 'stopped'} at step {result.steps_done}: validation loss "
               f"{last['val_loss']:.4f} (perplexity {last['val_perplexity']:.4g}) at t = {last['t']:g}\n  run directory: {run_dir}")


@bridge_app.command("compare", short_help="A trained run's stage times beside its ODE's.")
def bridge_compare(run_dir: Path = typer.Argument(..., help="A run directory written by `flowsim bridge train`.")) -> None:
    """Stage times of the ODE (same chain and start, or the text's Markov surrogate) beside the run's."""
    from flowsim.config import ConfigError

    try:
        from flowsim.bridge.compare import (
            BRIDGE_COMPARE_JSON,
            OVERLAY_FIGURE,
            bridge_table,
            compare_bridge_run,
        )

        rows, agreement, description = compare_bridge_run(run_dir, progress=True)
    except (ConfigError, ImportError, FileNotFoundError, ValueError) as error:
        _fail(str(error))
    except KeyboardInterrupt:
        _stop_interrupted("flowsim: interrupted before the ODE was solved: nothing was written; the same command solves it again")
    typer.echo(f"ODE: {description['ode']}")
    typer.echo(bridge_table(rows, agreement))
    typer.echo(f"written: {run_dir / BRIDGE_COMPARE_JSON}, {run_dir / OVERLAY_FIGURE}")


@bridge_app.command("validate", short_help="SGD, the surrogate's ODE and the theory, side by side.")
def bridge_validate(
    corpus: str = typer.Argument(..., help="wikitext2 or tinystories (the shipped d = 1001 example), or a bridge config .toml."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default runs/validate-CORPUS); run again to resume."),
    set_: List[str] = typer.Option([], "--set", help="Override a key of the bridge config: section.key=TOML-literal."),
    no_theory: bool = typer.Option(False, "--no-theory", help="Only SGD and the ODE (the theory's rank-r flows are the slowest part)."),
    short: bool = typer.Option(False, "--short", help="The example's first stages only (CORPUS-onelayer-short.toml), not its whole cycle."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
    flow_at_s: bool = typer.Option(False, "--flow-at-s", help="Also where the loss at s's d³ covariance does not fit "
                                   "(d = 1001): its flow with the Markov correlations of the 64 most frequent types "
                                   "(tens of minutes on a CPU)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help=DATA_DIR_HELP),
) -> None:
    """Train SGD, integrate the surrogate's ODE and run the theory from the same start; write the table of events."""
    from flowsim.config import ConfigError
    from flowsim.runs.rundir import check_output_dir

    out = out if out is not None else Path("runs") / f"validate-{Path(corpus).stem}{'-short' if short else ''}"
    try:
        check_output_dir(out)
        from flowsim.bridge.validate import VALIDATE_JSON, VALIDATE_MD, validate

        payload = validate(corpus, out, [*set_, *_data_dir_override(data_dir)], theory=not no_theory, short=short,
                           folded_finite_s=flow_at_s, progress=lambda message: typer.echo(f"flowsim: {message}", err=True),
                           bars=not quiet)
    except (ConfigError, ImportError, FileNotFoundError, FloatingPointError, ValueError) as error:
        _fail(str(error))
    except KeyboardInterrupt:
        _stop_interrupted(f"interrupted: what is done is saved in {out}; the same command continues")
    typer.echo((out / VALIDATE_MD).read_text().rstrip())
    typer.echo("seconds: " + ", ".join(f"{side} {value:.0f}" for side, value in payload["seconds"].items()))
    typer.echo(f"written: {out / VALIDATE_JSON}, {out / VALIDATE_MD}, {out / 'sgd' / 'overlay.png'}")


@app.command(short_help="A grid of configurations x seeds, labelled, into a table.")
def sweep(
    config: Optional[Path] = typer.Argument(None, help="TOML config; the paper default when omitted."),
    grid: List[str] = typer.Option([], "--grid", help="section.key=[v1, v2, ...] (repeatable): the grid's axes."),
    seeds: int = typer.Option(1, "--seeds", help="Seeds 0 .. N-1 of every grid point (init.seed)."),
    set_: List[str] = typer.Option([], "--set", help="Override a key of every run: section.key=TOML-literal."),
    out: Path = typer.Option(Path("sweeps/sweep"), "--out", help="Sweep folder; run again to resume it."),
    backend: str = typer.Option("local", "--backend", help="local (processes here) or dask (a Dask cluster)."),
    workers: int = typer.Option(1, "--workers", help="Worker processes (local pool or LocalCluster)."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Dask scheduler address (default: a LocalCluster)."),
    batch: int = typer.Option(4, "--batch", help="Runs integrated together as one JaxRadau batch (one set-up per batch)."),
    force_new: bool = typer.Option(False, "--force-new", help="Recompute rows in --out that were made with other settings."),
) -> None:
    """Run a grid of configurations x seeds, label every run's stages, and write a table and a phase diagram."""
    from flowsim.config import ConfigError
    from flowsim.solve.status import Status
    from flowsim.runs.sweep import parse_grid, run_sweep, summary_table
    from flowsim.runs.sweep_backends import ClusterLost

    try:
        rows = run_sweep(config, parse_grid(grid), seeds, out, base_overrides=set_, backend=backend, workers=workers,
                         scheduler=scheduler, batch=batch, force_new=force_new,
                         progress=lambda message: typer.echo(f"flowsim: {message}", err=True))
    except (ConfigError, ValueError) as error:
        _fail(str(error))
    except ClusterLost as error:
        _fail(f"{error} ({_rows_written(out)})", code=1)
    except OSError as error:
        written = _rows_written(out)
        _fail_writing(error, written if written == "no row was written" else f"{written}, kept")
    except KeyboardInterrupt:
        _stop_interrupted(f"interrupted: {_rows_written(out)}; the same command continues with the rest")
    failed = [row["name"] + (f" ({row['reason']})" if "reason" in row else "") for row in rows
              if row["status"] != Status.FINISHED.label]
    typer.echo(summary_table(rows))
    typer.echo(f"{len(rows)} rows: {out / 'sweep.csv'}, {out / 'phase_diagram.png'}")
    if failed:
        typer.echo(f"runs that did not finish: {', '.join(failed)}", err=True)
        raise typer.Exit(code=1)


def _rows_written(out: Path) -> str:
    """How many row files a sweep folder holds, and where, in words ("no row was written" when there is no folder)."""
    rows = len(list((out / "rows").glob("*.json"))) if (out / "rows").is_dir() else 0
    return f"{rows} row{'s are' if rows != 1 else ' is'} written in {out / 'rows'}" if rows else "no row was written"


@app.command("config", short_help="Every config key with its default, type and meaning.")
def config_keys(
    section: Optional[str] = typer.Argument(None, help="Only this section, e.g. solver."),
    bridge: bool = typer.Option(False, "--bridge", help="The keys of `flowsim bridge train` configs."),
) -> None:
    """Print every config key with its default, type and meaning, as a TOML file of the defaults."""
    from flowsim.config import ConfigError, reference_toml

    if bridge:
        try:
            from flowsim.bridge.config import BridgeConfig as schema
        except ImportError as error:
            _fail(str(error))
    else:
        from flowsim.config import RunConfig as schema
    try:
        typer.echo(reference_toml(schema, section), nl=False)
    except ConfigError as error:
        _fail(str(error))


@app.command()
def version() -> None:
    """Print the versions of flowsim and its numerical libraries."""
    from flowsim.runs.rundir import library_versions

    for name, value in library_versions().items():
        typer.echo(f"{name} {value}")


def main() -> None:
    try:
        app(prog_name="flowsim")
    except SystemExit as stop:  # typer turns a Ctrl-C no command caught (in its imports or set-up) into a silent 130
        if stop.code == EXIT_INTERRUPTED and not _interrupt_reported:
            typer.echo(INTERRUPTED_STARTING, err=True)
        raise
    except KeyboardInterrupt:  # a Ctrl-C while typer builds the command line, before click could turn it into 130
        if not _interrupt_reported:
            typer.echo(INTERRUPTED_STARTING, err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except OSError as error:  # a path the file system cannot even look up, wherever a command met it
        if error.errno not in (errno.ENAMETOOLONG, errno.ELOOP):
            raise
        shown = str(error.filename)
        shown = shown if len(shown) <= 80 else f"{shown[:40]}...{shown[-20:]} ({len(shown.encode())} bytes)"
        from flowsim.runs.rundir import NAME_MAX, PATH_MAX

        why = (f"a file or folder name holds at most {NAME_MAX} bytes and a path {PATH_MAX - 1}"
               if error.errno == errno.ENAMETOOLONG else "it runs through a loop of symbolic links")
        typer.echo(f"flowsim: error: {shown}: {error.strerror}: {why}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
