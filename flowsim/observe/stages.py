"""Stage detectors: label the intervals of a trajectory from its observables.

Each detector reads named observables (see ``flowsim.observe.observables``) and works on exact
flows and on noisy, irregularly sampled training logs alike: every series is first
smoothed by a running median over a window in log-time, and every decision uses
hysteresis (a threshold to enter a state and a different one to leave it).

Every event is causal with a bounded lookahead: its time depends on the trajectory up to
``StageThresholds.lookahead_decades`` (0.15 decades of log t) past it, so extending a run never
moves or removes an event already dated. The detectors read only the saves whose running median a
longer run would not change (``settled_count``), and date an event only once its hold is read.

Stages and their rules (thresholds are fields of ``StageThresholds``):

* condensation: σ0(W0) leaves its floor (its value at the first sample) by
  ``departure``× (start) and reaches ``condensation_level`` × its condensed scale (end):
  σ0 where its growth first flattens (log-log slope over ``flat_window_decades`` below
  ``flat_slope``, or stops falling below ``flat_slope_bound``), so that later stages do not move the end.
  Dated once it has flattened (open before: its end reads 0.15-0.25 decade past the flattening, which comes
  0.4 decade after the end on the default flow).
* focus (per query i with π_i > 0): the smoothed attention entropy H_i falls ``focus_drop`` nats
  below its running maximum and stays there for ``min_duration_decades``. Start: where it crosses
  that level; end: the start of the dilution after it, or None. It records its depth by the end of
  the hold and the first time H_i is ``focus_depth_fraction`` × its initial value below the maximum.
* dilution (per query): after a focus, H_i rises ``dilution_rise`` nats above its running
  minimum and stays there for ``min_duration_decades``. Start: where it crosses that level;
  end: the maximum before the next focus (None until that focus is dated).
* restart (per direction r >= 1, 0-based): σ_r(W0) grows ``restart_factor``× above its
  floor (its value at the first sample). Start: that time (the evidence also gives the
  last time before it with σ_r <= departure × floor); end: the first time σ_r reaches
  ``restart_open_fraction`` × σ_0 (None if it does not).
* plateau: after condensation, a stretch of at least ``plateau_min_decades`` decades of
  log-time over which the loss changes by less than ``plateau_loss_tol`` and log σ0 of
  W0, W1, W_Q, W_K by less than ``plateau_log_sv_tol`` within every window of
  ``plateau_window_decades`` (a property, not an event: an open plateau's end is where the log ends).

On a noisy log the focus and dilution thresholds are at least ``noise_factor`` × the entropy's noise
read from the log up to the event's hold (``series_noise``). A cycle is focus -> dilution -> restart,
counted greedily in time order. Singular values are indexed from 0 (σ0 the largest).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal, NamedTuple

import numpy as np

from flowsim.common.io import write_atomic_bytes, write_atomic_json
from flowsim.observe.observables import Observables

STAGES_JSON, STAGES_TEXT = "stages.json", "stages.txt"


@dataclass(frozen=True)
class Stage:
    """One kind of stage: the time that dates it in every table and comparison, how plots draw it, and its part in
    the cycle focus -> dilution -> restart."""

    name: str
    dated_by: Literal["onset", "end"]
    event: bool  # compared between runs, the theory and training logs (a plateau is a property, not an event)
    cycle_step: bool  # focus -> dilution -> restart, in that order
    colour: str | None  # its shading where plots do not draw it in its query's or direction's colour
    hatch: str  # its hatching in the paper figures
    # a registered stage's detector (``register_stage``); the shipped stages are detected in ``detect_stages``
    detect: Callable[["Detection"], list["Interval"]] | None = None

    @property
    def column(self) -> str:
        """Its column in tables: ``end_condensation``, ``onset_focus``, ..."""
        return f"{self.dated_by}_{self.name}"


STAGES = [
    # condensation starts at once, from the first sample: its end is the time that moves
    Stage("condensation", "end", event=True, cycle_step=False, colour="tab:grey", hatch=""),
    Stage("focus", "onset", event=True, cycle_step=True, colour=None, hatch=""),
    Stage("dilution", "onset", event=True, cycle_step=True, colour=None, hatch="////"),
    Stage("restart", "onset", event=True, cycle_step=True, colour=None, hatch="\\\\\\\\"),
    Stage("plateau", "onset", event=False, cycle_step=False, colour="tab:olive", hatch=".."),
]
# Views of the table, kept in step by ``register_stage`` (read them at call time, not at import).
STAGE = {stage.name: stage for stage in STAGES}
EVENT_STAGES = [stage for stage in STAGES if stage.event]
CYCLE = tuple(stage.name for stage in STAGES if stage.cycle_step)


class Detection(NamedTuple):
    """What a registered stage's detector reads: the settled saved times t > 0 (``settled_count``), each observable
    smoothed in log-time on them (``smoothed(name)``), the observables themselves (every save), the thresholds, and
    the intervals found before it. A detector that reads only ``t`` and ``smoothed`` up to a bounded lookahead past
    its events keeps them fixed as the run goes on."""

    t: np.ndarray
    smoothed: Callable[[str], np.ndarray]
    observables: Observables
    thresholds: "StageThresholds"
    intervals: list["Interval"]


def register_stage(stage: Stage) -> None:
    """Add a stage with its detector (``stage.detect``): ``detect_stages`` runs it after the shipped ones, and
    stages.json, the tables, the comparisons and the plots show it like theirs (docs/extending.md). It cannot
    join the focus -> dilution -> restart cycle."""
    if stage.name in STAGE:
        raise ValueError(f"a stage named {stage.name!r} exists already")
    if stage.detect is None or stage.cycle_step:
        raise ValueError(f"stage {stage.name!r}: a registered stage needs a detector (detect) and is no cycle step")
    STAGES.append(stage)
    STAGE[stage.name] = stage
    if stage.event:
        EVENT_STAGES.append(stage)


@dataclass(frozen=True)
class StageThresholds:
    """The detectors' parameters; the defaults hold across the configurations in the tests."""

    smoothing_decades: float = 0.05  # half-width of the running median in log10 t
    departure: float = 2.0  # a singular value has left its floor at departure × floor
    condensation_level: float = 1 / 3  # condensation ends at this fraction of the condensed σ0(W0)
    flat_slope: float = 0.1  # σ0(W0) has condensed where d log σ0 / d log t falls below this
    flat_window_decades: float = 0.1  # ... over this window of log10 t
    flat_slope_bound: float = 0.2  # ... or where that slope stops falling while below this (2 × flat_slope)
    focus_drop: float = 0.35  # nats below the running maximum of a query's entropy
    focus_depth_fraction: float = 0.5  # a focus's second depth: this fraction of its query's initial entropy
    dilution_rise: float = 0.2  # nats above the running minimum after a focus
    min_duration_decades: float = 0.1  # a focus or dilution must hold this long (log10 t) to count
    # ... and fall or rise by at least this many times the series' own noise (SGD logs: ``series_noise``), so that
    # noise alone after a focus is not labelled a dilution (benchmarks/MEASUREMENTS.md, "Dilution on noisy logs")
    noise_factor: float = 3.0
    noise_window_decades: float = 0.25  # half-width (log10 t) over which that noise is measured
    restart_factor: float = 10.0  # σ_r(W0) above restart_factor × floor: a new direction
    restart_open_fraction: float = 0.5  # the restart ends when σ_r >= this × σ_0
    plateau_window_decades: float = 0.3
    plateau_loss_tol: float = 1e-3
    plateau_log_sv_tol: float = 0.02
    plateau_min_decades: float = 0.5

    @property
    def lookahead_decades(self) -> float:
        """How far past an event (decades of log t) the detectors read to date it: the running median's half-width
        and a focus's or dilution's hold (a restart reads the half-width only; condensation's end reads 0.15 decade
        past the flattening that fixes its scale, 0.25 where that is a minimum of the slope). An event is dated only
        once the series reaches that far."""
        return self.smoothing_decades + max(self.min_duration_decades, self.flat_window_decades)


def subject_label(query: int | None, direction: int | None) -> str:
    """How tables name what a stage is about: q<i> for a query, σ<r> for a direction, - otherwise."""
    if query is not None:
        return f"q{query}"
    return f"σ{direction}" if direction is not None else "-"


@dataclass(frozen=True)
class Interval:
    stage: str
    query: int | None
    direction: int | None
    t_start: float
    t_end: float | None
    evidence: str
    depth: float | None = None  # a focus: how far (nats) its entropy fell below its running maximum by its hold's end
    # a focus: (depth in nats, the first time its entropy was that far below the maximum, or None) for its onset's
    # drop and for ``focus_depth_fraction`` × the query's initial entropy, so a slow fall in two steps shows as such
    depth_times: tuple[tuple[float, float | None], ...] = ()

    @property
    def time(self) -> float | None:
        """The time that dates it (``Stage.dated_by``): condensation's end, every other stage's onset."""
        return self.t_end if STAGE[self.stage].dated_by == "end" else self.t_start


@dataclass(frozen=True)
class StageReport:
    intervals: list[Interval]
    cycles: int
    thresholds: StageThresholds = field(default_factory=StageThresholds)

    def of(self, stage: str, query: int | None = None) -> list[Interval]:
        return [i for i in self.intervals if i.stage == stage and (query is None or i.query == query)]

    def onset(self, stage: str) -> float | None:
        """The first start of ``stage`` over every query and direction (None: not detected)."""
        starts = [interval.t_start for interval in self.of(stage)]
        return float(min(starts)) if starts else None

    def end_of_condensation(self) -> float | None:
        """When condensation ended (it starts at once; its end is the time that moves)."""
        return self.first_time("condensation")

    def first_time(self, stage: str, query: int | None = None, direction: int | None = None) -> float | None:
        """The time that dates the first ``stage`` (of ``query`` / ``direction`` where given; None: not detected, or
        a condensation that has not ended)."""
        found = [i for i in self.of(stage, query) if direction is None or i.direction == direction]
        return None if not found or found[0].time is None else float(found[0].time)

    def dated(self) -> dict[str, float | None]:
        """Each event stage's first time, by its column (``Stage.column``): what a table of runs shows."""
        return {stage.column: self.first_time(stage.name) for stage in EVENT_STAGES}

    def events(self) -> dict[tuple, float]:
        """(stage, query, direction, occurrence) -> the time that dates it, for every event stage (what two reports,
        of a run and of the theory or of a training log, are compared by)."""
        seen: dict[tuple, int] = {}
        events = {}
        for interval in self.intervals:
            if not STAGE[interval.stage].event:
                continue
            base = (interval.stage, interval.query, interval.direction)
            seen[base] = seen.get(base, 0) + 1
            if interval.time is not None:
                events[(*base, seen[base])] = float(interval.time)
        return events

    def to_json(self) -> dict:
        return {"intervals": [asdict(interval) for interval in self.intervals], "cycles": self.cycles}

    def table(self) -> str:
        """A plain-text table: stage, query/direction, start, end, evidence."""
        lines = [f"{'stage':13} {'q/dir':6} {'t_start':>10} {'t_end':>10}  evidence"]
        for interval in self.intervals:
            who = subject_label(interval.query, interval.direction)
            end = f"{interval.t_end:10.4g}" if interval.t_end is not None else f"{'open':>10}"
            lines.append(f"{interval.stage:13} {who:6} {interval.t_start:10.4g} {end}  {interval.evidence}")
        lines.append(f"cycles (focus -> dilution -> restart): {self.cycles}")
        return "\n".join(lines)

    def save(self, run_dir: Path) -> None:
        run_dir = Path(run_dir)
        write_atomic_json(run_dir / STAGES_JSON, self.to_json())
        write_atomic_bytes(run_dir / STAGES_TEXT, (self.table() + "\n").encode())


SMOOTHING_WINDOW_ENTRIES = 1 << 22  # numbers in one block of sorted windows (32 MB): the columns go in blocks


def log_cell_widths(t: np.ndarray) -> np.ndarray:
    """Each sample's share of log10 t: half the distance to each neighbour (half-cells at the ends)."""
    log_t = np.log10(t)
    edges = np.concatenate([log_t[:1], 0.5 * (log_t[1:] + log_t[:-1]), log_t[-1:]])
    return np.diff(edges)


def smooth_in_log_time(t: np.ndarray, values: np.ndarray, half_width_decades: float) -> np.ndarray:
    """Running median over samples with |log10 t' - log10 t| <= half_width (t > 0 only), each sample weighted by its
    share of log t (``log_cell_widths``): the median of the series over the window's stretch of log time, whatever
    the save grid. A plain median of samples would lean towards where the grid is densest (a flowsim run's linear
    saves crowd the late end of every window), and moved stage times by 2% between two grids of one flow.

    The weighted median is the value at which the sorted window's cumulative weight reaches half its total, the mean
    of the two values beside it when it reaches exactly half (so equal weights give np.median); NaN where the window
    holds a NaN. Columns (the trailing axes) go in blocks of SMOOTHING_WINDOW_ENTRIES numbers: O(T w log w c) time
    for windows of w samples and c columns, memory bounded whatever T and c are."""
    values = np.asarray(values, dtype=float)
    log_t = np.log10(t)
    lower = np.searchsorted(log_t, log_t - half_width_decades, side="left")
    upper = np.searchsorted(log_t, log_t + half_width_decades, side="right")
    index = lower[:, None] + np.arange((upper - lower).max())[None, :]  # (T, widest window)
    inside = index < upper[:, None]
    index = np.minimum(index, len(values) - 1)
    weights = np.where(inside, log_cell_widths(t)[index], 0.0)
    weights = np.where(weights.sum(axis=1, keepdims=True) > 0, weights, inside.astype(float))[:, :, None]  # repeated t
    half = 0.5 * weights.sum(axis=1, keepdims=True)
    columns = values.reshape(len(values), -1)
    block = max(1, SMOOTHING_WINDOW_ENTRIES // max(index.size, 1))
    smoothed = np.empty_like(columns)
    for first in range(0, columns.shape[1], block):
        window = np.where(inside[:, :, None], columns[:, first:first + block][index], np.inf)  # (T, widest, block)
        has_nan = np.any(np.isnan(window), axis=1)
        order = np.argsort(window, axis=1, kind="stable")
        ranked = np.take_along_axis(window, order, axis=1)
        cumulative = np.cumsum(np.take_along_axis(np.broadcast_to(weights, window.shape), order, axis=1), axis=1)
        at = np.argmax(cumulative >= half * (1 - 1e-9), axis=1)[:, None, :]  # the first sorted entry reaching half
        value = np.take_along_axis(ranked, at, axis=1)[:, 0]
        reached = np.take_along_axis(cumulative, at, axis=1)
        past = cumulative > reached + 1e-9 * half  # the next entry that carries weight (not a zero-weight one)
        beside = np.take_along_axis(ranked, np.where(past.any(axis=1), np.argmax(past, axis=1), at[:, 0])[:, None, :], axis=1)[:, 0]
        exactly_half = np.abs(reached[:, 0] - half[:, 0]) <= 1e-9 * half[:, 0]
        value = np.where(exactly_half & np.isfinite(beside), 0.5 * (value + beside), value)
        smoothed[:, first:first + block] = np.where(has_nan, np.nan, value)
    return smoothed.reshape(values.shape)


def settled_count(t: np.ndarray, th: StageThresholds) -> int:
    """How many leading samples any longer run smooths the same: those whose running-median window ends before the
    last sample (t · 10^smoothing_decades < t[-1]; the last sample's share of log t changes when the run goes on).
    The detectors read these only, so extending a run never changes what they read."""
    return int(np.searchsorted(np.log10(t), np.log10(t[-1]) - th.smoothing_decades, side="left"))


def _first_crossing(series: np.ndarray, level: float, start: int = 0) -> int | None:
    """Index of the first sample from ``start`` on with series >= level."""
    hits = np.flatnonzero(series[start:] >= level)
    return int(start + hits[0]) if len(hits) else None


def _crossing_time(t: np.ndarray, series: np.ndarray, n: int, level: float) -> float:
    """When ``series`` crosses ``level`` between samples n-1 and n, linear in log t."""
    if n == 0 or series[n] == series[n - 1]:
        return float(t[n])
    fraction = np.clip((level - series[n - 1]) / (series[n] - series[n - 1]), 0.0, 1.0)
    return float(10 ** (np.log10(t[n - 1]) + fraction * (np.log10(t[n]) - np.log10(t[n - 1]))))


def condensed_scale(t: np.ndarray, sigma: np.ndarray, after: int, th: StageThresholds) -> float | None:
    """σ at the first sample from ``after`` on where its log-log slope over the next ``flat_window_decades`` falls
    below ``flat_slope``, or stops falling while below ``flat_slope_bound`` (a minimum of the slope, held over the
    next ``flat_window_decades``: at ε = 1e-2 a focus can lift σ0 again before its slope reaches 0.1); None where
    neither is read by the end of ``t`` (a longer run may still find it). Reads 0.2 decade past that sample."""
    log_t, log_sigma = np.log10(t), np.log10(sigma)
    ahead = np.searchsorted(log_t, log_t + th.flat_window_decades, side="left")
    readable = ahead < len(t)
    slope = np.full(len(t), np.inf)
    slope[readable] = (log_sigma[ahead[readable]] - log_sigma[readable]) / (log_t[ahead[readable]] - log_t[readable])
    for n in range(after, len(t)):
        if not readable[n]:
            return None
        if slope[n] < th.flat_slope:
            return float(sigma[n])
        if slope[n] < th.flat_slope_bound:
            held = ahead[n]  # the slope must rise over the next window, every slope there read
            if held >= len(t) or not readable[held]:
                return None
            if np.all(slope[n + 1 : held + 1] > slope[n]):
                return float(sigma[n])
    return None


def detect_condensation(t: np.ndarray, sigma1: np.ndarray, th: StageThresholds) -> Interval | None:
    """Condensation of σ0(W0): None where σ0 has not left its floor (or flattens below 10 × departure × floor), open
    (no end) where it has not flattened yet; its end is dated once it has."""
    floor = sigma1[0]
    start = _first_crossing(sigma1, th.departure * floor)
    if start is None:
        return None
    t_start = _crossing_time(t, sigma1, start, th.departure * floor)
    left = f"σ0(W0) left its floor {floor:.3g} (×{th.departure:g} at t={t_start:.4g})"
    scale = condensed_scale(t, sigma1, start, th)
    if scale is None:
        return Interval("condensation", None, None, t_start, None,
                        f"{left}; not flattened by t={t[-1]:.4g}, so its end is not dated yet")
    if scale < 10 * th.departure * floor:
        return None
    level = th.condensation_level * scale
    end = _first_crossing(sigma1, level, start)  # at or before the flattening, where σ0 = scale > level
    t_end = _crossing_time(t, sigma1, end, level)
    return Interval("condensation", None, None, t_start, t_end,
                    f"{left} and reached {th.condensation_level:.3g}× its condensed scale {scale:.3g} = {level:.3g} "
                    f"at t={t_end:.4g}")


def series_noise(t: np.ndarray, raw: np.ndarray, smoothed: np.ndarray, th: StageThresholds) -> np.ndarray:
    """Each column's noise SD about its running median as known at each time (shape of ``raw``): the largest, over
    windows of ±``noise_window_decades`` that end by t · 10^min_duration_decades (where a focus's or dilution's hold
    from t ends), of 1.4826 × the window's median absolute residual; 0 before the first such window.

    Robust, so a flow's fast transition does not raise it (near 0 for a smooth series), and the largest of local
    readings, since an SGD log is still before condensation and noisy after it (a median over the whole log would
    halve its noise). It reads the log up to the event's hold only: a later noisy stretch raises no earlier
    threshold. O(T w log w c), as ``smooth_in_log_time``."""
    residual = np.abs(np.asarray(raw, dtype=float) - smoothed)
    local = np.nan_to_num(1.4826 * smooth_in_log_time(t, residual, th.noise_window_decades), nan=0.0)
    running = np.maximum.accumulate(local, axis=0)
    log_t = np.log10(t)
    windows = np.searchsorted(log_t, log_t + th.min_duration_decades - th.noise_window_decades, side="right")
    read = running[np.maximum(windows - 1, 0)]
    return np.where((windows > 0).reshape((-1,) + (1,) * (local.ndim - 1)), read, 0.0)


def _hold_end(t: np.ndarray, series: np.ndarray, n: int, level: float, above: bool, th: StageThresholds) -> int | None:
    """The last index of the hold from sample n (``min_duration_decades`` of log t) where series stays beyond
    ``level`` over it; None where it does not, or where ``t`` ends before the hold does."""
    until = t[n] * 10**th.min_duration_decades
    if t[-1] < until:
        return None
    last = int(np.searchsorted(t, until, side="right")) - 1
    window = series[n : last + 1]
    return last if bool(np.all(window >= level) if above else np.all(window <= level)) else None


class Turn(NamedTuple):
    """A focus (the entropy fell ``level`` = its running maximum minus the drop) or a dilution (it rose to its
    running minimum plus the rise), decided at sample ``n`` whose hold ends at sample ``hold_end``; ``extreme`` is
    the running maximum's (a focus) or minimum's (a dilution) sample."""

    kind: Literal["focus", "dilution"]
    n: int
    level: float
    extreme: int
    hold_end: int


def _turns(t: np.ndarray, h: np.ndarray, drop: np.ndarray, rise: np.ndarray, th: StageThresholds) -> list[Turn]:
    """Alternating focus, dilution, focus, ... of h, with hysteresis: each is the first sample, after the previous
    one, at or beyond its level and holding there. Each depends on h up to its hold only."""
    turns, extreme, focused = [], 0, False
    for n in range(1, len(t)):
        if (h[n] > h[extreme]) if not focused else (h[n] < h[extreme]):
            extreme = n
            continue
        level = h[extreme] + rise[n] if focused else h[extreme] - drop[n]
        if (h[n] >= level) if focused else (h[n] <= level):
            hold_end = _hold_end(t, h, n, level, focused, th)
            if hold_end is not None:
                turns.append(Turn("dilution" if focused else "focus", n, level, extreme, hold_end))
                extreme, focused = n, not focused
    return turns


def _first_held_fall(t: np.ndarray, h: np.ndarray, start: int, stop: int, level: float, th: StageThresholds) -> float | None:
    """The first time, in samples start..stop-1, that h is at or below ``level`` and holds there; None if none."""
    for n in range(max(start, 1), stop):
        if h[n] <= level and _hold_end(t, h, n, level, False, th) is not None:
            return _crossing_time(t, h, n, level)
    return None


def detect_focus_and_dilution(t: np.ndarray, entropy: np.ndarray, query: int, th: StageThresholds,
                              noise: np.ndarray | float = 0.0) -> list[Interval]:
    """Focus = one query's smoothed entropy ``focus_drop`` nats below its running maximum, dilution = after a focus,
    ``dilution_rise`` above its running minimum; each holding for ``min_duration_decades`` and dated where the
    entropy crosses that level, so it depends on the series up to its hold only (a longer series never moves it).
    ``noise`` (``series_noise`` of the raw entropy, per sample or one number) raises both thresholds to
    ``noise_factor`` × noise where that is larger, so a noisy log's wander is not labelled.

    A focus records how deep it went by the end of its hold (``depth``) and when it first reached each depth
    (``depth_times``): its drop (the onset) and ``focus_depth_fraction`` × the query's initial entropy below the
    same maximum (None: not before its dilution or the series' end). A focus ends where its dilution starts; a
    dilution ends at the peak before the next focus, once that focus is dated (None before). O(T w) for T samples and
    holds of w samples."""
    h = np.asarray(entropy, dtype=float)
    noise = np.broadcast_to(np.asarray(noise, dtype=float), h.shape)
    drop = np.maximum(th.focus_drop, th.noise_factor * noise)
    rise = np.maximum(th.dilution_rise, th.noise_factor * noise)
    turns = _turns(t, h, drop, rise, th)
    second_depth = th.focus_depth_fraction * float(h[0])
    intervals = []
    for k, turn in enumerate(turns):
        onset = _crossing_time(t, h, turn.n, turn.level)
        after = turns[k + 1] if k + 1 < len(turns) else None
        noted = (f" (thresholds at least {th.noise_factor:g} × the log's noise SD {noise[turn.n]:.3g})"
                 if th.noise_factor * noise[turn.n] > min(th.focus_drop, th.dilution_rise) else "")
        peak, trough = (turn.extreme, None) if turn.kind == "focus" else (None, turn.extreme)
        if turn.kind == "focus":
            depth = float(h[peak] - h[turn.n : turn.hold_end + 1].min())
            stop = after.n if after is not None else len(t)
            second = _first_held_fall(t, h, peak + 1, stop, h[peak] - second_depth, th)
            reached = (f"at t={second:.4g}" if second is not None else
                       "not before its dilution" if after is not None else f"not by t={t[-1]:.4g}")
            intervals.append(Interval(
                "focus", query, None, onset, None if after is None else _crossing_time(t, h, after.n, after.level),
                f"entropy of query {query} fell {drop[turn.n]:.3g} below its running maximum {h[peak]:.3g} "
                f"(t={t[peak]:.4g}) at t={onset:.4g}, {depth:.3g} below it by t={t[turn.hold_end]:.4g}; "
                f"{second_depth:.3g} below it ({th.focus_depth_fraction:g} × its initial {h[0]:.3g}) {reached}" + noted,
                depth=depth, depth_times=((float(drop[turn.n]), onset), (second_depth, second)),
            ))
        else:
            closed = f"; peaked at {h[after.extreme]:.3g} (t={t[after.extreme]:.4g})" if after is not None else ""
            intervals.append(Interval(
                "dilution", query, None, onset, None if after is None else float(t[after.extreme]),
                f"entropy of query {query} rose {rise[turn.n]:.3g} above its running minimum {h[trough]:.3g} "
                f"(t={t[trough]:.4g}) at t={onset:.4g}" + closed + noted,
            ))
    return intervals


def _with_embedding_motion(dilution: Interval, t: np.ndarray, norms: np.ndarray, pi: np.ndarray) -> Interval:
    """Add to a dilution's evidence how the frequent and the rarest token's embeddings moved over it (up to the end
    of ``t`` for one still open)."""
    a, b = (int(np.searchsorted(t, time)) for time in (dilution.t_start, t[-1] if dilution.t_end is None else dilution.t_end))
    b = min(b, len(t) - 1)
    present = np.flatnonzero(pi > 0)
    frequent, rare = int(np.argmax(pi)), int(present[np.argmin(pi[present])])
    change = norms[b] - norms[a]
    motion = "opposite" if change[frequent] * change[rare] < 0 else "same"
    text = (f"; embedding norms over it: token {frequent} {change[frequent]:+.3g}, token {rare} "
            f"{change[rare]:+.3g} ({motion} directions)")
    return replace(dilution, evidence=dilution.evidence + text)


def detect_restarts(t: np.ndarray, sigma: np.ndarray, th: StageThresholds) -> list[Interval]:
    """One restart interval per direction r >= 1 whose σ_r(W0) passes restart_factor × floor."""
    intervals = []
    for r in range(1, sigma.shape[1]):
        floor = sigma[0, r]
        opened = _first_crossing(sigma[:, r], th.restart_factor * floor)
        if opened is None:
            continue
        below = np.flatnonzero(sigma[: opened + 1, r] <= th.departure * floor)
        t_left = _crossing_time(t, sigma[:, r], int(below[-1]) + 1, th.departure * floor) if len(below) else float(t[0])
        t_opened = _crossing_time(t, sigma[:, r], opened, th.restart_factor * floor)
        gap = sigma[:, r] - th.restart_open_fraction * sigma[:, 0]
        end = _first_crossing(gap, 0.0, opened)
        t_end = None if end is None else _crossing_time(t, gap, end, 0.0)
        intervals.append(Interval(
            "restart", None, r, t_opened, t_end,
            f"σ{r}(W0) passed {th.restart_factor:g}× its floor {floor:.3g} at t={t_opened:.4g} "
            f"(left {th.departure:g}× floor at t={t_left:.4g})"
            + ("" if t_end is None else f"; reached {th.restart_open_fraction:g}×σ0(W0) at t={t_end:.4g}"),
        ))
    return intervals


def detect_plateaus(t: np.ndarray, loss: np.ndarray, log_sigma: np.ndarray, after: float, th: StageThresholds) -> list[Interval]:
    """Windows of log-time over which loss and the log singular values barely move, merged."""
    log_t = np.log10(t)
    upper = np.searchsorted(log_t, log_t + th.plateau_window_decades, side="right")
    still = np.zeros(len(t), dtype=bool)
    for n, u in enumerate(upper):
        if t[n] < after or u - n < 2 or log_t[n] + th.plateau_window_decades > log_t[-1]:  # whole windows only
            continue
        loss_change = np.ptp(loss[n:u])
        sv_change = np.max(np.ptp(log_sigma[n:u], axis=0))
        still[n:u] |= (loss_change < th.plateau_loss_tol) & (sv_change < th.plateau_log_sv_tol)
    intervals = []
    n = 0
    while n < len(t):
        if not still[n]:
            n += 1
            continue
        m = n
        while m + 1 < len(t) and still[m + 1]:
            m += 1
        if log_t[m] - log_t[n] >= th.plateau_min_decades:
            intervals.append(Interval(
                "plateau", None, None, float(t[n]), float(t[m]),
                f"over every {th.plateau_window_decades:g}-decade window the loss moved < {th.plateau_loss_tol:g} "
                f"and log σ0 of W0, W1, W_Q, W_K < {th.plateau_log_sv_tol:g} (loss {loss[n]:.5g} -> {loss[m]:.5g})",
            ))
        n = m + 1
    return intervals


def count_cycles(intervals: list[Interval]) -> int:
    """Cycles focus -> dilution -> restart (a direction opening; ``CYCLE``), taken greedily in time order."""
    events = sorted((i.t_start, i.stage) for i in intervals if i.stage in CYCLE)
    step, cycles = 0, 0
    for _, stage in events:
        if stage == CYCLE[step]:
            step = (step + 1) % len(CYCLE)
            cycles += step == 0
    return cycles


def detect_stages(observables: Observables, thresholds: StageThresholds | None = None) -> StageReport:
    """Label every stage of a trajectory from its observables (times t > 0 only). The detectors read the saves a
    longer run would smooth the same (``settled_count``), and each dates an event from them up to its lookahead
    (``StageThresholds.lookahead_decades``) past it: extending the trajectory never moves or removes an event."""
    th = StageThresholds() if thresholds is None else thresholds
    keep = observables.t > 0
    if np.count_nonzero(keep) < 3:
        raise ValueError(f"stage detection needs at least 3 saved times t > 0, got {np.count_nonzero(keep)}")
    settled = settled_count(observables.t[keep], th)
    t = observables.t[keep][:settled]

    def smoothed(name: str) -> np.ndarray:
        return smooth_in_log_time(observables.t[keep], observables[name][keep], th.smoothing_decades)[:settled]

    intervals: list[Interval] = []
    if len(t) < 3:  # a run too short to read: it has no events yet
        return StageReport(intervals=intervals, cycles=0, thresholds=th)
    sigma_W0 = smoothed("sv_W0")
    condensation = detect_condensation(t, sigma_W0[:, 0], th)
    if condensation is not None:
        intervals.append(condensation)
    pi = observables.constants["pi"]
    raw_entropy = observables["attention_entropy"][keep]
    whole_entropy = smooth_in_log_time(observables.t[keep], raw_entropy, th.smoothing_decades)
    # read on the whole log (the windows an event reads end inside the settled saves), then cut like the rest
    noise = series_noise(observables.t[keep], raw_entropy, whole_entropy, th)[:settled]
    entropy = whole_entropy[:settled]
    for query in np.flatnonzero(pi > 0):
        intervals.extend(detect_focus_and_dilution(t, entropy[:, query], int(query), th, noise[:, query]))
    if "embedding_norm" in observables.columns:
        norms = smoothed("embedding_norm")
        intervals = [_with_embedding_motion(i, t, norms, pi) if i.stage == "dilution" else i for i in intervals]
    intervals.extend(detect_restarts(t, sigma_W0, th))
    if condensation is not None and condensation.t_end is not None:
        log_sigma = np.log(np.column_stack([smoothed(f"sv_{name}")[:, 0] for name in ("W0", "W1", "W_Q", "W_K")]))
        intervals.extend(detect_plateaus(t, smoothed("loss"), log_sigma, condensation.t_end, th))
    for stage in STAGES:
        if stage.detect is not None:
            intervals.extend(stage.detect(Detection(t, smoothed, observables, th, list(intervals))))
    order = list(STAGE)
    intervals.sort(key=lambda interval: (interval.t_start, order.index(interval.stage)))
    cycles = count_cycles(intervals)
    return StageReport(intervals=intervals, cycles=cycles, thresholds=th)


def event_label(event: tuple) -> str:
    """How tables name a key of ``StageReport.events``: e.g. "focus q3 #1", "restart σ1 #2"."""
    stage, query, direction, occurrence = event
    return f"{stage} {subject_label(query, direction)} #{occurrence}"
