"""Running the scripts under scripts/ in the test process: a script file loaded as a module, and its `main(argv)`
called the way its command line would call it (argparse's usage errors included), which saves each case a fresh
interpreter's imports (about 10 s on 2 busy cores). Each script keeps at least one test through a real subprocess."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (registered in sys.modules: dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def exit_code(module: ModuleType, argv: Sequence[str]) -> int:
    """`module.main(argv)`'s exit status: its return value, or the code of the SystemExit it raised (argparse)."""
    try:
        return module.main(list(argv))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
