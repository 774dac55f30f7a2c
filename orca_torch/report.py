"""What every experiment script shares: the flags (`--seed`, `--quick`, `--json`) and the table printer.

One way to do it for all of `experiments/`: a script builds a dict of results, prints tables for
people, or prints the same figures as one JSON object when `--json` is given.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tabulate import tabulate

from .checks import SEED_RANGE, check_seed


def threads_arg(text: str) -> int:
    """argparse type for `--threads`: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def seed_arg(text: str) -> int:
    """argparse type for `--seed`: the project's one seed rule (`checks.check_seed`), 0 <= seed < 2**63."""
    try:
        return check_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {SEED_RANGE}, got {text!r}") from None


def experiment_parser(description: str) -> argparse.ArgumentParser:
    """The common flags; a script may add its own before parsing."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seed", type=seed_arg, default=0, help=f"seed for every random choice, {SEED_RANGE} "
                   "(default 0)")
    p.add_argument("--quick", action="store_true", help="a smaller form that finishes in seconds")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object on stdout")
    return p


@dataclass
class Report:
    """Collects a script's tables and figures; prints tables, or JSON with `--json`."""

    as_json: bool = False
    results: dict[str, Any] = field(default_factory=dict)

    def section(self, key: str, title: str, rows: Sequence[Sequence[Any]] | Sequence[dict],
                headers: Sequence[str] | str = "keys", note: str | None = None,
                floatfmt: str = "g") -> None:
        """Print one table (unless JSON); `key` names the figures in `results`."""
        if self.as_json:
            return
        print(f"\n== {title}")
        print(tabulate(rows, headers=headers, floatfmt=floatfmt))
        if note:
            print(note)

    def compare(self, key: str, title: str, figures: dict[str, tuple[Any, Any]], note: str | None = None,
                digits: int = 4) -> None:
        """A "lecture beside project" table; `figures` maps a figure's name to (lecture, project)."""
        self.put(key, {k: {"lecture": a, "project": b} for k, (a, b) in figures.items()})
        self.section(key, title, [[k, a, round(b, digits) if isinstance(b, float) else b]
                                  for k, (a, b) in figures.items()],
                     ["figure", "lecture", "project"], note=note)

    def text(self, s: str) -> None:
        if not self.as_json:
            print(s)

    def put(self, key: str, value: Any) -> None:
        self.results[key] = value

    def finish(self) -> None:
        if self.as_json:
            json.dump(_jsonable(self.results), sys.stdout, indent=2, sort_keys=False)
            sys.stdout.write("\n")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def run_experiment(description: str, body: Callable[[argparse.Namespace, Report], None],
                   add_args: Callable[[argparse.ArgumentParser], None] | None = None,
                   argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse the common flags, run `body(args, report)`, print, and return the results dict."""
    p = experiment_parser(description)
    if add_args:
        add_args(p)
    args = p.parse_args(argv)
    rep = Report(as_json=args.json)
    body(args, rep)
    rep.finish()
    return rep.results
