"""argparse types and up-front checks for the command-line tools outside `experiments/`.

The benchmarks, `examples/serve_llama.py` and `python -m orca_torch.distributed` take counts,
seconds, output files and model presets. A bad value must fail at parse time with one line that
says what was wrong and what is allowed (argparse's usage error, exit code 2), before a model is
built, a process group is set up or minutes of measuring are spent. The experiment scripts'
flags (`report.experiment_parser`) take their types, and `--seed` itself, from here too; every
tool's parser is `command_parser` (flags typed in full, a flag's value given once). A refusal
the library makes later (a mix of flags, a budget that does not fit) names its Python parameters;
a tool passes it through `in_flag_terms` so that the user reads the flags they typed.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from orca_torch.checks import SEED_LIMIT, SEED_RANGE, brief, check_device, quoted_path

FP32_BYTES = 4     # `OrcaModel`'s default dtype: a tool sizes its memory check on `spec.with_dtype_bytes(FP32_BYTES)`


class _Parser(argparse.ArgumentParser):
    """argparse's parser, refusing a flag that takes a value given twice (`--seed 1 ... --seed 2`):
    argparse would keep the last and drop the first, unsaid."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        words = sys.argv[1:] if args is None else list(args)
        valued = {o: a for a in self._actions if isinstance(a, argparse._StoreAction) for o in a.option_strings}
        seen: dict[str, str] = {}                   # dest -> the flag that first gave it
        for word in words[:words.index("--")] if "--" in words else words:
            flag = word.split("=", 1)[0]
            if flag not in valued:
                continue
            if valued[flag].dest in seen:
                self.error(f"{seen[valued[flag].dest]} is given twice; give it once")
            seen[valued[flag].dest] = flag
        return super().parse_known_args(args, namespace)


def command_parser(description: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command-line tool here. Abbreviations are off: a flag one tool has and
    another lacks would otherwise run, in the other, as a longer flag it happens to begin
    (`bench_serve.py --quick` as `--quick-calibration`, `python -m orca_torch.distributed --n 4` as
    `--n-workers 4`); a flag is typed in full, or refused as unrecognized. A flag with a value is
    given once (`_Parser`)."""
    return _Parser(prog=prog, description=description, allow_abbrev=False)


def threads_arg(text: str) -> int:
    """argparse type for `--threads`: an integer from 1 to this machine's cores (`accounting.torch_threads`
    trusts it)."""
    return int_arg(1, os.cpu_count() or 1, " (this machine's cores)")(text)


def _parsed(check: Callable[[str], object], text: str):
    """`check(text)`, its ValueError turned into argparse's usage error (the message kept)."""
    try:
        return check(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def in_flag_terms(message: str, flags: Mapping[str, str]) -> str:
    """A library's refusal, which names the Python parameters, said in the terms of the command line
    that set them (`flags`: parameter -> its flag, `max_bs` -> `--max-bs`), for a tool to pass to
    `parser.error`. `name='value'` (or `name=3`) becomes `--flag value`, as typed; a name with an
    underscore becomes its flag wherever it stands as a word; a one-word name (`model`, `memory`,
    which prose uses too) only where it opens the message. A name after a dot is a field of
    something else (a profile's `GPUSpec.flop_efficiency`), not the parameter: it stays."""
    for name, flag in sorted(flags.items(), key=lambda kv: -len(kv[0])):
        word = rf"(?<![\w.-]){re.escape(name)}(?![\w-])"
        message = re.sub(word + r"""=(?:'([^']*)'|"([^"]*)"|([\w.+-]+))""",
                         lambda m: f"{flag} {next(g for g in m.groups() if g is not None)}", message)
        if "_" in name:
            message = re.sub(word, flag, message)
        elif re.match(word + " ", message):
            message = flag + message[len(name):]
    return message


def flag_names(p: argparse.ArgumentParser) -> dict[str, str]:
    """Each option of `p` by its parameter name (argparse's dest) -> its flag (`max_bs` -> `--max-bs`):
    the `flags` a tool gives `in_flag_terms`."""
    return {a.dest: a.option_strings[0] for a in p._actions if a.option_strings}


def device_arg(text: str) -> str:
    """argparse type for `--device`: `checks.check_device`, before any demo runs, so a bad device costs no output."""
    import torch

    dev = torch.device(_parsed(check_device, text))
    return "cpu" if dev.type == "cpu" else str(dev)


def demos_arg(n_demos: int) -> Callable[[str], list[int]]:
    """argparse type for `--demos`: comma-separated demo numbers, each in 1..n_demos and named once,
    at least one; they run in the script's order."""
    allowed = (f"comma-separated demo numbers in 1..{n_demos}, e.g. 1,{n_demos} (leave the flag out to run all)"
               if n_demos > 1 else "1, the script's only demo (or leave the flag out)")

    def parse(text: str) -> list[int]:
        parts = [x.strip() for x in text.split(",")]
        if not text.strip():
            raise argparse.ArgumentTypeError(f"is empty; give {allowed}")
        if any(not x for x in parts):
            raise argparse.ArgumentTypeError(f"empty demo number in {brief(text)}; give {allowed}")
        try:
            numbers = [int(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {brief(text)}; give {allowed}") from None
        twice = sorted({d for d in numbers if numbers.count(d) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{brief(text)} names demo {', '.join(map(str, twice))} twice; give each "
                                             "once (they run in the script's order)")
        chosen = sorted(numbers)
        bad = [d for d in chosen if not 1 <= d <= n_demos]
        if bad:
            raise argparse.ArgumentTypeError(f"no demo {', '.join(map(str, bad))}; give {allowed}")
        return chosen
    return parse


def writable_dir(path: Path) -> Path:
    """`path` as a directory files can be written into, or an `argparse.ArgumentTypeError` saying
    why not; checked before any work is done, not after. A missing directory is made by whoever
    writes the first file into it, so a command line refused for another reason leaves nothing."""
    existing = path
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        existing = existing.parent              # the nearest directory there is: the rest is made there
    if existing == path and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{quoted_path(path)} exists and is not a directory")
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write into {quoted_path(path)}: {quoted_path(existing)} is not a "
                                         "directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:            # (ENOENT in a directory that is there: one of the kernel's, e.g. /proc)
        why = f"{quoted_path(existing)} takes no new files" if e.errno == errno.ENOENT else e.strerror or e
        raise argparse.ArgumentTypeError(f"cannot write into {quoted_path(path)}: {why}") from None
    return path


@contextlib.contextmanager
def _os_error_refused(path: Path) -> Iterator[None]:
    """An OSError of the file system's while `path` is looked at (a name too long for it, say), said
    as argparse's usage error rather than let out as a traceback."""
    try:
        yield
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {quoted_path(path)}: {e.strerror or e}") from None


def dir_out_arg(text: str) -> Path:
    """argparse type for an output directory: a non-empty path whose nearest existing part can be
    written into (the rest is made when the first file is written)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a directory to write into")
    with _os_error_refused(Path(text)):
        return writable_dir(Path(text))


def file_out_arg(text: str) -> Path:
    """argparse type for an output file: a file name (not a directory) whose directory can be
    written into (made, when the file is written, if missing)."""
    path = Path(text)
    with _os_error_refused(path):
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{quoted_path(text)} is a directory; give the name of a file to write")
        if not text or text.endswith(("/", "\\")):
            raise argparse.ArgumentTypeError(f"{quoted_path(text)} is not a file name; give a path such as run.json")
        writable_dir(path.parent)
    return path


def int_arg(lo: int = 1, hi: int | None = None, why: str = "", what: str | None = None) -> Callable[[str], int]:
    """argparse type: an integer in [lo, hi] (`hi` None: no upper bound); `what` says so in the
    message (default: the range), `why` follows it."""
    what = what or f"an integer {f'>= {lo}' if hi is None else f'from {lo} to {hi}'}"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {what}{why}, got {brief(text)}")
        return v
    parse.__name__ = "integer"
    return parse


count_arg = int_arg(1)
port_arg = int_arg(1, 65535)
seeds_arg = int_arg(1, 100)           # `--seeds`: how many seeds
seed_arg = int_arg(0, SEED_LIMIT - 1, what=SEED_RANGE)   # `--seed`: the project's one seed rule


def add_seed_flag(p: argparse.ArgumentParser, seeds: str) -> None:
    """`--seed` (default 0) on `p`, its help saying what it `seeds` and the range: every tool's seed
    flag is this one, so none is left without its rule."""
    p.add_argument("--seed", type=seed_arg, default=0, help=f"seed of {seeds}, {SEED_RANGE} (default 0)")


def float_arg(hi: float | None = None, unit: str = "", zero: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number > 0 (>= 0 with `zero`; and <= hi when given); `unit` is said
    in the message."""
    what = f"a finite number{' of ' + unit if unit else ''} {'>=' if zero else '>'} 0" + \
        (f" and <= {hi:g}" if hi is not None else "")

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and (v >= 0 if zero else v > 0) and (hi is None or v <= hi)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {brief(text)}")
        return v
    parse.__name__ = "number"
    return parse


positive_float_arg = float_arg()
TIMEOUT_MAX_S = 86_400.0
timeout_arg = float_arg(TIMEOUT_MAX_S, "seconds")     # a day: beyond it socket and timedelta bounds overflow
seconds_arg = float_arg(TIMEOUT_MAX_S, "seconds", zero=True)   # a wait that may be none


def text_arg(text: str) -> str:
    """argparse type: text with at least one non-blank character."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be non-empty text, got {brief(text)}")
    return text


def _utf8_text(text: str, what: str) -> str:
    """`text_arg(text)`, refused as not being `what` (UTF-8 text) where it holds a byte that is no text (a
    lone surrogate, as Python keeps a byte of a command line that is no UTF-8)."""
    try:
        text_arg(text).encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"must be {what} (UTF-8 text), got {brief(text)}") from None
    return text


def host_arg(text: str) -> str:
    """argparse type for a host to listen on: `_utf8_text`, which the socket module could not encode
    otherwise and would refuse with a TypeError."""
    return _utf8_text(text, "a host name or address")


def prompt_arg(text: str) -> str:
    """argparse type for a prompt given as text: `_utf8_text`, which a tokenizer could not encode otherwise
    (transformers' fast tokenizer refuses it with a TypeError)."""
    return _utf8_text(text, "a prompt")


def json_out_arg(text: str) -> Path:
    """argparse type for a JSON output file: `file_out_arg` with a `.json` name."""
    if Path(text).suffix.lower() != ".json":
        raise argparse.ArgumentTypeError(f"must be a .json file path, got {quoted_path(text)}")
    return file_out_arg(text)


def gpu_arg(text: str) -> str:
    """argparse type: a card `get_gpu` knows, or a GPU profile's .json path it can read. `cpu` is
    taken unmeasured: a tool measures it where it uses it (on the threads its steps run on)."""
    from orca_torch.sim.hw_model.gpus import card_key, get_gpu

    if card_key(text) != "cpu":
        _parsed(get_gpu, text)
    return text


def torch_preset_arg(text: str) -> str:
    """argparse type: a model preset `OrcaModel` can build (`model.check_buildable`, which tells an
    unknown name the presets it builds)."""
    from orca_torch.model.orca_model import check_buildable

    _parsed(check_buildable, text)
    return text

