"""A script of the repository (benchmarks/, scripts/) loaded as a module, as the tests read it."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, register: bool = False) -> ModuleType:
    """The module at `ROOT / relative` (e.g. "benchmarks/mutation.py"), with its folder on
    sys.path for its own sibling imports; `register`: put it in sys.modules under its stem
    (dataclasses look their module up there)."""
    path = ROOT / relative
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
