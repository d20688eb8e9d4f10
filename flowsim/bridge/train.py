"""A bridge training run: seeded, resumable, logging flowsim observables at log-spaced steps.

    RUN_DIR/config.toml      the resolved bridge configuration
    RUN_DIR/meta.json        status, seed, device, steps done, wall time, library versions (with torch)
    RUN_DIR/checkpoint.pt    model, optimizer and schedule state at the last saved step (for resuming)
    RUN_DIR/log.csv          step, t = lr × step, train loss, validation loss and perplexity per checkpoint
    RUN_DIR/observables.npz  flowsim observables at the checkpoints (t = lr × step)
    RUN_DIR/trajectory.npz   paper models: the flowsim parameters at the checkpoints
    RUN_DIR/summary.png      one-layer runs: flowsim's summary figure with the detected stages

Batches are pure functions of (data.seed, step), so a run that is stopped and resumed
(``flowsim bridge train CONFIG --out RUN_DIR`` again) ends with the same parameters as
an uninterrupted one. Everything is written atomically; the checkpoint is refreshed at
every logged step, on interruption and every ``CHECKPOINT_EVERY_S`` seconds.
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import os
import math
import pickle
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from flowsim.bridge.config import BridgeConfig, load_bridge_config
from flowsim.bridge.data import Corpus, load_corpus, markov_batch
from flowsim.bridge.models import GPT, GPTConfig, torch_model_for
from flowsim.bridge.observables import (
    ProbeSet,
    build_probe_set,
    checkpoint_observables,
    stack_observables,
)
from flowsim.bridge.optim import QKSchedule, WindowSmoothing, build_optimizer
from flowsim.bridge.surrogate import text_surrogate
from flowsim.common.budget import check_memory
from flowsim.model.chains import MarkovChain
from flowsim.config import ConfigError, changed_keys, load_config
from flowsim.common.interrupts import StopRequest, run_in_chunks, stop_requests
from flowsim.common.progress import progress_bar
from flowsim.common.io import DamagedFileError, file_digest, write_atomic_bytes
from flowsim.model.models import model_from_config
from flowsim.observe.observables import MEASURED_BY, folded_types
from flowsim.runs.rundir import (
    CONFIG_FILE,
    SUMMARY_FIGURE,
    TRAJECTORY_FILE,
    folder_lock,
    library_versions,
    read_meta,
    this_process,
    write_config,
    write_meta,
)
from flowsim.solve.status import Status
from flowsim.solve.trajectory import Trajectory

CHECKPOINT_FILE, LOG_FILE = "checkpoint.pt", "log.csv"
CHECKPOINT_EVERY_S = 30.0
PROBE_POOL = 20_000
# Chains above this many states fold them as text does: unfolded, a d = 1001 chain's run stored 8 MB of attention at
# every checkpoint (benchmarks/MEASUREMENTS.md, "A large chain's bridge run folds its states")
MARKOV_UNFOLDED_STATES = 64
VALIDATION_SEED_OFFSET = 1_000_003  # validation batches use seeds no training step uses


THREADS_VARIABLE = "FLOWSIM_TORCH_THREADS"
# torch's default, one thread per core, made a d = 32 step 20-35 times slower on a 2-core machine other jobs shared
# (0.5 s against 17-25 ms at one thread): its threads wait on each other behind the other jobs' (benchmarks/bridge_threads.py)
DEFAULT_CPU_THREADS = 1


def choose_threads(device: torch.device) -> int:
    """Set torch's intra-op threads for training on ``device`` and return the number: on a CPU
    ``$FLOWSIM_TORCH_THREADS`` (a count, or "torch" for torch's own choice), else torch's own choice where
    $OMP_NUM_THREADS says it, else DEFAULT_CPU_THREADS; on a GPU torch's own. A bad value is a ConfigError."""
    wanted = os.environ.get(THREADS_VARIABLE, "").strip()
    if device.type != "cpu" or wanted == "torch" or (not wanted and os.environ.get("OMP_NUM_THREADS")):
        return torch.get_num_threads()
    if wanted:
        if not wanted.isdigit() or int(wanted) < 1:
            raise ConfigError(f"${THREADS_VARIABLE} = {wanted!r}: expected a number of threads >= 1, or 'torch' for "
                              "torch's own choice")
        threads = int(wanted)
    else:
        threads = DEFAULT_CPU_THREADS
    torch.set_num_threads(threads)
    return threads


def select_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("data.device = 'cuda' but no CUDA device is available")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


@dataclass
class DataSource:
    """What a run draws from: training batches by step, validation batches, the probe set."""

    config: BridgeConfig
    chain: MarkovChain | None
    corpus: Corpus | None
    surrogate: MarkovChain | None = None  # the text's bigram chain, the training batches' source under data.train_on = "surrogate"

    @property
    def vocab_size(self) -> int:
        return self.chain.d if self.chain is not None else len(self.corpus.vocabulary)

    @property
    def frequencies(self) -> np.ndarray:
        return np.asarray(self.chain.pi) if self.chain is not None else self.corpus.frequencies

    @property
    def token_names(self) -> list[str]:
        return [str(i) for i in range(self.vocab_size)] if self.corpus is None else list(self.corpus.vocabulary)

    def fold(self) -> np.ndarray:
        """The folded type of every token: the top log.fold_d types, the tracked ones, then "other"; a chain of at
        most MARKOV_UNFOLDED_STATES states that tracks none keeps its states."""
        log, names = self.config.log, self.token_names
        if self.chain is not None and self.vocab_size <= MARKOV_UNFOLDED_STATES and not log.track:
            return np.arange(self.vocab_size)
        missing = [word for word in log.track if word not in names]
        if missing:
            raise ConfigError(f"log.track names {'states' if self.corpus is None else 'words'} outside the vocabulary: {missing}")
        if not 2 <= log.fold_d < self.vocab_size:
            raise ConfigError(f"log.fold_d = {log.fold_d} is invalid: expected an integer in [2, {self.vocab_size - 1}]")
        return folded_types(self.frequencies, log.fold_d, tuple(names.index(w) for w in log.track))

    def batch(self, step: int, split: str = "train") -> torch.Tensor:
        data = self.config.data
        seed = data.seed if split == "train" else data.seed + VALIDATION_SEED_OFFSET
        if self.chain is not None:
            return markov_batch(self.chain, data.batch_size, data.s + 1, seed, step)
        if self.surrogate is not None and split == "train":
            return markov_batch(self.surrogate, data.batch_size, data.s + 1, seed, step)
        return self.corpus.batch(data.batch_size, data.s + 1, seed, step, split)

    def probe_set(self) -> ProbeSet:
        data, fold = self.config.data, self.fold()
        if self.chain is not None:
            pool = markov_batch(self.chain, PROBE_POOL, data.s, data.seed + 2 * VALIDATION_SEED_OFFSET, 0)
        else:
            pool = self.corpus.windows_ending_in(fold, self.config.log.probe_per_type, data.s, data.seed, "valid")
        return build_probe_set(pool, fold, self.frequencies, self.config.log.probe_per_type)


def build_data(config: BridgeConfig) -> DataSource:
    """The run's data, its log.fold_d and log.track checked (before anything is written)."""
    if config.data.kind == "markov":
        data = DataSource(config, MarkovChain.from_config(config.chain), None)
    else:
        try:
            files = (config.data.train_file, config.data.valid_file) if config.data.kind == "text" else None
            corpus = load_corpus(config.data.kind, config.data.vocab_size, config.data.data_dir, config.data.source, files)
        except (ValueError, FileNotFoundError) as error:
            raise ConfigError(str(error)) from None
        window = config.data.s + 1  # a batch's sequences: s tokens of context and the next token
        for split, ids, named in (("training", corpus.train, config.data.train_file),
                                  ("validation", corpus.valid, config.data.valid_file)):
            if len(ids) <= window:
                where = f" ({named})" if named else ""
                raise ConfigError(f"{config.data.kind}: the {split} text{where} has {len(ids)} tokens; windows of data.s + 1 "
                                  f"= {window} tokens at random offsets need at least {window + 1}: lower data.s or use a "
                                  "longer text")
        if config.data.kind == "text" and config.data.train_file == config.data.valid_file:
            warnings.warn("data.valid_file is data.train_file: the validation loss is measured on the training text",
                          stacklevel=2)
        surrogate = text_surrogate(corpus, config.compare)[0] if config.data.train_on == "surrogate" else None
        data = DataSource(config, None, corpus, surrogate)
    data.fold()
    return data


def build_model(config: BridgeConfig, vocab_size: int) -> torch.nn.Module:
    """The torch model; paper models start from flowsim's seeded N(0, eps²) parameters."""
    dtype = getattr(torch, config.dtype)
    if config.model.kind == "gpt":
        m = config.model
        try:
            gpt = GPTConfig(vocab_size=vocab_size, n_layer=m.n_layer, d_model=m.d_model, n_head=m.n_head,
                            seq_len=config.data.s, ffn=m.ffn, norm=m.norm, bias=m.bias, ffn_mult=m.ffn_mult)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return GPT(gpt, seed=config.data.seed).to(dtype)
    spec = model_from_config(config.model, vocab_size)
    model = torch_model_for(spec).to(dtype)
    return model.load_flowsim_params(spec.init(config.model.init_eps, config.data.seed))


def batch_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: the last position for the paper models (flowsim's loss),
    every position for the GPT family."""
    if isinstance(model, GPT):
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    return F.cross_entropy(model(tokens[:, :-1]), tokens[:, -1])


def training_memory_bytes(config: BridgeConfig, vocab_size: int) -> float:
    """A rough peak of one training step: the activations of the forward pass, kept for the
    backward (x3), plus the validation batches held on the device. Per sequence of length s:
    one-layer s (m + k + 2) + V, two-layer s (6m + f) + 2 s² + V, GPT layers·(16 s d_model +
    2 heads s²) + 2 s V numbers."""
    m, data = config.model, config.data
    s, batch = data.s, data.batch_size
    if m.kind == "gpt":
        per_sequence = m.n_layer * (16 * s * m.d_model + 2 * m.n_head * s * s) + 2 * s * vocab_size
    elif m.kind == "two_layer":
        per_sequence = s * (6 * m.m + m.ffn_width) + 2 * s * s + vocab_size
    else:
        per_sequence = s * (m.m + m.k + 2) + vocab_size
    item = 8 if config.dtype == "float64" else 4
    return 3.0 * item * batch * per_sequence + 8.0 * config.log.val_batches * batch * (s + 1)


def check_training_size(config: BridgeConfig, vocab_size: int) -> None:
    """Refuse a run whose training step would not fit the memory budget (``flowsim.common.budget``)."""
    check_memory(training_memory_bytes(config, vocab_size),
                 f"a training step of model.kind = {config.model.kind!r} with data.s = {config.data.s}, "
                 f"data.batch_size = {config.data.batch_size} and {vocab_size} tokens",
                 "lower data.s, data.batch_size or data.vocab_size")


CHECKPOINT_REMEDY = "delete it to train this run from the start"
# what a checkpoint holds besides tensors and plain values: the observables' and parameters' numpy arrays (both
# module names: numpy 2 pickles numpy._core, numpy 1 numpy.core); rebuilding an array runs no code of the file's
_reconstruct = np.zeros(0).__reduce__()[0]  # numpy's array constructor for pickles
CHECKPOINT_GLOBALS = [np.ndarray, np.dtype, *{type(np.dtype(kind)) for kind in ("float64", "float32", "int64", "bool")},
                      *((_reconstruct, f"{module}.multiarray._reconstruct") for module in ("numpy._core", "numpy.core"))]


def read_checkpoint(path: Path, device) -> dict:
    """checkpoint.pt as the mapping ``Trainer.save`` writes, loaded with ``weights_only=True``: tensors, plain Python
    values and numpy arrays (``CHECKPOINT_GLOBALS``) only, so nothing in the file is executed; a file that names
    anything else, cannot be read, or is not that mapping raises DamagedFileError. O(file size)."""
    if not path.is_file():  # a FIFO would block the read, a device never end it
        raise DamagedFileError(path, "not a regular file (a FIFO, a device or a folder)", CHECKPOINT_REMEDY)
    try:
        with torch.serialization.safe_globals(CHECKPOINT_GLOBALS):
            state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as error:
        named = re.search(r"GLOBAL (\S+)", str(error))
        what = f"names {named.group(1)}, code that loading would run" if named else "holds objects other than tensors, numbers and arrays"
        raise DamagedFileError(path, f"it {what}: refused", CHECKPOINT_REMEDY) from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError) as error:
        reason = str(error).splitlines()[0] if str(error) else ""
        raise DamagedFileError(path, f"{type(error).__name__}: {reason}", CHECKPOINT_REMEDY) from None
    shapes = {"model": dict, "optimizer": dict, "scheduler": dict, "step": int, "rows": list, "log": list, "params": list}
    wrong = [name for name, kind in shapes.items() if not isinstance(state, dict) or not isinstance(state.get(name), kind)]
    if wrong:
        found = f"a {type(state).__name__}" if not isinstance(state, dict) else f"no {', '.join(wrong)} of the expected kind"
        raise DamagedFileError(path, f"not a bridge checkpoint: {found}", CHECKPOINT_REMEDY)
    if not all(isinstance(entry, dict) for entry in (*state["rows"], *state["log"], *state["params"])):
        raise DamagedFileError(path, "not a bridge checkpoint: its rows, log or params are not mappings", CHECKPOINT_REMEDY)
    return state


def _save_torch_atomic(path: Path, state: dict) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic_bytes(path, buffer.getvalue())


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    finished: bool
    log: list[dict]
    interrupted: bool = False  # stopped by SIGINT / SIGTERM, everything saved: calling again resumes


def _run_identity(config: BridgeConfig) -> dict:
    """The settings that make a run what it is: all but where its corpus happens to lie (data.data_dir, and a text
    run's data.train_file and data.valid_file, whose contents ``text_digests`` stand for) and [compare] (the ODE put
    beside it, cached by its own settings: ``flowsim.bridge.compare.ode_beside``)."""
    settings = config.to_dict()
    for key in ("data_dir", "train_file", "valid_file"):
        settings.get("data", {}).pop(key, None)
    settings.pop("compare", None)
    return settings


TEXT_DIGESTS = "text_sha256"  # meta.json's record of a text run's files, by their keys


def text_digests(config: BridgeConfig) -> dict:
    """The SHA-256 of a text run's training and validation files ({} for other data): what the run was trained on,
    wherever the files lie. O(the files' size)."""
    if config.data.kind != "text":
        return {}
    return {"data.train_file": file_digest(Path(config.data.train_file)), "data.valid_file": file_digest(Path(config.data.valid_file))}


def check_same_text(config: BridgeConfig, run_dir: Path) -> None:
    """ConfigError where a text run's files hold other text than the run recorded in meta.json (a run recorded
    before the digests were kept is taken as it is)."""
    recorded = read_meta(run_dir).get(TEXT_DIGESTS)
    if not isinstance(recorded, dict):
        return
    for key, digest in text_digests(config).items():
        if recorded.get(key) not in (None, digest):
            path = getattr(config.data, key.removeprefix("data."))
            raise ConfigError(f"{key} {path!r} holds "
                              f"another text than {run_dir} was trained on (SHA-256 {digest[:16]}..., recorded "
                              f"{str(recorded[key])[:16]}...); give the run's own text or choose a new folder")


def _saved_bridge_config(run_dir: Path) -> BridgeConfig:
    """The bridge configuration run_dir's config.toml records; ConfigError naming a `flowsim run` folder as one."""
    try:
        return load_bridge_config(run_dir / CONFIG_FILE)
    except ConfigError:
        try:
            load_config(run_dir / CONFIG_FILE)
        except ConfigError:
            raise ConfigError(f"{run_dir / CONFIG_FILE} is not a bridge run's config; choose a new folder") from None
        raise ConfigError(f"{run_dir} holds a `flowsim run` run, not a bridge run; choose a new folder for "
                          "`flowsim bridge train`") from None


def training_data_name(config: BridgeConfig) -> str:
    """What the run trains on, as its progress line says it: the corpus, or the bigram chain it stands for."""
    if config.data.kind != "markov" and config.data.train_on == "surrogate":
        return f"the bigram surrogate of {config.data.kind}"
    return config.data.kind


def train(config: BridgeConfig, run_dir: Path, *, progress: bool = True, stop_at_step: int | None = None) -> TrainResult:
    """Train (or resume) the configured run in ``run_dir``; ``stop_at_step`` stops early
    with everything saved, as an interrupted run would be (resume by calling again)."""
    device = select_device(config.data.device)  # settings are checked before anything is written
    threads = choose_threads(device)
    if config.data.kind != "markov":
        check_training_size(config, config.data.vocab_size + 1)  # before the corpus is read
    data = build_data(config)
    check_training_size(config, data.vocab_size)
    run_dir = Path(run_dir)
    toml_text = config.to_toml()
    # compared as settings, not as text: a run saved before a key with a default existed still resumes; where the
    # corpus files lie (data.data_dir) is not what the run is, so moved corpora resume too
    if (run_dir / CONFIG_FILE).is_file():
        saved, wanted = (_run_identity(c) for c in (_saved_bridge_config(run_dir), config))
        if saved != wanted:
            raise ConfigError(f"{run_dir} holds a run with a different configuration ({changed_keys(saved, wanted)}); "
                              "resume with the same config or choose a new folder")
        check_same_text(config, run_dir)
    with folder_lock(run_dir), stop_requests() as stop:
        return _train_locked(config, run_dir, data, device, toml_text, progress, stop_at_step, stop, threads)


def _train_locked(config: BridgeConfig, run_dir: Path, data: DataSource, device, toml_text: str, progress: bool,
                  stop_at_step: int | None, stop: StopRequest, threads: int) -> TrainResult:
    """``train`` once it holds the run directory's lock; SIGINT or SIGTERM (``stop``) ends it after the current
    step with everything saved and status "interrupted"."""
    trainer = Trainer(config, run_dir, data, device)  # built before anything is written: its failures leave no config
    trainer.resume()  # from checkpoint.pt, when there is one
    trainer.meta["torch_threads"] = threads
    write_config(run_dir, toml_text)
    started = time.perf_counter()
    if trainer.step == 0 and not trainer.log:
        trainer.record(trainer.evaluate())
        trainer.save(Status.RUNNING)
    end = config.optim.steps if stop_at_step is None else min(stop_at_step, config.optim.steps)
    with progress_bar(total=config.optim.steps, initial=trainer.step, disable=not progress, unit="step",
                      desc=f"{config.optim.name} on {training_data_name(config)}, lr = {config.optim.lr:g}") as bar:
        if trainer.step < end and not stop():
            run_in_chunks(lambda: trainer.advance(bar) < end, stop, lambda: trainer.save(Status.RUNNING), CHECKPOINT_EVERY_S)
    trainer.meta["wall_time_s"] = trainer.earlier_wall_s + time.perf_counter() - started  # every session's
    if stop():
        trainer.save(Status.INTERRUPTED)
        return TrainResult(run_dir, trainer.step, False, trainer.log, interrupted=True)
    trainer.save(Status.RUNNING)  # the last checkpoint; meta.json says how the run ended only once every output is written
    write_outputs(run_dir, config, data, trainer.probe.pi, trainer.log, trainer.rows, trainer.params)
    finished = trainer.step >= config.optim.steps
    ended = Status.FINISHED if finished else Status.STEP_LIMIT  # stopped before its steps: resumable
    write_meta(run_dir, {**trainer.meta, "status_name": ended.label, "steps_done": trainer.step, "steps": config.optim.steps})
    return TrainResult(run_dir, trainer.step, finished, trainer.log)


class Trainer:
    """One training run's state: the model, its optimiser (and window smoothing), the step reached, and what has been
    logged (``log``: losses; ``rows``: observables; ``params``: the paper model's parameters) at the checkpoint steps.
    ``checkpoint.pt`` holds all of it, so a run resumed from it continues bit for bit."""

    def __init__(self, config: BridgeConfig, run_dir: Path, data: DataSource, device):
        self.config, self.run_dir, self.data, self.device = config, run_dir, data, device
        self.model = build_model(config, data.vocab_size).to(device)
        optim = config.optim
        slow = self.model.slow_groups if optim.qk_rho != 1.0 else ()
        schedule = QKSchedule(optim.qk_rho, optim.qk_hold, optim.qk_ramp, optim.steps) if slow else None
        try:
            self.optimizer, self.scheduler = build_optimizer(self.model, optim.name, optim.lr, optim.weight_decay, slow,
                                                             schedule, optim.momentum)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.stepper = self.optimizer
        if optim.smoothing_a > 0:
            named = dict(self.model.named_parameters())
            stacks = [[named[name] for name in stack] for stack in self.model.repeated_blocks]
            self.stepper = WindowSmoothing(self.optimizer, stacks, optim.smoothing_a, optim.smoothing_variant)
        self.checkpoints = config.checkpoint_steps()
        self.probe = data.probe_set()
        self.validation = [data.batch(i, "valid").to(device) for i in range(config.log.val_batches)]
        self.autocast = device.type == "cuda" and isinstance(self.model, GPT)
        self.step, self.log, self.rows, self.params = 0, [], [], []
        self.earlier_wall_s = 0.0
        self.meta = {"status_name": Status.RUNNING.label, "started": _dt.datetime.now().isoformat(timespec="seconds"),
                     "seed": config.data.seed, "device": str(device),
                     "versions": {**library_versions(), "torch": torch.__version__}, **this_process()}
        if config.data.kind == "text":
            self.meta[TEXT_DIGESTS] = text_digests(config)

    def resume(self) -> None:
        """Take up the state saved in checkpoint.pt, if the run directory holds one (``read_checkpoint``: nothing in
        it is executed); a checkpoint that is not this run's is named as damaged."""
        path = self.run_dir / CHECKPOINT_FILE
        if not path.exists() and not path.is_symlink():
            return
        state = read_checkpoint(path, self.device)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DamagedFileError(path, f"not this run's state: {reason}", CHECKPOINT_REMEDY) from None
        self.step, self.rows, self.log, self.params = state["step"], state["rows"], state["log"], state["params"]
        earlier = read_meta(self.run_dir).get("wall_time_s", 0.0)  # the sessions before this one
        self.earlier_wall_s = float(earlier) if isinstance(earlier, (int, float)) and math.isfinite(earlier) else 0.0

    def advance(self, bar) -> int:
        """One optimiser step, logged and saved at the checkpoint steps; returns the steps done."""
        tokens = self.data.batch(self.step).to(self.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            loss = batch_loss(self.model, tokens)
        if not math.isfinite(loss.item()):
            self.diverged(f"the training loss became {loss.item()} at step {self.step}")
        self.stepper.zero_grad()
        loss.backward()
        self.stepper.step()
        self.scheduler.step()
        self.step += 1
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            self.diverged(f"the parameters became non-finite at step {self.step}")
        if self.step in self.checkpoints:
            self.record(loss.item())
            self.save(Status.RUNNING)
        last = self.log[-1]  # the step's own t, and the last checkpoint's loss dated by its own t
        bar.set_postfix_str(f"t = lr × step = {self.config.optim.lr * self.step:.4g}; validation loss "
                            f"{last['val_loss']:.4f} at the last checkpoint (t = {last['t']:.4g})", refresh=False)
        bar.update(1)
        return self.step

    def evaluate(self) -> float:
        """The mean loss over the validation batches."""
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            return float(np.mean([batch_loss(self.model, tokens).item() for tokens in self.validation]))

    def record(self, train_loss: float) -> None:
        """Log the losses, the observables and (paper models) the parameters at this step."""
        val_loss = self.evaluate()
        self.log.append({"step": self.step, "t": self.config.optim.lr * self.step, "train_loss": train_loss,
                         "val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 700.0))})
        try:
            row = checkpoint_observables(self.model, self.probe, self.data.frequencies)
        except torch.linalg.LinAlgError as error:  # parameters so large their SVD overflows
            self.diverged(f"the observables at step {self.step} failed ({error})")
        row["loss"], row["val_loss"] = np.asarray(val_loss), np.asarray(val_loss)
        self.rows.append(row)
        if not isinstance(self.model, GPT):
            self.params.append(self.model.flowsim_params())

    def save(self, status: Status) -> None:
        """checkpoint.pt (everything a resume needs), then meta.json with ``status``."""
        _save_torch_atomic(self.run_dir / CHECKPOINT_FILE, {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "step": self.step, "rows": self.rows, "log": self.log,
            "params": self.params})
        write_meta(self.run_dir, {**self.meta, "status_name": status.label, "steps_done": self.step,
                                  "steps": self.config.optim.steps})

    def diverged(self, message: str) -> None:
        """Stop; checkpoint.pt keeps the last saved (finite) state."""
        write_meta(self.run_dir, {**self.meta, "status_name": Status.NON_FINITE.label, "steps_done": self.step,
                                  "message": message})
        raise FloatingPointError(f"{message}; lower optim.lr")


def write_outputs(run_dir: Path, config: BridgeConfig, data: DataSource, pi: np.ndarray, log: list[dict],
                  rows: list[dict], params: list[dict]) -> None:
    """log.csv, observables.npz, trajectory.npz (paper models), stages and summary.png (one-layer)."""
    from flowsim.runs.plots import plot_run_summary
    from flowsim.observe.stages import detect_stages

    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(log[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(log)
    write_atomic_bytes(run_dir / LOG_FILE, text.getvalue().encode())
    t = np.array([entry["t"] for entry in log])
    observables = stack_observables(t, rows, pi, config.model.kind)
    observables.constants["type_names"] = np.array(type_names(data))
    observables.constants[MEASURED_BY] = np.array("torch")  # measurements, not a cache of trajectory.npz
    observables.save(run_dir)
    if params:
        loss = np.array([entry["val_loss"] for entry in log])
        Trajectory(t, loss, {name: np.stack([p[name] for p in params]) for name in params[0]}).save(run_dir / TRAJECTORY_FILE)
    if config.model.kind == "one_layer" and np.count_nonzero(t > 0) >= 3:
        stages = detect_stages(observables)
        stages.save(run_dir)
        plot_run_summary(observables, run_dir / SUMMARY_FIGURE, title=run_title(config, data.vocab_size), stages=stages,
                         loss_label="validation loss", time_label="t = learning rate × steps")


def run_title(config: BridgeConfig, d: int | None = None) -> str:
    """What a bridge run's figures are of: its data (the corpus or the file), d (given, or a text's vocabulary plus
    <unk>), the optimiser, lr, steps, batch and s."""
    kind = config.data.kind
    source = (f"text {Path(config.data.train_file).name}" if kind == "text" else kind if kind != "markov"
              else "Markov chain")
    optim = config.optim
    d = d if d is not None or kind == "markov" else config.data.vocab_size + 1
    size = "" if d is None else f", d = {d}"
    return (f"bridge: {source}{size}, {optim.name} lr = {optim.lr:g}, {optim.steps} steps of "
            f"batch {config.data.batch_size} × s = {config.data.s}")


def type_names(data: DataSource) -> list[str]:
    """Names of the folded token types: the tracked tokens, then "other" when folded."""
    fold, names = data.fold(), data.token_names
    members = np.bincount(fold)
    by_type = ["other"] * len(members)
    for token in np.flatnonzero(members[fold] == 1):  # a type with one token is that token
        by_type[fold[token]] = names[token]
    return by_type
