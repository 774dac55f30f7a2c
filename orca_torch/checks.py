"""One rule for the numbers every public entry point takes, so that checks never drift apart.

- an integer is a Python `int` or a numpy integer; never a `bool` (True is not a count) nor a float
  (3.0 tokens is a sign the caller computed something else than they meant);
- a real number is an `int`, a `float` or a numpy integer/float; never a `bool`; finite unless the
  caller allows infinity;
- a seed is an integer with 0 <= seed < 2**63: numpy's generators take any seed >= 0 and torch's
  `manual_seed` any below 2**64, so this range is what both take; a second random stream drawn
  from a seed takes `derived_seed(seed)` (`seed + 1`, wrapped into the range at its top);
- a probability is a real number in [0, 1]; a choice is one of a listed set; a flag is True or False;
  a part (an executor, a list of requests, a callback) is of the class, or callable, it must be;
- memory: what a run or a model would allocate is refused up front where it exceeds what this
  machine has available (`check_fits_in_memory`), rather than failing minutes in or swapping.

Each check returns the value as a plain Python `int` / `float` and raises `ValueError` whose message
names the parameter, the allowed range and what was given.
"""
from __future__ import annotations

import array
import collections
import dataclasses
import decimal
import inspect
import json
import math
import numbers
import os
import reprlib
from itertools import islice
from typing import Any, Iterable, Mapping, Sequence, TypeVar

import numpy as np

SEED_LIMIT = 2**63
SEED_RANGE = "an integer with 0 <= seed < 2**63"

T = TypeVar("T")


_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque, array.array, str, bytes)
"""The classes `_Brief` writes a few items of, their subclasses included (a namedtuple, an OrderedDict,
a list subclass): the repr a subclass inherits or writes itself may run as long as the value is, or
without end where it shares its parts. A subclass that writes itself is written as its class name
around its items (a namedtuple as its repr writes it: `Point(x=1, y=2)`)."""


_BY_NAME = frozenset((*_CONTAINERS, int, float, bool, type(None)))
"""The classes `_Brief` writes by the method named after the class (`repr_dict`), as `reprlib` picks it:
these exactly. reprlib picks by `type(x).__name__`, so any other class (one a user named `dict`, which
has no `items`, or `NoneType`) would reach a method written for another and raise or be misquoted."""


_ITEMS = 12
"""The items of a list or tuple, or the fields of a dataclass, a quote writes before "..."."""


class _Brief(reprlib.Repr):
    """A repr a few levels deep and a few items wide, for a value an error message quotes: an argument
    a check refuses, or a value someone else sent (an HTTP body, a message on a control channel). It
    may be megabytes long, nest without end (a full repr raised RecursionError), share its parts (a
    pickle of a few hundred bytes whose full repr never ends) or hold an int too long for `repr`
    (ValueError). `as_json`: written as JSON writes it (null, true, "text", NaN), for a value that
    came as JSON; else as Python writes it."""

    def __init__(self, as_json: bool) -> None:
        super().__init__()
        self.as_json = as_json
        self.maxlevel, self.maxtuple, self.maxlist, self.maxstring, self.maxother = 4, _ITEMS, _ITEMS, 80, 80
        self._open: set[int] = set()            # the dataclasses being written, by id

    def repr1(self, x: Any, level: int) -> str:
        if type(x) in _BY_NAME:
            return super().repr1(x, level)
        base = next((b for b in type(x).__mro__ if b in _CONTAINERS), None)
        if base is None:                        # (not by its name: a class of its own may be called `dict`)
            return self.repr_instance(x, level)
        inside = getattr(self, f"repr_{base.__name__}")
        if type(x).__repr__ is base.__repr__:
            return inside(x, level)
        if base in (str, bytes):                # (text that writes itself, as a str-valued Enum does)
            return self.repr_instance(x, level)
        fields = getattr(type(x), "_fields", None)
        if base is tuple and isinstance(fields, tuple) and len(fields) == len(x):
            return f"{type(x).__name__}({self._fields(zip(fields, x), len(x), level)})"
        return f"{type(x).__name__}({inside(x, level)})"

    def _fields(self, named: Iterable[tuple[str, Any]], n: int, level: int) -> str:
        """The `n` (name, value) pairs of `named` as a namedtuple's or a dataclass's repr writes them
        (`x=1, y=2`), a few at most, each value a level deeper."""
        if level <= 0:
            return self.fillvalue if n else ""
        pairs = [f"{f}={self.repr1(v, level - 1)}" for f, v in islice(named, self.maxtuple)]
        return ", ".join(pairs + [self.fillvalue] * (n > self.maxtuple))

    def repr_instance(self, x: Any, level: int) -> str:
        """An object of no container class: a dataclass whose repr is the one `dataclass` writes is
        written by its fields, as that repr writes them, a few levels deep (its own repr writes every
        item of a field holding a million); another as its own repr writes it (as quick as that repr
        is), cut to `maxother`, and `<ClassName object>` where that repr raises."""
        fields = _dataclass_repr_fields(type(x))
        try:
            if fields is None:
                s = repr(x)
            elif id(x) in self._open:           # (itself inside itself: "...", as its own repr writes it)
                return "..."
            else:
                return self._dataclass(x, fields, level)
        except Exception:
            return f"<{type(x).__name__} object>"
        if len(s) > self.maxother:
            i = max(0, (self.maxother - 3) // 2)
            s = s[:i] + self.fillvalue + s[len(s) - (self.maxother - 3 - i):]
        return s

    def _dataclass(self, x: Any, fields: tuple[str, ...], level: int) -> str:
        self._open.add(id(x))
        try:
            inside = self._fields(((f, getattr(x, f)) for f in fields), len(fields), level)
        finally:
            self._open.discard(id(x))
        return f"{type(x).__qualname__}({inside})"

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:                # (also past Python's limit on digits written out)
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return repr(x)                          # (whole: reprlib cuts one past 40 digits in its middle)

    def repr_str(self, x: str, level: int) -> str:
        if not self.as_json:
            return super().repr_str(x, level)
        return json.dumps(x) if len(x) <= self.maxstring else json.dumps(x[:self.maxstring])[:-1] + '..."'

    def repr_float(self, x: float, level: int) -> str:
        return json.dumps(x) if self.as_json else repr(x)     # (JSON's NaN, Infinity; Python's nan, inf)

    def repr_bool(self, x: bool, level: int) -> str:
        return ("true" if x else "false") if self.as_json else repr(x)

    def repr_NoneType(self, x: None, level: int) -> str:
        return "null" if self.as_json else "None"

    def repr_bytes(self, x: bytes, level: int) -> str:
        return super().repr_str(x, level)       # (cut as a str is; reprlib would write all of it)

    # A dict or a set in its own order, as Python writes it: reprlib sorts it first, reading every item.
    def repr_dict(self, x: dict, level: int) -> str:
        if not x or level <= 0:
            return "{...}" if x else "{}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in islice(x.items(), self.maxdict)]
        return "{" + ", ".join(items + [self.fillvalue] * (len(x) > self.maxdict)) + "}"

    def repr_set(self, x: set, level: int) -> str:
        return self._repr_iterable(x, level, "{", "}", self.maxset) if x else "set()"

    def repr_frozenset(self, x: frozenset, level: int) -> str:
        return self._repr_iterable(x, level, "frozenset({", "})", self.maxfrozenset) if x else "frozenset()"


def _dataclass_repr_fields(cls: type) -> tuple[str, ...] | None:
    """The fields the repr of a `cls` writes, where that repr is the one `dataclass` generated (a
    function it compiled, wrapped against recursion); None for any other repr."""
    owner = next((c for c in cls.__mro__ if "__repr__" in c.__dict__), object)
    params = owner.__dict__.get("__dataclass_params__")
    made = getattr(getattr(owner.__dict__["__repr__"], "__wrapped__", None), "__code__", None)
    if params is None or not params.repr or made is None or made.co_filename != "<string>":
        return None
    return tuple(f.name for f in dataclasses.fields(owner) if f.repr)


_NUMBER_CHARS = frozenset("0123456789.eE+-")
"""What a number's text is made of (12, -0.5, 1e-07): `brief` cuts a quote before a number it would
split, at a digit, a point or an exponent alike (10.333 cut to "10..." would read as 10)."""


def brief(value: Any, limit: int = 100, *, as_json: bool = False) -> str:
    """`value` for an error message, in bounded time and at most `limit` characters (`_Brief`):
    as Python writes it, or with `as_json` as JSON writes it. A number is quoted whole or not at all:
    cut at its last digits, 12345678 would read as 12345... (a smaller number, and more after it)."""
    s = _Brief(as_json).repr(value)
    if len(s) <= limit:
        return s
    cut = start = end = limit - 3
    while start > 0 and s[start - 1] in _NUMBER_CHARS:
        start -= 1
    while end < len(s) and s[end] in _NUMBER_CHARS:
        end += 1
    in_word = start > 0 and (s[start - 1].isalnum() or s[start - 1] == "_")    # (text: 'v1.2', 'x_10')
    if start < cut < end and not in_word and any(c.isdigit() for c in s[start:end]):
        cut = start
    return s[:cut] + "..."


PATH_MAX = 4096
"""The longest path, in bytes, Linux takes: `quoted_path` quotes one up to that long whole."""


def quoted_path(path: Any) -> str:
    """A file path for an error message, quoted whole (a reader needs all of it to find the file),
    unless it is longer than any path the file system takes (`PATH_MAX`): then as `brief` quotes text."""
    s = str(path)
    return repr(s) if len(s) <= PATH_MAX else brief(s)


GOT_LIMIT = 200
"""At most this many characters of a value a check refuses are quoted (`brief`): a list of ten million
items, a nest deeper than repr can go or an int too long for repr is said in a line."""


def brief_items(items: Sequence[Any]) -> str:
    """`items` each quoted by `brief`, joined by ", " (`'a', 'b'`), as many as fit in about `GOT_LIMIT`
    characters (the first always, at most 12), then "..." where some are left out."""
    shown: list[str] = []
    for x in items[:_ITEMS]:
        quoted = brief(x)
        if shown and len(", ".join([*shown, quoted, "..."])) > GOT_LIMIT:
            break
        shown.append(quoted)
    return ", ".join(shown + ["..."] * (len(items) > len(shown)))


def _got(v: object) -> str:
    if isinstance(v, (bool, np.bool_)):
        return f"{bool(v)!r} (a bool)"
    if isinstance(v, (np.integer, np.floating)):
        return f"{brief(v.item(), GOT_LIMIT)} ({type(v).__name__})"
    if isinstance(v, (int, float)) or v is None:
        return brief(v, GOT_LIMIT)
    return f"{brief(v, GOT_LIMIT)} ({type(v).__name__})"


NOT_NUMBERS = (bool, np.bool_, np.timedelta64)
"""Registered as numbers but none: True is not a count, and numpy files a duration (timedelta64)
under its integers although it compares with no plain number."""


def is_int(v: object) -> bool:
    """True for a Python or numpy integer, False for a bool, a duration, a float or anything else."""
    return isinstance(v, numbers.Integral) and not isinstance(v, NOT_NUMBERS)


def is_real(v: object) -> bool:
    """True for a Python or numpy integer or float, False for a bool, a duration or anything else."""
    return isinstance(v, numbers.Real) and not isinstance(v, NOT_NUMBERS)


def _plain(v: Any) -> Any:
    """A numpy number as the Python one of the same value, so that comparing it with a bound is done
    in Python: np.float16(65504) <= 1e12 would cast the bound to float16 (overflow, a warning)."""
    return v.item() if isinstance(v, np.generic) else v


def is_finite_real(v: object) -> bool:
    """True for a finite real number that is not a bool (10**400, an int no float holds, is not finite)."""
    if not is_real(v):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _num(v: float) -> str:
    """A bound as the caller would write it: 2**40 (not 1.09951e+12), 1024, 0.5."""
    if isinstance(v, int):
        return f"2**{v.bit_length() - 1}" if v >= 2**20 and v & (v - 1) == 0 else str(v)
    return f"{v:g}"


def _range(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_num(hi)}"
    return ""


def check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """`v` as an `int`, if it is an integer in [lo, hi] (either bound may be None)."""
    if is_int(v) and (lo is None or _plain(v) >= lo) and (hi is None or _plain(v) <= hi):
        return int(v)
    bounds = _range(lo, hi, False, False)
    raise ValueError(f"{name} must be an integer{' ' + bounds if bounds else ''}, got {_got(v)}")


def check_real(name: str, v: Any, lo: float | None = None, hi: float | None = None, *,
               lo_open: bool = False, hi_open: bool = False, allow_inf: bool = False, unit: str = "") -> float:
    """`v` as a `float`, if it is a real number in the range given (`lo_open`: `lo` excluded).

    `unit` is said in the message ("a finite number of seconds > 0").
    """
    ok = is_finite_real(v) or (allow_inf and is_real(v) and v in (math.inf, -math.inf))
    x = _plain(v)
    if ok and lo is not None:
        ok = x > lo if lo_open else x >= lo
    if ok and hi is not None:
        ok = x < hi if hi_open else x <= hi
    if ok:
        return float(v)
    what = "a number" if allow_inf else "a finite number"
    if unit:
        what += f" of {unit}"
    bounds = _range(lo, hi, lo_open, hi_open)
    raise ValueError(f"{name} must be {what}{' ' + bounds if bounds else ''}, got {_got(v)}")


def check_probability(name: str, v: Any, *, lo_open: bool = False, hi_open: bool = False) -> float:
    """`v` as a `float` in [0, 1] (an end excluded when asked)."""
    return check_real(name, v, 0.0, 1.0, lo_open=lo_open, hi_open=hi_open)


def check_seed(seed: Any, name: str = "seed") -> int:
    """A seed as a plain `int`: an integer with 0 <= seed < 2**63 (see the module docstring)."""
    if is_int(seed) and 0 <= seed < SEED_LIMIT:
        return int(seed)
    raise ValueError(f"{name} must be {SEED_RANGE.replace('seed', name, 1)}, got {_got(seed)}")


def req_id_problem(req_id: Any) -> str | None:
    """Why `req_id` cannot name a request (None: it can): the engine, the results and the K/V stores
    key requests by it, so it must be hashable and equal to itself (NaN is hashable but equals
    nothing, itself included)."""
    try:
        hash(req_id)
        usable = bool(req_id == req_id)
    except (TypeError, ValueError):
        usable = False
    if usable:
        return None
    return (f"req_id must be hashable and equal to itself (an int, a str, a tuple, ...), "
            f"got {brief(req_id)} ({type(req_id).__name__})")


def check_req_id(req_id: Any) -> Any:
    """`req_id` itself, if it can name a request (`req_id_problem`); else ValueError saying why."""
    why = req_id_problem(req_id)
    if why:
        raise ValueError(why)
    return req_id


def derived_seed(seed: int) -> int:
    """The seed of a second random stream drawn from `seed`: `seed + 1`, wrapped into the seed range,
    so that the largest seed a caller may give still derives one the rule accepts (`seed` is one
    already checked)."""
    return (seed + 1) % SEED_LIMIT


def check_choice(name: str, v: T, choices: Iterable[T]) -> T:
    """The one of `choices` that `v` equals (a numpy string or a 0-d array gives the plain choice; an
    array of names is no name, even of one: `==` would compare it element by element)."""
    choices = tuple(choices)
    if not isinstance(v, (bool, np.bool_)) and np.ndim(v) == 0:
        for c in choices:
            try:
                if v == c:
                    return c
            except TypeError:               # incomparable
                break
    shown = brief(v, GOT_LIMIT) if isinstance(v, str) else _got(v)
    raise ValueError(f"unknown {name} {shown}; choose one of {', '.join(repr(c) for c in choices)}")


def check_flag(name: str, v: Any) -> bool:
    """`v` as a `bool`, if it is True or False (a numpy bool too); 0, 1 or "yes" are not flags."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise ValueError(f"{name} must be True or False, got {_got(v)}")


def check_device(device: Any, name: str = "device") -> str:
    """A torch device string that this machine has: 'cpu', 'cuda' or 'cuda:N' (N < device count), or
    'mps' on a Mac that has it (the torch model runs anywhere torch does; the project checks CPU and CUDA)."""
    import torch

    text = str(device) if isinstance(device, torch.device) else device
    why = (_device_problem(text, name) if isinstance(text, str)
           else f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {_got(device)}")
    if why:
        raise ValueError(why)
    return text


def _device_problem(text: str, name: str) -> str | None:
    """What keeps device string `text` from naming a device this machine has (None: nothing)."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        return f"unknown {name} {brief(text)}; allowed: cpu, cuda or cuda:N"
    if dev.type not in ("cpu", "cuda", "mps"):
        return f"{name} type {dev.type!r} is not supported here; allowed: cpu, cuda or cuda:N (mps on a Mac)"
    if dev.type == "mps" and not torch.backends.mps.is_available():
        return f"{name}={brief(text)} asked for, but torch.backends.mps.is_available() is False; use 'cpu'"
    n = torch.cuda.device_count() if dev.type == "cuda" and torch.cuda.is_available() else 0
    if dev.type == "cuda" and n == 0:
        return f"{name}={brief(text)} asked for, but torch.cuda.is_available() is False; use 'cpu'"
    if dev.type == "cuda" and dev.index is not None and dev.index >= n:
        return f"{name}={brief(text)} asked for, but this machine has {n} CUDA device(s)"
    return None


def same_device(asked: str, actual: Any) -> bool:
    """Whether `actual` (a `torch.device`) is one that device string `asked` names: 'cuda' without an
    index names any CUDA device, as a model built on 'cuda' lives on 'cuda:0' (two torch.devices that
    differ only there compare unequal)."""
    import torch

    want = torch.device(asked)
    return want.type == actual.type and want.index in (None, actual.index)


def from_outside(cls: type) -> bool:
    """Whether `cls` is defined outside the project: its code is checked where it is used, the
    project's own is tested instead."""
    return not cls.__module__.startswith("orca_torch.")


def check_instance(name: str, v: Any, cls: type | tuple[type, ...], *, allow_none: bool = False) -> Any:
    """`v` itself, if it is an instance of `cls` (or None when `allow_none`)."""
    if (allow_none and v is None) or isinstance(v, cls):
        return v
    want = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
    article = "an" if want[0].lower() in "aeiou" else "a"
    raise ValueError(f"{name} must be {article} {want}{' or None' if allow_none else ''}, got {_got(v)}")


def check_callable(name: str, v: Any, signature: str, *, allow_none: bool = False) -> Any:
    """`v` itself, if it is None when `allow_none`, or can be called with as many arguments as
    `signature` lists in its first parentheses ("(rate, attainment) -> None": two), so that a
    function of the wrong arity is refused here rather than when it is first called, a run later
    (a callable whose signature Python cannot inspect is taken on trust)."""
    if allow_none and v is None:
        return v
    what = f"{name} must be a function {signature}{' or None' if allow_none else ''}"
    if not callable(v):
        raise ValueError(f"{what}, got {_got(v)}")
    n = len([p for p in signature[1:signature.index(")")].split(",") if p.strip()])
    try:
        params = inspect.signature(v)
    except (TypeError, ValueError):
        return v
    try:
        params.bind(*range(n))
    except TypeError:
        shown = brief(getattr(v, "__name__", v))
        raise ValueError(f"{what}, called with {n} argument{'' if n == 1 else 's'}; got {shown}"
                         f"{params}, which cannot take {'it' if n == 1 else 'them'}") from None
    return v


def check_list(name: str, v: Any, what: str, item: type | None = None) -> list:
    """`v`'s items as a new list, if `v` is a list, tuple, range, 1-D array, set or other iterable that
    is not a string, bytes, a mapping or one `item` (`what` names the items in the message; the caller
    checks them). A generator is read once, here: use the list returned."""
    if v is None or isinstance(v, (str, bytes, Mapping)) or not isinstance(v, Iterable) or \
            (isinstance(v, np.ndarray) and v.ndim != 1) or (item is not None and isinstance(v, item)):
        raise ValueError(f"{name} must be a list of {what}, got {_got(v)}")
    return list(v)


def check_items(name: str, v: Any, cls: type) -> list:
    """A list of `v`'s items, if `v` is a list, tuple or other iterable (not a string) of `cls` objects."""
    items = check_list(name, v, f"{cls.__name__} objects", cls)
    bad = next((i for i, x in enumerate(items) if not isinstance(x, cls)), None)
    if bad is not None:
        raise ValueError(f"{name} must hold {cls.__name__} objects only; item {bad} is {_got(items[bad])}")
    return items


def available_memory_bytes() -> int | None:
    """Memory a new allocation can take now: /proc/meminfo's MemAvailable, else free physical
    pages (os.sysconf); None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: float) -> str:
    try:
        return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.0f} MB"
    except OverflowError:                       # an int past the largest float
        return f"{decimal.Decimal(n) / 10**9:.3E} GB"


def check_fits_in_memory(what: str, need_bytes: float, available: int | None = None) -> None:
    """Raise ValueError, saying how much is needed and how much there is, if `need_bytes` do not fit
    in the available memory (`available_memory_bytes()` unless given; unknown: no check)."""
    have = available_memory_bytes() if available is None else available
    if have is not None and need_bytes > have:
        raise ValueError(f"{what} needs {_gb(need_bytes)} of memory, but only {_gb(have)} is available here")
