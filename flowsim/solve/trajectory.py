"""A trajectory: parameters and loss saved at ascending times, t[0] = 0 the initial point."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowsim.common.io import DamagedFileError, read_npz, write_atomic_npz


@dataclass(frozen=True)
class Trajectory:
    """``t`` (T,), ``loss`` (T,), and ``params[name]`` with leading axis T (time)."""

    t: np.ndarray
    loss: np.ndarray
    params: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        n = len(self.t)
        if len(self.loss) != n or any(len(value) != n for value in self.params.values()):
            raise ValueError("trajectory arrays must share the leading (time) axis")
        if n > 1 and np.any(np.diff(self.t) <= 0):
            raise ValueError("trajectory times must be strictly ascending")

    def __len__(self) -> int:
        return len(self.t)

    def at(self, index: int) -> dict[str, np.ndarray]:
        """The parameter dict at one saved time."""
        return {name: value[index] for name, value in self.params.items()}

    def save(self, path: Path) -> None:
        """Write ``trajectory.npz`` atomically (arrays t, loss, and one per parameter)."""
        write_atomic_npz(Path(path), {"t": self.t, "loss": self.loss, **self.params})

    @classmethod
    def load(cls, path: Path) -> "Trajectory":
        """Read ``trajectory.npz``; a damaged or inconsistent file raises ``DamagedFileError``."""
        remedy = f"run the flow again (flowsim run {Path(path).parent / 'config.toml'} --out NEW_DIR)"
        arrays = read_npz(path, required=("t", "loss"), remedy=remedy)
        t, loss = arrays.pop("t"), arrays.pop("loss")
        for name, values in {"t": t, "loss": loss, **arrays}.items():  # a flow's saved points are finite (a run that
            bad = ~np.isfinite(np.asarray(values, dtype=float))      # left the flow keeps its last sound one)
            if bad.any():
                first = int(np.argmax(bad.reshape(len(bad), -1).any(axis=1))) if np.ndim(values) else 0
                raise DamagedFileError(path, f"{name} is not finite from saved point {first} on ({int(bad.sum())} "
                                             "entries)", remedy)
        try:
            return cls(t=t, loss=loss, params=arrays)
        except ValueError as error:
            raise DamagedFileError(path, str(error), remedy) from None
