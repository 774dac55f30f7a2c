"""Shared helpers of the bad-input checks (one file per module under test)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted((ROOT / "experiments").glob("[0-9][0-9]_*.py"))


def load_script(script: Path):
    spec = importlib.util.spec_from_file_location(f"exp_{script.stem}", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
