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
import math
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from flowsim.bridge.config import BridgeConfig
from flowsim.bridge.data import Corpus, folded_types, load_corpus, markov_batch
from flowsim.bridge.models import GPT, GPTConfig, torch_model_for
from flowsim.bridge.observables import (
    ProbeSet,
    build_probe_set,
    checkpoint_observables,
    stack_observables,
)
from flowsim.bridge.optim import QKSchedule, WindowSmoothing, build_optimizer
from flowsim.budget import check_memory
from flowsim.chains import MarkovChain
from flowsim.config import ConfigError
from flowsim.interrupts import StopRequest, run_in_chunks, stop_requests
from flowsim.io import DamagedFileError, write_atomic_bytes
from flowsim.models import model_from_config
from flowsim.observables import MEASURED_BY
from flowsim.rundir import (
    CONFIG_FILE,
    SUMMARY_FIGURE,
    TRAJECTORY_FILE,
    folder_lock,
    library_versions,
    this_process,
    write_config,
    write_meta,
)
from flowsim.status import Status
from flowsim.trajectory import Trajectory

CHECKPOINT_FILE, LOG_FILE = "checkpoint.pt", "log.csv"
CHECKPOINT_EVERY_S = 30.0
PROBE_POOL = 20_000
VALIDATION_SEED_OFFSET = 1_000_003  # validation batches use seeds no training step uses


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
        if self.chain is not None:
            return np.arange(self.chain.d)
        vocabulary = list(self.corpus.vocabulary)
        missing = [word for word in self.config.log.track if word not in vocabulary]
        if missing:
            raise ConfigError(f"log.track names words outside the vocabulary: {missing}")
        return folded_types(self.frequencies, self.config.log.fold_d, tuple(vocabulary.index(w) for w in self.config.log.track))

    def batch(self, step: int, split: str = "train") -> torch.Tensor:
        data = self.config.data
        seed = data.seed if split == "train" else data.seed + VALIDATION_SEED_OFFSET
        if self.chain is not None:
            return markov_batch(self.chain, data.batch_size, data.s + 1, seed, step)
        return self.corpus.batch(data.batch_size, data.s + 1, seed, step, split)

    def probe_set(self) -> ProbeSet:
        data = self.config.data
        if self.chain is not None:
            pool = markov_batch(self.chain, PROBE_POOL, data.s, data.seed + 2 * VALIDATION_SEED_OFFSET, 0)
        else:
            pool = self.corpus.windows_ending_in(self.fold(), self.config.log.probe_per_type, data.s, data.seed, "valid")
        return build_probe_set(pool, self.fold(), self.frequencies, self.config.log.probe_per_type)


def build_data(config: BridgeConfig) -> DataSource:
    if config.data.kind == "markov":
        return DataSource(config, MarkovChain.from_config(config.chain), None)
    try:
        corpus = load_corpus(config.data.kind, config.data.vocab_size, config.data.data_dir, config.data.source)
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None
    return DataSource(config, None, corpus)


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
    """Refuse a run whose training step would not fit the memory budget (``flowsim.budget``)."""
    check_memory(training_memory_bytes(config, vocab_size),
                 f"a training step of model.kind = {config.model.kind!r} with data.s = {config.data.s}, "
                 f"data.batch_size = {config.data.batch_size} and {vocab_size} tokens",
                 "lower data.s, data.batch_size or data.vocab_size")


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


def train(config: BridgeConfig, run_dir: Path, *, progress: bool = True, stop_at_step: int | None = None) -> TrainResult:
    """Train (or resume) the configured run in ``run_dir``; ``stop_at_step`` stops early
    with everything saved, as an interrupted run would be (resume by calling again)."""
    device = select_device(config.data.device)  # settings are checked before anything is written
    if config.data.kind != "markov":
        check_training_size(config, config.data.vocab_size + 1)  # before the corpus is read
    data = build_data(config)
    check_training_size(config, data.vocab_size)
    run_dir = Path(run_dir)
    toml_text = config.to_toml()
    if (run_dir / CONFIG_FILE).is_file() and (run_dir / CONFIG_FILE).read_text() != toml_text:
        raise ConfigError(f"{run_dir} holds a run with a different configuration; resume with the same config or choose a new folder")
    with folder_lock(run_dir), stop_requests() as stop:
        return _train_locked(config, run_dir, data, device, toml_text, progress, stop_at_step, stop)


def _train_locked(config: BridgeConfig, run_dir: Path, data: DataSource, device, toml_text: str, progress: bool,
                  stop_at_step: int | None, stop: StopRequest) -> TrainResult:
    """``train`` once it holds the run directory's lock; SIGINT or SIGTERM (``stop``) ends it after the current
    step with everything saved and status "interrupted"."""
    write_config(run_dir, toml_text)
    model = build_model(config, data.vocab_size).to(device)
    slow = model.slow_groups if config.optim.qk_rho != 1.0 else ()
    schedule = QKSchedule(config.optim.qk_rho, config.optim.qk_hold, config.optim.qk_ramp, config.optim.steps) if slow else None
    try:
        optimizer, scheduler = build_optimizer(model, config.optim.name, config.optim.lr, config.optim.weight_decay,
                                               slow, schedule, config.optim.momentum)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    stepper = optimizer
    if config.optim.smoothing_a > 0:
        named = dict(model.named_parameters())
        stacks = [[named[name] for name in stack] for stack in model.repeated_blocks]
        stepper = WindowSmoothing(optimizer, stacks, config.optim.smoothing_a, config.optim.smoothing_variant)

    checkpoints = config.checkpoint_steps()
    probe = data.probe_set()
    rows: list[dict] = []
    log: list[dict] = []
    params: list[dict] = []
    step = 0
    if (run_dir / CHECKPOINT_FILE).is_file():
        try:
            state = torch.load(run_dir / CHECKPOINT_FILE, map_location=device, weights_only=False)
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as error:
            raise DamagedFileError(run_dir / CHECKPOINT_FILE, f"{type(error).__name__}: {error}",
                                   "delete it to train this run from the start") from None
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, rows, log, params = state["step"], state["rows"], state["log"], state["params"]
    validation = [data.batch(i, "valid").to(device) for i in range(config.log.val_batches)]
    paper_model = not isinstance(model, GPT)
    autocast = device.type == "cuda" and isinstance(model, GPT)
    meta = {"status_name": Status.RUNNING.label, "started": _dt.datetime.now().isoformat(timespec="seconds"), "seed": config.data.seed,
            "device": str(device), "versions": {**library_versions(), "torch": torch.__version__}, **this_process()}

    def evaluate() -> float:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return float(np.mean([batch_loss(model, tokens).item() for tokens in validation]))

    def save(status: Status) -> None:
        _save_torch_atomic(run_dir / CHECKPOINT_FILE, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                                        "scheduler": scheduler.state_dict(), "step": step, "rows": rows,
                                                        "log": log, "params": params})
        write_meta(run_dir, {**meta, "status_name": status.label, "steps_done": step, "steps": config.optim.steps})

    def diverged(message: str) -> None:
        """Stop; checkpoint.pt keeps the last saved (finite) state."""
        write_meta(run_dir, {**meta, "status_name": Status.NON_FINITE.label, "steps_done": step, "message": message})
        raise FloatingPointError(f"{message}; lower optim.lr")

    def record(train_loss: float) -> None:
        val_loss = evaluate()
        log.append({"step": step, "t": config.optim.lr * step, "train_loss": train_loss, "val_loss": val_loss,
                    "val_perplexity": math.exp(min(val_loss, 700.0))})
        try:
            row = checkpoint_observables(model, probe, data.frequencies)
        except torch.linalg.LinAlgError as error:  # parameters so large their SVD overflows
            diverged(f"the observables at step {step} failed ({error})")
        row["loss"], row["val_loss"] = np.asarray(val_loss), np.asarray(val_loss)
        rows.append(row)
        if paper_model:
            params.append(model.flowsim_params())

    started = time.perf_counter()
    if step == 0 and not log:
        record(evaluate())
        save(Status.RUNNING)
    bar = tqdm(total=config.optim.steps, initial=step, disable=not progress, unit="step",
               desc=f"{config.optim.name} on {config.data.kind}, lr = {config.optim.lr:g}")
    end = config.optim.steps if stop_at_step is None else min(stop_at_step, config.optim.steps)

    def advance() -> bool:
        """One SGD step (a chunk of the shared loop), logged and saved at the checkpoint steps."""
        nonlocal step
        tokens = data.batch(step).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = batch_loss(model, tokens)
        if not math.isfinite(loss.item()):
            diverged(f"the training loss became {loss.item()} at step {step}")
        stepper.zero_grad()
        loss.backward()
        stepper.step()
        scheduler.step()
        step += 1
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            diverged(f"the parameters became non-finite at step {step}")
        bar.update(1)
        if step in checkpoints:
            record(loss.item())
            bar.set_postfix_str(f"t = lr × step = {log[-1]['t']:.4g}, validation loss {log[-1]['val_loss']:.4f}")
            save(Status.RUNNING)
        return step < end

    if step < end and not stop():
        run_in_chunks(advance, stop, lambda: save(Status.RUNNING), CHECKPOINT_EVERY_S)
    bar.close()
    finished = step >= config.optim.steps
    meta["wall_time_s"] = time.perf_counter() - started
    if stop():
        save(Status.INTERRUPTED)
        return TrainResult(run_dir, step, False, log, interrupted=True)
    save(Status.RUNNING)  # the last checkpoint; meta.json says how the run ended only once every output is written
    write_outputs(run_dir, config, data, probe.pi, log, rows, params)
    ended = Status.FINISHED if finished else Status.STEP_LIMIT  # stopped before its steps: resumable
    write_meta(run_dir, {**meta, "status_name": ended.label, "steps_done": step, "steps": config.optim.steps})
    return TrainResult(run_dir, step, finished, log)


def write_outputs(run_dir: Path, config: BridgeConfig, data: DataSource, pi: np.ndarray, log: list[dict],
                  rows: list[dict], params: list[dict]) -> None:
    """log.csv, observables.npz, trajectory.npz (paper models), stages and summary.png (one-layer)."""
    from flowsim.plots import plot_run_summary
    from flowsim.stages import detect_stages

    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(log[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(log)
    write_atomic_bytes(run_dir / LOG_FILE, text.getvalue().encode())
    t = np.array([entry["t"] for entry in log])
    observables = stack_observables(t, rows, pi)
    observables.constants["type_names"] = np.array(type_names(data))
    observables.constants[MEASURED_BY] = np.array("torch")  # measurements, not a cache of trajectory.npz
    observables.save(run_dir)
    if params:
        loss = np.array([entry["val_loss"] for entry in log])
        Trajectory(t, loss, {name: np.stack([p[name] for p in params]) for name in params[0]}).save(run_dir / TRAJECTORY_FILE)
    if config.model.kind == "one_layer" and np.count_nonzero(t > 0) >= 3:
        stages = detect_stages(observables)
        stages.save(run_dir)
        plot_run_summary(observables, run_dir / SUMMARY_FIGURE, title=f"bridge: {config.data.kind}", stages=stages,
                         loss_label="validation loss", time_label="t = learning rate × steps")


def type_names(data: DataSource) -> list[str]:
    """Names of the folded token types: the tracked tokens, then "other" when folded."""
    fold, names = data.fold(), data.token_names
    members = np.bincount(fold)
    by_type = ["other"] * len(members)
    for token in np.flatnonzero(members[fold] == 1):  # a type with one token is that token
        by_type[fold[token]] = names[token]
    return by_type
