"""The experiment toolkit: what every script in `experiments/` shares, so a script reads as its demos.

Why one module in the package (not a helper file beside the scripts): the scripts' names start with a
digit, so they cannot import each other; the package is importable from scripts, tests and notebooks
alike, and the flags live next to the table printer they feed.

A new experiment is its demos and a `main` that is one call:

    def demo1(args, rep):
        gpu = PaperGPU.from_args(args)                  # Llama-3-8B on the paper H100, SLO 1 s / 50 ms
        res = gpu.run("chat", 16.0, 600, "orca-oracle", args.seed, max_bs=256)   # a RunResult
        f = gpu.figures(res)                            # the FIGURES a table prints (from Metrics)
        rep.put("demo1", f)
        rep.section("demo1", "Demo 1: ...", [[ms(f["ttft_median_s"]), pct(f["slo_attainment"])]],
                    ["TTFT ms", "SLO %"])
        rep.compare("demo1_lecture_vs_project", "Demo 1: the lecture beside ours",
                    {"TTFT median s": (0.012, f["ttft_median_s"])})
        rep.trace(res)                                  # written only if --trace FILE was given
        rep.plot("06_something", plots.rate_sweep, ...) # drawn only if --plot DIR was given

    def main(argv: list[str] | None = None) -> dict:    # argv None: the command line; returns the figures
        return run_experiment(__doc__, [demo1, demo2], argv=argv, setup=setup,
                              flags=("plot", "trace", "cost_model"))

    if __name__ == "__main__":
        main()

Every script has that shape: a docstring saying what it shows and where in the lecture, and what
each demo number runs (`--help` prints it whole), its demos, `main(argv)` (so a test or a notebook
runs it as `main(["--quick", "--json"])`) and the guard.

Flags, one meaning everywhere (a script asks only for those that mean something to it):

    always   --seed N, --quick, --json; --demos 1,3 whenever the body is a list of demos
    flags    "threads" --threads N  torch threads (default 1); pair with within=lambda a: torch_threads(a.threads)
             "device"  --device D   torch device for real models (cpu, cuda, cuda:N), checked before any demo
             "plot"    --plot DIR   write PNG figures there (needs the `plot` extra: matplotlib)
             "trace"   --trace FILE write one run as Chrome trace-event JSON (Perfetto, chrome://tracing)
             "seeds"   --seeds N    headline figures over seed_list(args) = seed..seed+N-1 (default 3, 1 with --quick)
             "cost_model" --cost-model roofline|refined  how the paper GPU prices a step; PaperGPU.from_args
                        passes `cost_model=` on only when it is not the default

`run_experiment(description, body, add_args=None, argv=None, *, flags, setup, within)`: `body` is one
`body(args, rep)` or a list of demos `demo(args, rep)`; `setup(args, rep)` runs first, whichever demos
are chosen, and leaves in `rep.results` what several demos need. The `Report`:

    rep.section(key, title, rows, headers, note)   a table (printed unless --json)
    rep.compare(key, title, {name: (lecture, project[, shown])}, note)   the lecture beside the project
                                                    (labels={name: words}: the table's names, where
                                                    the JSON's are identifiers; over_seeds too)
    rep.put(key, value) / rep.text(s)               figures for the JSON / prose for people
    rep.plot(name, draw, *a) / rep.plotting         draw(DIR/name.png, *a) if --plot DIR was given
    rep.trace(result)                               the run --trace FILE writes (the first one offered)
    with rep.progress("what", total) as bar: ...    a progress line on stderr (never stdout, never --json):
                                                    bar(detail) after each piece, or `for x in bar.each(items)`;
                                                    progress_of(rep, ...) is the same, silent when rep is None

Runs on the paper GPU: `PaperGPU(model, gpu, slo, cost_model)` with `.run` (-> RunResult), `.metrics`
(-> Metrics), `.figures` (-> dict of FIGURES), `.goodput(n, seed, rel_tol, system=..., rep=rep)` (a
goodput search that shows each rate tried), `.title` and `.kv_slots`. Over seeds: `over_seeds(args, rep,
key, title, first, at_seed)` (a demo's seeded figures: the first seed's from its own run, the rest by running
it again; recorded and printed), built on `seed_list(args)`, `spread(values)` ({"median", "min", "max",
"values"}) and `spread_rows`. The chat workload:
`chat_lengths(n, seed)` (the whole trace's lengths are `workload.trace_lengths()`), `workload_note(lengths)`,
and the systems code 03 compares on it, `CHAT_SYSTEMS`.
"The same load" as the lecture's: `load_setup` (Orca (oracle)'s measured goodput, recorded under "setup")
and `same_load(rate, goodput)`.
Figures of a run's steps: `queued(res)`, `step_figures(res)`. Table cells: `ms`, `pct`. What a
benchmark timed on: `machine(torch_threads)` (a dict for its JSON) and `machine_line(m)` (its printed line).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence, Sized

import numpy as np
from tabulate import tabulate

from orca_torch.checks import (SEED_LIMIT, SEED_RANGE, brief, check_choice, check_instance, is_finite_real,
                               is_real)
from orca_torch.lab.cli_args import (add_seed_flag, command_parser, demos_arg, device_arg, dir_out_arg,
                                     json_out_arg, seeds_arg, threads_arg)

PLOT_INSTALL = "pip install 'orca-torch[plot]' (or: pip install 'matplotlib>=3.9')"
COST_MODELS = ("roofline", "refined")


def _plot_dir_arg(text: str) -> Path:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError(f"needs matplotlib, which is not installed: {PLOT_INSTALL}") from None
    return dir_out_arg(text)


def _cost_model_arg(text: str) -> str:
    if text not in COST_MODELS:
        raise argparse.ArgumentTypeError(f"unknown cost model {brief(text)}; allowed: {', '.join(COST_MODELS)}")
    return text


def _add_flag(p: argparse.ArgumentParser, name: str, n_demos: int) -> None:
    if name == "threads":
        p.add_argument("--threads", type=threads_arg, default=1,
                       help="torch threads (default 1: on a shared 2-core machine a second thread stalls small ops)")
    elif name == "device":
        import torch

        p.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu",
                       help="torch device for the real models: cpu, cuda or cuda:N (default: cuda if present)")
    elif name == "demos":
        p.add_argument("--demos", type=demos_arg(n_demos), default=None,
                       help=f"comma-separated demo numbers to run, from 1 to {n_demos}, e.g. 1,{n_demos} (default: "
                            "all; the description above says what each shows)"
                       if n_demos > 1 else "1: the script has one demo (the default)")
    elif name == "plot":
        p.add_argument("--plot", type=_plot_dir_arg, default=None, metavar="DIR",
                       help=f"write the figures as PNG files into DIR (needs matplotlib: {PLOT_INSTALL})")
    elif name == "trace":
        p.add_argument("--trace", type=json_out_arg, default=None, metavar="FILE",
                       help="write one run as Chrome trace-event JSON into a .json file (open it in Perfetto "
                            "or chrome://tracing)")
    elif name == "seeds":
        p.add_argument("--seeds", type=seeds_arg, default=None, metavar="N",
                       help="run the headline figures over seeds seed..seed+N-1 and print median and range "
                            "(default 3, 1 with --quick)")
    else:
        assert name == "cost_model", f"unknown flag {name!r}"
        p.add_argument("--cost-model", type=_cost_model_arg, default=COST_MODELS[0],
                       help=f"how the paper GPU prices a step: {' or '.join(COST_MODELS)} (default {COST_MODELS[0]})")


def experiment_parser(description: str, flags: Sequence[str] = (), n_demos: int = 0) -> argparse.ArgumentParser:
    """The common flags plus the named optional ones (`--demos` takes 1..`n_demos`); a script may add
    its own before parsing. `description`, the script's docstring, is printed by `--help` as written:
    it is where a reader learns what each demo number runs."""
    p = command_parser(description)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_seed_flag(p, "every random choice")
    p.add_argument("--quick", action="store_true", help="a smaller form that finishes in seconds")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object on stdout")
    for name in flags:
        _add_flag(p, name, n_demos)
    return p


class _Progress:
    """A progress line on stderr: redrawn in place on a terminal, a start and an end line otherwise."""

    def __init__(self, what: str, total: int | None, enabled: bool) -> None:
        self.what, self.total, self.enabled = what, total, enabled
        self.done, self.t0 = 0, time.perf_counter()
        self.tty = enabled and sys.stderr.isatty()
        if enabled and not self.tty:
            print(f"{what} ...", file=sys.stderr, flush=True)

    def __call__(self, detail: str = "") -> None:
        self.done += 1
        if self.tty:
            of = f"/{self.total}" if self.total else ""
            sys.stderr.write(f"\r{self.what}: {self.done}{of} {detail}\033[K")
            sys.stderr.flush()

    def each(self, items: Sequence[Any]) -> Iterator[Any]:
        """The items, one tick after each is done."""
        for x in items:
            yield x
            self(str(x))

    def close(self, stopped: bool = False) -> None:
        """The end line: `stopped` (an error or Ctrl-C ended the work) says so, not "done"."""
        if self.enabled:
            end = "\r" if self.tty else ""
            steps = f", {self.done} done" if self.done else ""
            how = "stopped after" if stopped else "done in"
            line = f"{self.what}: {how} {time.perf_counter() - self.t0:.1f} s{steps}"
            sys.stderr.write(f"{end}{line}\033[K\n" if self.tty else f"{line}\n")
            sys.stderr.flush()


@dataclass
class Report:
    """Collects a script's tables and figures; prints tables, or JSON with `--json`."""

    as_json: bool = False
    results: dict[str, Any] = field(default_factory=dict)
    plot_dir: Path | None = None
    trace_path: Path | None = None
    show_progress: bool = True
    written: list[Path] = field(default_factory=list)

    def section(self, key: str, title: str, rows: Sequence[Sequence[Any]] | Sequence[dict],
                headers: Sequence[str] | str = "keys", note: str | None = None,
                floatfmt: str = "g") -> None:
        """Print one table (unless JSON). `key` names the entry of `results` that holds the table's
        figures, for the script's reader: the table itself puts nothing there (`put` and `compare` do)."""
        if self.as_json:
            return
        print(f"\n== {title}")
        print(_table(rows, headers, floatfmt))
        if note:
            print(note)

    def compare(self, key: str, title: str, figures: dict[str, tuple], note: str | None = None,
                digits: int = 4, labels: Mapping[str, str] | None = None) -> None:
        """The "lecture beside project" table; `figures` maps a figure's name to (lecture, project)
        or (lecture, project, shown), `shown` being how the table prints the project's value (else a
        float to `digits` significant digits, as `spread_rows`). `labels` gives a name in words for the
        table where the JSON's name is an identifier."""
        if not isinstance(figures, dict):
            raise ValueError(f"figures must be a dict of name -> (lecture, project[, shown]), got {brief(figures)}")
        for k, v in figures.items():
            if not isinstance(v, (tuple, list)) or len(v) not in (2, 3):
                raise ValueError(f"figures[{brief(k)}] must be (lecture, project) or (lecture, project, shown), "
                                 f"got {brief(v)}")
        _check_labels(labels, figures)
        self.put(key, {k: {"lecture": v[0], "project": v[1]} for k, v in figures.items()})
        rows = []
        for k, v in figures.items():
            shown = v[2] if len(v) > 2 else (float(f"{v[1]:.{digits}g}") if isinstance(v[1], (float, np.floating))
                                             else v[1])
            rows.append([(labels or {}).get(k, k), v[0], shown])
        self.section(key, title, rows, ["figure", "lecture", "project"], note=note)

    def text(self, s: str) -> None:
        if not self.as_json:
            print(s)

    def put(self, key: str, value: Any) -> None:
        self.results[key] = value

    @property
    def plotting(self) -> bool:
        """True when `--plot DIR` was given: keep what the figures need."""
        return self.plot_dir is not None

    def plot(self, name: str, draw: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """`draw(DIR/name.png, *args, **kwargs)` if `--plot DIR` was given; says on stderr what it wrote."""
        if self.plot_dir is None:
            return
        self.plot_dir.mkdir(parents=True, exist_ok=True)
        path = self.plot_dir / f"{name}.png"
        draw(path, *args, **kwargs)
        self.written.append(path)
        print(f"wrote {path}", file=sys.stderr)

    def trace(self, result: Any) -> None:
        """Write `result` to `--trace FILE` (the first run offered; later ones are ignored)."""
        if self.trace_path is None or any(p == self.trace_path for p in self.written):
            return
        from orca_torch.lab.chrome_trace import to_chrome_trace

        to_chrome_trace(result, self.trace_path)
        self.written.append(self.trace_path)
        print(f"wrote {self.trace_path}", file=sys.stderr)

    @contextlib.contextmanager
    def progress(self, what: str, total: int | None = None) -> Iterator[Callable[[str], None]]:
        """Progress of long work on stderr; silent with --json (stdout stays one JSON object)."""
        bar = _Progress(what, total, self.show_progress and not self.as_json)
        try:
            yield bar
        except BaseException:
            bar.close(stopped=True)
            raise
        bar.close()

    def finish(self) -> None:
        if self.as_json:
            json.dump(jsonable(self.results), sys.stdout, indent=2, sort_keys=False)
            sys.stdout.write("\n")


def _is_number(c: Any) -> bool:
    return isinstance(c, (int, float, np.integer, np.floating)) and not isinstance(c, bool)


def _numeric_text(c: Any) -> bool:
    """What tabulate reads as a number: a number, or a string that parses as one."""
    if _is_number(c) or not isinstance(c, str):
        return _is_number(c)
    try:
        float(c)
    except ValueError:
        return False
    return True


def _written(c: Any) -> bool:
    """A cell the script wrote as a number (`f"{x:.1f}"`, `f"{n:,}"`): a string that reads as one,
    its thousands separators aside."""
    return isinstance(c, str) and _numeric_text(c.replace(",", ""))


def _filled(col: Sequence[Any]) -> list[Any]:
    """A column's cells that hold something (not None, not "")."""
    return [c for c in col if c is not None and c != ""]


def _partly_written(col: Sequence[Any]) -> bool:
    """A column of figures some of them written as strings by the script ("22.0" beside 25.7,
    "131,072" above 16.061): tabulate would read those as numbers again, so `_table` prints them as
    written."""
    filled = _filled(col)
    return any(map(_written, filled)) and all(_written(c) or _is_number(c) for c in filled)


def _table(rows: Sequence[Sequence[Any]] | Sequence[dict], headers: Sequence[str] | str = "keys",
           floatfmt: str = "g") -> str:
    """tabulate's table, but a column of counts and figures (a step count below times) prints its
    counts as integers: tabulate types the whole column float and would print 124 as 124.000. A
    column of figures where some are written as strings ("22.0" beside "25.7", "131,072" above
    "16.061") prints those as written: tabulate would read them as floats again, printing 22.0 as 22
    and dropping the separators. Such a column aligns at the decimal point as tabulate's numbers do,
    right-aligned where a figure has separators. Rows given as dicts are read as rows of their keys."""
    if rows and isinstance(rows[0], dict):
        keys = list(dict.fromkeys(k for r in rows for k in r))
        headers = ([headers.get(k, k) for k in keys] if isinstance(headers, dict) else keys if headers == "keys"
                   else headers)
        rows = [[r.get(k) for k in keys] for r in rows]
    if not rows:
        return tabulate(rows, headers=headers, floatfmt=floatfmt)
    cols = [[r[j] for r in rows if j < len(r)] for j in range(max(map(len, rows)))]
    numeric = [all(map(_numeric_text, _filled(col))) for col in cols]
    floats = [[isinstance(c, (float, np.floating)) for c in col if _is_number(c)] for col in cols]
    mixed = [n and any(f) and not all(f) for n, f in zip(numeric, floats)]
    as_written = [_partly_written(col) for col in cols]
    if not any(mixed) and not any(as_written):
        return tabulate(rows, headers=headers, floatfmt=floatfmt)
    shown = lambda c: format(c, floatfmt) if isinstance(c, (float, np.floating)) else str(c)  # noqa: E731
    cells = [[shown(c) if (mixed[j] or as_written[j]) and _is_number(c) else c for j, c in enumerate(row)]
             for row in rows]
    align = ["right" if w and any(_written(c) and "," in c for c in col) else "decimal" if n or w else "left"
             for n, w, col in zip(numeric, as_written, cols)]
    return tabulate(cells, headers=headers, floatfmt=floatfmt, colalign=align,
                    disable_numparse=[j for j, (m, w) in enumerate(zip(mixed, as_written)) if m or w])


def progress_of(rep: Report | None, what: str, total: int | None = None
                ) -> contextlib.AbstractContextManager[Callable[[str], None]]:
    """`rep.progress(what, total)`, or, for a caller given no report, a tick that shows nothing."""
    return rep.progress(what, total) if rep is not None else contextlib.nullcontext(lambda detail="": None)


def jsonable(x: Any) -> Any:
    """`x` as JSON holds it: numpy and torch scalars as Python numbers, their arrays and tuples as
    lists, keys as strings, and a figure a run has not (NaN, inf) as null (JSON has no NaN)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if getattr(x, "ndim", 0) > 0 and callable(getattr(x, "tolist", None)):     # numpy / torch arrays
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


Demo = Callable[[argparse.Namespace, Report], None]


def run_experiment(description: str, body: Demo | Sequence[Demo],
                   add_args: Callable[[argparse.ArgumentParser], None] | None = None,
                   argv: Sequence[str] | None = None, *, flags: Sequence[str] = (),
                   setup: Demo | None = None,
                   within: Callable[[argparse.Namespace], contextlib.AbstractContextManager] | None = None,
                   trace_from: Demo | None = None, seeds_from: Sequence[Demo] = (), plots_from: Sequence[Demo] = (),
                   check: Callable[[argparse.Namespace], str | None] | None = None) -> dict[str, Any]:
    """Parse the flags, run `setup` and the chosen demos (or `body(args, report)`), print, return the results.

    `description` is the script's docstring, which `--help` prints whole: its demos are named by their
    numbers there, never by their functions' names (04_scheduling's `demo3` is `--demos 1`).
    `body` is one function or a list of demos; a list adds `--demos` (demo k is `body[k - 1]`).
    `within(args)`, if given, is a context the whole run happens in (e.g. `torch_threads(args.threads)`).
    `trace_from` is the demo that writes `--trace FILE`, `seeds_from` the demos that read `--seeds N`,
    `plots_from` those that draw for `--plot DIR` (none named: any may): a `--demos` that leaves out
    every demo a flag given needs is refused before anything runs. `check(args)` says what is
    wrong with flags that are each fine alone but not together (None: nothing), refused as a usage
    error. A reader of the output that stops early (`| head`), or Ctrl-C, ends the script quietly.
    """
    demos = list(body) if isinstance(body, (list, tuple)) else None
    flags = list(flags) + (["demos"] if demos is not None and "demos" not in flags else [])
    p = experiment_parser(description, flags, len(demos or ()))
    if add_args:
        add_args(p)
    args = p.parse_args(argv)
    problem = check(args) if check else None
    if problem:
        p.error(problem)
    chosen = getattr(args, "demos", None) or range(1, len(demos or ()) + 1)
    needed = {}
    for flag, given, needs in (("--trace", getattr(args, "trace", None) is not None, [trace_from] if trace_from else []),
                               ("--seeds", getattr(args, "seeds", None) is not None, seeds_from),
                               ("--plot", getattr(args, "plot", None) is not None, plots_from)):
        ks = needed[flag] = [demos.index(d) + 1 for d in needs] if demos is not None else []
        if given and ks and not set(ks) & set(chosen):
            p.error(f"{flag} needs demo {' or '.join(map(str, ks))}, which "
                    f"--demos {','.join(map(str, chosen))} leaves out")
    if "seeds" in flags:
        default = "" if args.seeds else f" (the default{' with --quick' if args.quick else ''})"
        args.seeds = args.seeds or (1 if args.quick else 3)
        read = not needed["--seeds"] or set(needed["--seeds"]) & set(chosen)
        if read and args.seed + args.seeds - 1 >= SEED_LIMIT:
            p.error(f"--seed {args.seed} with --seeds {args.seeds}{default} goes past the last seed: seeds must be "
                    f"{SEED_RANGE}; give --seeds {SEED_LIMIT - args.seed} at most, or a smaller --seed")
    rep = Report(as_json=args.json, plot_dir=getattr(args, "plot", None), trace_path=getattr(args, "trace", None))
    if getattr(args, "cost_model", COST_MODELS[0]) != COST_MODELS[0]:
        rep.results["cost_model"] = args.cost_model       # (a saved output says how its steps were priced)
    with quiet_exit(), within(args) if within else contextlib.nullcontext():
        if setup:
            setup(args, rep)
        if demos is None:
            body(args, rep)
        else:
            for k in chosen:
                demos[k - 1](args, rep)
        rep.finish()
    assert rep.trace_path is None or rep.trace_path in rep.written, \
        f"--trace {rep.trace_path}: no run was recorded (a bug in the script: it names no demo that writes the trace)"
    if rep.plot_dir is not None and not any(p.suffix == ".png" for p in rep.written):
        print(f"--plot {rep.plot_dir}: no figure drawn (the demos run draw none)", file=sys.stderr)
    return rep.results


INTERRUPTED_EXIT = 128 + signal.SIGINT     # a shell's code for a command that SIGINT ended


@contextlib.contextmanager
def quiet_exit() -> Iterator[None]:
    """A command whose reader closed stdout early (`... | head`) stops without a traceback, and so
    does one that Ctrl-C stops: one line on stderr, the shell's exit code for SIGINT, and no
    `--json` object (it is printed at the end, whole or not at all). So does one whose disk is
    full (stdout sent to a file, a figure): one line saying so, exit code 1. A block that ends in
    `sys.exit(main())` has stdout flushed before it exits, here and not in the interpreter's own
    flush at exit, which would fail with "Exception ignored" and exit code 120."""
    try:
        try:
            yield
        except SystemExit:
            sys.stdout.flush()
            raise
        sys.stdout.flush()
    except OSError as e:
        full = e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))   # (a disk, or a quota, full)
        if not (full or isinstance(e, BrokenPipeError)):
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())    # so the interpreter's own flush at exit is silent too
        if full:
            print(f"stopped: {e.strerror}; what was written is cut short", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C): stopped before the end; nothing more printed or written", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT) from None


# ---- the machine a benchmark timed on ----------------------------------------------------------------

def machine(torch_threads: int | Sequence[int] | None = None) -> dict[str, Any]:
    """The machine a run was timed on: CPU model, the logical cores the process may run on, OS,
    Python and numpy, and torch's version with `torch_threads` (the thread count or counts the
    timings ran on) when given.

    The benchmarks' speeds are times and ratios taken in one run, comparable only with a run on the
    same machine, so each prints this beside them and puts it in its JSON. torch is imported only
    when `torch_threads` is given: a benchmark of the simulator does not load it (nor count its
    memory) to say so."""
    cpu = None
    with contextlib.suppress(OSError):          # Linux names the model; elsewhere the platform's word
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    m = {"cpu": cpu or platform.processor() or platform.machine(), "logical_cores": cores,
         "os": f"{platform.system()} {platform.machine()}",
         "python": platform.python_version(), "numpy": np.__version__}
    if torch_threads is not None:
        import torch

        m.update(torch=torch.__version__, torch_threads=torch_threads)
    return m


def machine_line(m: dict[str, Any]) -> str:
    """`machine()` as the one line a benchmark prints above its figures."""
    line = (f"machine: {m['cpu']}, {m['logical_cores']} logical cores ({m['os']}); Python {m['python']}, "
            f"numpy {m['numpy']}")
    if "torch" in m:
        threads = m["torch_threads"]
        shown = ",".join(map(str, threads)) if isinstance(threads, (list, tuple)) else str(threads)
        line += f", torch {m['torch']} on {shown} thread{'' if shown == '1' else 's'}"
    return line


# ---- runs on the paper GPU ---------------------------------------------------------------------------

# The figures a table reads off one run (`PaperGPU.figures`), all from `Metrics`.
FIGURES = ("n_requests", "n_rejected", "ttft_median_s", "ttft_p99_s", "ttft_max_s", "ttft_mean_s", "tpot_median_s",
           "itl_p99_s", "itl_max_s", "throughput_tok_s", "steady_throughput_tok_s", "slo_attainment", "mean_batch",
           "max_batch", "mem_occupied_frac", "mem_stored_frac")


@dataclass(frozen=True)
class PaperGPU:
    """A model on a paper GPU with an SLO: runs any system of `orca_torch.lab.api` on a workload.

    `model` is a preset's name or a `ModelSpec`, `gpu` a card's name or a GPU profile's .json path;
    `cost_model` None is the api's default, "roofline" or "refined" is passed on as `cost_model=`.
    """

    model: str = "llama-3-8b"
    gpu: str = "h100"
    slo: tuple[float, float] = (1.0, 0.05)
    cost_model: str | None = None

    def __post_init__(self) -> None:
        from orca_torch.sim.hw_model import get_gpu
        from orca_torch.specs import get_model_spec

        _check_slo_pair("slo", self.slo)
        get_model_spec(self.model)
        if isinstance(self.gpu, os.PathLike):
            object.__setattr__(self, "gpu", os.fspath(self.gpu))
        if not isinstance(self.gpu, str):
            raise ValueError(f"gpu must be a card's name or a GPU profile's .json path, got {brief(self.gpu)}")
        get_gpu(self.gpu)
        if self.cost_model is not None:
            check_choice("cost_model", self.cost_model, COST_MODELS)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **kw: Any) -> "PaperGPU":
        """The setup with the script's `--cost-model` (its default as None: the api's own); `kw` as the class."""
        cm = getattr(args, "cost_model", COST_MODELS[0])
        return cls(cost_model=None if cm == COST_MODELS[0] else cm, **kw)

    @property
    def title(self) -> str:
        """How a figure's title names the setup (the card by its name, a profile's too, not its path)."""
        from orca_torch.sim.hw_model import get_gpu
        from orca_torch.specs import get_model_spec

        priced = "" if self.cost_model is None else f" ({self.cost_model} cost model)"
        return f"{get_model_spec(self.model).name} on the paper {get_gpu(self.gpu).name.upper()}{priced}"

    @property
    def pricing(self) -> str:
        """The cost model by name (`cost_model` None is the roofline)."""
        return self.cost_model or COST_MODELS[0]

    @property
    def kv_slots(self) -> int:
        from orca_torch.sim.hw_model import kv_capacity_tokens

        return kv_capacity_tokens(self.model, self.gpu)

    def run(self, workload: Any, rate: float | None, n: int | None, system: str = "orca-max", seed: int = 0,
            **options: Any):
        """`api.run` on this model and GPU: the `RunResult` (per step and per token). A request list
        keeps its own arrivals and number: `rate` and `n` are then None (api refuses others)."""
        from orca_torch.lab.api import run

        return run(workload, rate, n, system, model=self.model, gpu=self.gpu, seed=seed, **self._priced(options))

    def _priced(self, options: dict[str, Any]) -> dict[str, Any]:
        """`options` with this setup's cost model (none: the api's default)."""
        return options if self.cost_model is None else {**options, "cost_model": self.cost_model}

    def metrics(self, res: Any, slo: tuple[float, float] | None = None):
        """`summarize(res)` at this setup's SLO, or at `slo` (TTFT s, TPOT s) when given."""
        from orca_torch.lab.metrics import summarize

        return summarize(res, *(self.slo if slo is None else _check_slo_pair("slo", slo)))

    def figures(self, res: Any, *extra: str, slo: tuple[float, float] | None = None) -> dict:
        """The FIGURES of one run (plus the `Metrics` fields named in `extra`) at this SLO."""
        m = self.metrics(res, slo)
        return {k: getattr(m, k) for k in (*FIGURES, *extra)}

    def goodput(self, n: int | None, seed: int, rel_tol: float, *, lo: float = 0.01, hi: float = 256.0,
                target: float = 0.9, workload: Any = "chat", rep: Report | None = None, label: str = "",
                **system: Any):
        """`api.goodput` on this model, GPU, cost model and SLO (lecture §5.3): the largest rate with
        attainment >= target, the same seeded requests at every rate. Like it, it bisects on
        `slo_attainment_submitted`, so a request refused at submission counts as a miss; where none
        is (a refusal raises unless `reject_invalid=True`) it equals `slo_attainment`. `n` requests
        of a named workload (None: the api's default); a request list keeps its own number, so `n` is
        None (api refuses another). With `rep`, each rate tried shows on stderr."""
        from orca_torch.lab.api import goodput, n_requests_or_default

        to = f"{rel_tol * 100:.3g}%" if is_finite_real(rel_tol) else brief(rel_tol)   # (api.goodput checks it)
        many = len(workload) if isinstance(workload, Sized) and not isinstance(workload, str) else (
            n_requests_or_default(n))
        what = f"goodput search{' ' + label if label else ''} ({many} requests, to {to})"
        with progress_of(rep, what) as tick:
            def on_rate(rate: float, a: float) -> None:
                """A rounded attainment can read as the target (0.899 as 90%): each says met or not."""
                tick(f"{rate:.3g} req/s -> {a:.1%}, {'meets' if a >= target else 'misses'} the "
                     f"{target * 100:.3g}% target")

            return goodput(workload, n_requests=n, slo_ttft_s=self.slo[0],
                           slo_tpot_s=self.slo[1], target=target, lo=lo, hi=hi, rel_tol=rel_tol, seed=seed,
                           model=self.model, gpu=self.gpu, on_rate=on_rate, **self._priced(system))


def _check_slo_pair(name: str, slo: Any) -> tuple[float, float]:
    """`slo` as (TTFT s, TPOT s), each > 0 (inf: no bound): one number alone would leave the other side
    at a default nobody chose."""
    from orca_torch.lab.metrics import check_slo

    pair = tuple(slo) if not isinstance(slo, (str, bytes)) and isinstance(slo, Iterable) else ()
    if len(pair) != 2:
        raise ValueError(f"{name} must be a pair (TTFT seconds, TPOT seconds), e.g. (1.0, 0.05), got {brief(slo)}")
    check_slo(*pair)
    return pair


def seed_list(args: argparse.Namespace) -> list[int]:
    """The seeds `--seeds N` asks for: seed, seed+1, ..., the first being the single-seed tables' own."""
    return [args.seed + k for k in range(args.seeds)]


def spread(values: Sequence[float]) -> dict:
    """Median and range of one figure over seeds (all NaN if a seed has NaN: the range is then unknown)."""
    v = list(values) if not isinstance(values, (str, bytes, dict)) and isinstance(values, Iterable) else []
    if not v or not all(is_real(x) for x in v):
        raise ValueError(f"values must be a non-empty list of numbers (one per seed), got {brief(values)}")
    v = [float(x) for x in v]
    return {"median": float(np.median(v)), "min": float(np.min(v)), "max": float(np.max(v)), "values": v}


def _check_labels(labels: Any, figures: Iterable[str]) -> None:
    """`labels` (a table's names in words for figures whose JSON names are identifiers) is None or a
    dict of text that names only `figures`: a label for a figure the table has not is a typo."""
    if labels is None:
        return
    if not isinstance(labels, Mapping) or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError(f"labels must be a dict of figure name -> its name in the table (text), got {brief(labels)}")
    names = list(figures)
    unknown = [k for k in labels if k not in names]
    if unknown:
        raise ValueError(f"labels name figures the table has not: {unknown}; its figures are {names}")


def spread_rows(by_name: dict[str, dict], digits: int = 3, labels: Mapping[str, str] | None = None) -> list[list]:
    """Table rows (figure, median, min - max, each seed) for `spread` dicts, every number to `digits`
    significant digits; `labels`: a figure's name in the table, where not its key (`_check_labels`)."""
    _check_labels(labels, by_name)
    return [[(labels or {}).get(k, k), float(f"{s['median']:.{digits}g}"),
             f"{s['min']:.{digits}g} - {s['max']:.{digits}g}",
             " ".join(f"{x:.{digits}g}" for x in s["values"])] for k, s in by_name.items()]


def over_seeds(args: argparse.Namespace, rep: Report, key: str, title: str, first: dict[str, float | None],
               at_seed: Callable[[int], dict[str, float | None]], *, aside: str | None = None,
               under: str = "figures", name_header: str = "figure", digits: int = 3,
               if_missing: str | None = None, labels: Mapping[str, str] | None = None) -> dict[str, dict]:
    """A demo's seeded figures over `seed_list(args)`, recorded and printed; returns {name: `spread`}.

    `first` holds the figures at the first seed, from the run the demo's own tables show (so that
    seed is not run again); `at_seed(seed)` runs the demo again for each further seed and gives the
    same names. The JSON entry `key` is {"seeds": [...], under: {name: spread}}, the table is titled
    "`title` over seeds [...] (`aside`)". A figure that is None at a seed (a run that has none to
    give) counts as NaN, and the table then carries the note `if_missing`. `labels` names a figure
    in words in the table where its JSON name is an identifier.
    """
    _check_labels(labels, first)
    seeds = seed_list(args)
    per_seed = [first] + [at_seed(seed) for seed in seeds[1:]]
    assert all(d.keys() == first.keys() for d in per_seed), f"each seed must give the figures {list(first)}"
    missing = any(v is None for d in per_seed for v in d.values())
    figures = {name: spread([math.nan if d[name] is None else d[name] for d in per_seed]) for name in first}
    rep.put(key, {"seeds": seeds, under: figures})
    rep.section(key, f"{title} over seeds {seeds}" + (f" ({aside})" if aside else ""),
                spread_rows(figures, digits, labels), [name_header, "median", "range", "per seed"],
                note=if_missing if missing else None)
    return figures


# ---- the chat workload ---------------------------------------------------------------------------------

def _means(prompts: Sequence[int], outputs: Sequence[int]) -> dict:
    return {"n_requests": len(prompts), "prompt_mean_tokens": float(np.mean(prompts)),
            "output_mean_tokens": float(np.mean(outputs))}


def chat_lengths(n: int, seed: int) -> dict:
    """Mean lengths of the `n` chat requests a seed draws, and of the whole Azure conversation trace."""
    from orca_torch.lab.workload import chat, trace_lengths

    drawn = chat(n_requests=n, rate=1.0, seed=seed)
    p, o = trace_lengths()
    return {"drawn": _means([r.prompt_len for r in drawn], [r.output_len for r in drawn]),
            "whole_trace": _means(p.tolist(), o.tolist())}


def workload_note(lengths: dict) -> str:
    """The one sentence every chat table carries about its workload."""
    d, t = lengths["drawn"], lengths["whole_trace"]
    return (f"Chat = Azure conversation trace lengths; these {d['n_requests']} requests: prompt mean "
            f"{d['prompt_mean_tokens']:,.0f}, output mean {d['output_mean_tokens']:,.0f} tokens (the whole trace of "
            f"{t['n_requests']:,}: {t['prompt_mean_tokens']:,.0f} and {t['output_mean_tokens']:,.0f}). The lecture's "
            f"chat workload is unpublished and has shorter prompts, so prefill weighs more here.")


def ms(seconds: float, digits: int = 1) -> float:
    """Seconds as milliseconds for a table cell."""
    return round(seconds * 1e3, digits)


def pct(fraction: float, digits: int = 1) -> float:
    """A fraction as a percentage for a table cell."""
    return round(100 * fraction, digits)


# ---- the systems code 03 compares on the chat workload -------------------------------------------------

class ChatSystem(NamedTuple):
    """One of code 03's systems: its name in the tables, and `PaperGPU.run`'s arguments for it."""

    label: str
    options: dict[str, Any]


CHAT_ORCA_MAX_BS = 256
CHAT_SYSTEMS = {"one_at_a_time": ChatSystem("one-at-a-time", dict(system="sequential")),
                "static_b128": ChatSystem("static (B=128)", dict(system="static", max_bs=128)),
                "orca_max": ChatSystem("Orca (max 8192)", dict(system="orca-max", max_bs=CHAT_ORCA_MAX_BS)),
                "orca_oracle": ChatSystem("Orca (oracle)", dict(system="orca-oracle", max_bs=CHAT_ORCA_MAX_BS))}
"""JSON key -> `ChatSystem` of code 03's systems (lecture §5.2-§5.4): `03_continuous_batching.py` runs them
and `03_cost_models.py` prices the same runs twice, so both take them from here."""


# ---- what "the same load" means on our GPU, and two figures of a run's steps ----------------------------

LECTURE_ORACLE_GOODPUT = 63.24  # req/s: the lecture's Orca (oracle) chat goodput (code 03 demo 2)


def same_load(rate: float, goodput: float) -> int:
    """The rate that is the same fraction of our Orca (oracle) goodput as `rate` is of the lecture's."""
    return max(1, round(rate * goodput / LECTURE_ORACLE_GOODPUT))


def load_setup(args: argparse.Namespace, rep: Report, gpu: PaperGPU, n: int, **slos: tuple[float, float]) -> float:
    """Measure Orca (oracle)'s chat goodput (to 5%; --quick: 200 requests, to 20%); record the setup under "setup".

    Where a lecture rate assumes a load its system carries without queueing, a demo also runs
    `same_load(rate, goodput)`. `n` is the requests of each of the demos' runs (recorded, and the
    chat lengths drawn for the note); `slos`, each name=(TTFT s, TPOT s), are the demos' other SLOs,
    recorded as name_ttft_s and name_tpot_s. Returns the goodput in req/s.
    """
    search_n, rel_tol = (200, 0.2) if args.quick else (n, 0.05)
    search = gpu.goodput(search_n, args.seed, rel_tol, lo=1.0, hi=128.0, rep=rep, label="Orca (oracle), chat",
                         system="orca-oracle")
    lengths = chat_lengths(n, args.seed)
    extra = {f"{k}_{part}": v for k, slo in slos.items() for part, v in zip(("ttft_s", "tpot_s"), slo)}
    rep.put("setup", {"model": gpu.model, "gpu": gpu.gpu, "kv_slots": gpu.kv_slots, "n_requests": n,
                      "chat_slo_ttft_s": gpu.slo[0], "chat_slo_tpot_s": gpu.slo[1], **extra,
                      "seed": args.seed, "orca_oracle_chat_goodput_req_s": search.rate,
                      "orca_oracle_chat_goodput_note": search.note, "chat_lengths": lengths,
                      "lecture_orca_oracle_chat_goodput_req_s": LECTURE_ORACLE_GOODPUT})
    rep.text(f"{gpu.title} ({gpu.kv_slots:,} K/V slots), {n} requests per run. {workload_note(lengths)} "
             f"Orca (oracle) chat goodput, measured: {search.rate:.1f} req/s (to {rel_tol:.0%})."
             + (f" {search.note}" if search.note else ""))
    return search.rate


def queued(res: Any) -> int:
    """Requests not admitted at the first step that started at or after their arrival (they waited in the queue).
    A prompt fed whole makes its first token in the step that admitted it; one cut in chunks
    (`chunked_prefill`) makes it steps later, so there the admissions are read from the run's trace."""
    from orca_torch.core.run_result import RunResult

    check_instance("res", res, RunResult)
    first_after_arrival = np.searchsorted(res.step_start, res.arrival_s, side="left")
    if not res.config.chunked_prefill:
        return int((res.first_token_step > first_after_arrival).sum())
    if res.trace is None:
        raise ValueError("a run with chunked_prefill makes a prompt's first token steps after the one that admitted "
                         "it, so which step admitted each request only its trace says: run it with trace=True")
    admitted = np.array([steps[0][0] for steps in res.fed_steps()], dtype=np.int64)   # (its first step)
    return int((admitted > first_after_arrival).sum())


def step_figures(res: Any) -> dict:
    """The most new tokens any step fed and the longest any step took (two maxima, not always of one
    step): what a decoding request can be stalled by."""
    from orca_torch.core.run_result import RunResult

    check_instance("res", res, RunResult)
    if not res.n_steps:
        raise ValueError(f"the run made no step ({len(res.rejected)} request(s) refused at submission): it has no "
                         "largest step")
    return {"max_step_tokens": int(res.step_n_tokens.max()), "max_step_s": float((res.step_end - res.step_start).max())}
