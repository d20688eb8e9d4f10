"""Run pytest as if torch were not installed: ``python tests/without_torch.py [pytest arguments]``.

torch is the bridge's optional extra; everything else must work without it. A finder at the
front of ``sys.meta_path`` makes every ``import torch`` fail as it does when torch is absent
(``sys.modules['torch'] = None`` would also break libraries that probe ``sys.modules`` for array
types, which an absent torch does not).
"""

import importlib.abc
import sys

import pytest


class TorchAbsent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, TorchAbsent())
    # in this process: parallel workers (pyproject's addopts) would start without the finder
    sys.exit(pytest.main(["-n", "0", *sys.argv[1:]]))
