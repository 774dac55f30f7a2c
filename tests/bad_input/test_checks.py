"""The one validation helper every module uses: numpy numbers in, bools out, messages that say
which parameter, what range, and what was given."""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import NamedTuple

import numpy as np
import pytest
import torch

from orca_torch.checks import (SEED_LIMIT, brief, brief_items, check_callable, check_choice, check_device, check_flag,
    check_instance, check_int, check_items, check_probability, check_real, check_seed, derived_seed,
    is_finite_real)


@pytest.mark.parametrize("v", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_integers_python_or_numpy_come_back_as_int(v):
    out = check_int("n", v, 1, 5)
    assert out == 3 and type(out) is int


@pytest.mark.parametrize("v, says", [(True, "got True (a bool)"), (np.bool_(False), "(a bool)"),
                                     (3.0, "got 3.0"), (np.float64(3), "got 3.0"), ("3", "(str)"),
                                     (None, "got None"), (0, "got 0"), (6, "got 6")])
def test_integers_refuse_bools_floats_and_out_of_range(v, says):
    with pytest.raises(ValueError) as e:
        check_int("n_things", v, 1, 5)
    assert str(e.value).startswith("n_things must be an integer in [1, 5], got") and says in str(e.value)
    with pytest.raises(ValueError, match=r"^k must be an integer >= 0, got -1$"):
        check_int("k", -1, 0)


def test_real_numbers_bounds_units_and_infinity():
    assert check_real("r", np.int64(8), 0.0, lo_open=True) == 8.0
    assert type(check_real("r", np.float32(0.5))) is float
    for bad in (0, True, math.nan, math.inf, "1"):
        with pytest.raises(ValueError, match=r"rate must be a finite number of requests per second > 0"):
            check_real("rate", bad, 0.0, lo_open=True, unit="requests per second")
    assert check_real("slo", math.inf, 0.0, lo_open=True, allow_inf=True) == math.inf
    with pytest.raises(ValueError, match=r"slo must be a number > 0, got nan"):
        check_real("slo", math.nan, 0.0, lo_open=True, allow_inf=True)
    with pytest.raises(ValueError, match=r"x must be a finite number in \[0, 1\), got 1"):
        check_real("x", 1, 0, 1, hi_open=True)
    for huge in (10**400, -10**400):                            # ints no float holds: not finite, no OverflowError
        assert not is_finite_real(huge)
        with pytest.raises(ValueError, match="x must be a finite number, got"):
            check_real("x", huge)
        with pytest.raises(ValueError, match="x must be a number, got"):
            check_real("x", huge, allow_inf=True)
    assert is_finite_real(np.float32(1.5)) and not is_finite_real(True) and not is_finite_real(np.float64("nan"))
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 2\*\*40\], got 0"):   # bounds as written
        check_int("n", 0, 1, 2**40)
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 1000\], got 0"):
        check_int("n", 0, 1, 1000)


def test_probabilities():
    assert check_probability("p", np.float64(0.25)) == 0.25 and check_probability("p", 1) == 1.0
    for bad in (-0.1, 1.1, True, math.nan):
        with pytest.raises(ValueError, match=r"p must be a finite number in \[0, 1\]"):
            check_probability("p", bad)
    with pytest.raises(ValueError, match=r"^q must be a finite number in \(0, 1\), got 0.0$"):
        check_probability("q", 0.0, lo_open=True, hi_open=True)


def test_the_seed_rule_is_what_numpy_and_torch_both_take():
    top = SEED_LIMIT - 1
    assert check_seed(np.uint64(top)) == top and check_seed(0) == 0
    np.random.default_rng(top)
    torch.Generator().manual_seed(top)
    assert derived_seed(top) == 0 and derived_seed(5) == 6   # wraps into the rule
    for bad in (-1, SEED_LIMIT, 2**64, 1.5, True, None, "3"):
        with pytest.raises(ValueError, match=r"seed must be an integer with 0 <= seed < 2\*\*63, got"):
            check_seed(bad)
    with pytest.raises(ValueError, match=r"rng must be an integer with 0 <= rng < 2\*\*63"):
        check_seed(-1, "rng")


def test_choices_devices_instances_and_lists():
    assert check_choice("order", "spf", ("fcfs", "spf")) == "spf"
    for same in (np.str_("spf"), np.array("spf")):
        assert type(check_choice("order", same, ("fcfs", "spf"))) is str
    for bad in ("FCFS", None, ["fcfs"], True, np.array(["fcfs", "spf"]), np.array(["spf"] * 2), np.array(["spf"])):
        with pytest.raises(ValueError, match=r"unknown order .*; choose one of 'fcfs', 'spf'"):
            check_choice("order", bad, ("fcfs", "spf"))
    assert check_flag("trace", np.bool_(True)) is True and check_flag("trace", False) is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(ValueError, match="trace must be True or False, got"):
            check_flag("trace", bad)
    assert check_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="unknown device 'nope'; allowed: cpu, cuda or cuda:N"):
        check_device("nope")
    with pytest.raises(ValueError, match="device type 'meta' is not supported"):
        check_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=re.escape("device='cuda' asked for, but torch.cuda.is_available() is "
                                                       "False; use 'cpu'")):
            check_device("cuda")
    with pytest.raises(ValueError, match="executor must be a dict, got None"):
        check_instance("executor", None, dict)
    assert check_instance("config", None, dict, allow_none=True) is None
    with pytest.raises(ValueError, match="executor must be an int or dict, got 'x'"):
        check_instance("executor", "x", (int, dict))
    assert check_items("requests", (1, 2), int) == [1, 2]
    assert check_callable("f", len, "(x)") is len and check_callable("f", None, "(x)", allow_none=True) is None
    with pytest.raises(ValueError, match=r"f must be a function \(x\), got 'len' \(str\)"):
        check_callable("f", "len", "(x)")
    f = lambda rate, attainment: None     # noqa: E731
    assert check_callable("on_rate", f, "(rate, attainment) -> None") is f
    for wrong in (lambda: None, lambda rate: None, lambda a, b, c: None):
        with pytest.raises(ValueError, match=r"on_rate must be a function \(rate, attainment\) -> None, called with "
                                             r"2 arguments; got '<lambda>'\(.*\), which cannot take them"):
            check_callable("on_rate", wrong, "(rate, attainment) -> None")
    assert check_callable("f", print, "(x)") is print    # (no signature to inspect: taken on trust)
    tick = lambda: None     # noqa: E731
    assert check_callable("tick", tick, "() -> None") is tick
    with pytest.raises(ValueError, match=r"tick must be a function \(\) -> None, called with 0 arguments; "
                                         r"got '<lambda>'\(x\), which cannot take them"):
        check_callable("tick", lambda x: None, "() -> None")
    a_list = "requests must be a list of int objects, got "
    for bad, says in ((None, a_list + "None"), ("ab", a_list + "'ab' (str)"), (5, a_list + "5"),
                      ([1, "x"], "requests must hold int objects only; item 1 is 'x' (str)")):
        with pytest.raises(ValueError) as e:
            check_items("requests", bad, int)
        assert str(e.value) == says


def test_a_value_of_any_size_is_quoted_in_a_line():
    """What a check refuses is quoted as Python writes it, cut to a line: a list of a million items after
    a dozen, a nest 100,000 deep after four levels (its whole repr raised RecursionError, not the
    refusal), an int of 100,001 digits by its length (repr raises ValueError past 4,300 digits), a
    string of a million characters in the middle; a small value as repr writes it, a dict in its order."""
    nested: dict = {}
    for _ in range(100_000):
        nested = {"k": nested}
    for v, got in (([7] * 10**6, "[7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, ...] (list)"),
                   (nested, "{'k': {'k': {'k': {'k': {...}}}}} (dict)"),
                   (10**100_000, "<an integer of about 100001 digits>"),
                   (np.int64(9), "9 (int64)"),
                   ("x" * 10**6, f"'{'x' * 37}...{'x' * 38}' (str)"),
                   ({"b": 1, "a": [2, None]}, "{'b': 1, 'a': [2, None]} (dict)"),
                   ((1.5, "x"), "(1.5, 'x') (tuple)")):
        with pytest.raises(ValueError) as e:
            check_int("n", v, 1, 5)
        assert str(e.value) == f"n must be an integer in [1, 5], got {got}"
        with pytest.raises(ValueError) as e:
            check_flag("trace", v)
        assert str(e.value) == f"trace must be True or False, got {got}"
    with pytest.raises(ValueError) as e:
        check_seed(10**5000)
    assert str(e.value) == "seed must be an integer with 0 <= seed < 2**63, got <an integer of about 5001 digits>"
    for check, says in ((lambda s: check_choice("order", s, ("fcfs", "spf")), "unknown order "),
                        (check_device, "unknown device ")):
        with pytest.raises(ValueError) as e:
            check("x" * 10**6)
        assert str(e.value).startswith(says + f"'{'x' * 37}...{'x' * 38}'") and len(str(e.value)) < 200


class _Items(list):
    pass


class _Keyed(dict):
    pass


class _Pair(NamedTuple):
    left: object
    right: object


@pytest.mark.timeout(20)
def test_a_subclass_of_a_container_is_quoted_in_a_line_however_large():
    """A list or dict subclass, a namedtuple or an OrderedDict is written a few items deep and wide, as its
    base class is: their own repr writes every item (a million here), or never ends where the value
    shares its parts (a pair of pairs of ... 100 deep: 2**100 leaves). A small one reads as its repr."""
    shared: object = 0
    for _ in range(100):
        shared = _Pair(_Items([shared]), _Keyed(k=shared))
    for v, got in ((_Items(range(10**6)), "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...] (_Items)"),
                   (_Keyed.fromkeys(range(10**6), 0), "{0: 0, 1: 0, 2: 0, 3: 0, ...} (_Keyed)"),
                   (collections.OrderedDict.fromkeys(range(10**6), 0),
                    "OrderedDict({0: 0, 1: 0, 2: 0, 3: 0, ...}) (OrderedDict)"),
                   (_Pair(_Items(range(10**6)), None),
                    "_Pair(left=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...], right=None) (_Pair)"),
                   (shared, "_Pair(left=[_Pair(left=[_Pair(...)], right={'k': _Pair(...)})], "
                            "right={'k': _Pair(left=[_Pair(...)], right={'k': _Pair(...)})}) (_Pair)")):
        with pytest.raises(ValueError) as e:
            check_int("n", v, 1, 5)
        assert str(e.value) == f"n must be an integer in [1, 5], got {got}"
    for small in (_Items([1, "a"]), _Keyed(a=[2]), _Pair(1, (2,)), collections.Counter("aab"),
                  collections.deque([1, 2])):
        assert brief(small) == repr(small)


@pytest.mark.parametrize("digits", [41, 60, 77])
def test_an_integer_is_quoted_whole_or_by_its_length_never_cut(digits):
    """An int a check refuses is written whole up to 77 digits (2**256), past that by its number of
    digits: cut in its middle (1234...789) it would read as another number. A list of them is cut
    between its items, never inside one."""
    big = int("9" * digits)
    with pytest.raises(ValueError) as e:
        check_int("n", big, 1, 5)
    assert str(e.value) == f"n must be an integer in [1, 5], got {big}"
    with pytest.raises(ValueError) as e:
        check_int("n", -big, 1, 5)
    assert str(e.value) == f"n must be an integer in [1, 5], got {-big}"
    quoted = brief([big] * 10**6)
    assert quoted.startswith(f"[{big}, ") and quoted.endswith(", ...") and len(quoted) <= 100
    assert all(item == str(big) for item in quoted[1:-len(", ...")].split(", "))


def test_a_quote_of_numbers_is_cut_between_them_never_inside_one():
    """A list of floats (a point, an exponent, a sign) refused in a line is cut before the number the cut
    would split: 10.333 cut after its 10 would read as another number. Text is cut where it falls."""
    values = [i + 1 / 3 for i in range(12)]
    with pytest.raises(ValueError) as e:
        check_int("n", values, 1, 5)
    quoted = str(e.value).removeprefix("n must be an integer in [1, 5], got [").removesuffix(", ... (list)")
    assert [float(x) for x in quoted.split(", ")] == values[:len(quoted.split(", "))]
    for limit in range(20, 60):
        shown = brief([1.5e-07, -12.25] * 30, limit).removeprefix("[").removesuffix("...").rstrip(", ")
        assert all(x in ("1.5e-07", "-12.25") for x in shown.split(", ")), (limit, shown)
    assert brief(["release-2024-10-01"] * 10).endswith(", 'release...")


@dataclasses.dataclass
class _Node:
    left: object
    right: object = None
    hidden: object = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class _Named:
    name: str

    def __repr__(self) -> str:
        return f"<{self.name}>"


class _Child(_Node):
    pass


class _Unwritable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.timeout(20)
def test_a_dataclass_is_quoted_by_its_fields_in_a_line_however_large():
    """A dataclass whose repr is the generated one is written field by field, a few levels deep and
    wide: its own repr writes every item of a field holding a million, or never ends where its fields
    share their parts (a node of nodes of ... 100 deep: 2**100 leaves). A small one reads as its repr,
    a class that writes its own repr as it writes it."""
    shared: object = 0
    for _ in range(100):
        shared = _Node(shared, shared)
    for v, got in ((_Node(list(range(10**6))), "_Node(left=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...], right=None)"),
                   (_Child([0] * 10**6, _Node(1)), "_Child(left=[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, ...], "
                                                   "right=_Node(left=1, right=None))"),
                   (shared, "_Node(left=_Node(left=_Node(left=_Node(left=_Node(...), right=_Node(...)), right=_Node("
                            "left=_Node...")):
        assert brief(v) == got
    looped = _Node(None)
    looped.right = [looped]
    for small in (_Node(1, "a"), _Child(_Node([2]), (3,)), _Named("n"), [_Node(None)], looped):
        assert brief(small) == repr(small)


def test_an_object_whose_repr_raises_is_quoted_by_its_class_name():
    with pytest.raises(ValueError) as e:
        check_int("n", _Unwritable(), 1, 5)
    assert str(e.value) == "n must be an integer in [1, 5], got <_Unwritable object> (_Unwritable)"
    assert brief([_Unwritable(), _Node(_Unwritable())]) == ("[<_Unwritable object>, "
                                                           "_Node(left=<_Unwritable object>, right=None)]")


def _named_like(name: str) -> object:
    """An object of a class of the user's own, named like a built-in it does not subclass."""
    return type(name, (), {"__repr__": lambda self: f"<my {name}>"})()


@pytest.mark.parametrize("name", ["dict", "list", "tuple", "set", "str", "bytes", "int", "float", "bool",
                                  "NoneType", "deque", "array"])
def test_a_class_named_like_a_built_in_is_quoted_by_its_own_repr(name):
    """reprlib picks how to write a value by its class's name: a class called `dict` went to the
    method for dicts (it has no `items`: AttributeError, not the refusal), and one called `NoneType`
    or `bool` was quoted as None or True whatever it was."""
    v = _named_like(name)
    assert brief(v) == f"<my {name}>" and brief([v], as_json=True) == f"[<my {name}>]"
    with pytest.raises(ValueError) as e:
        check_int("n", v, 1, 5)
    assert str(e.value) == f"n must be an integer in [1, 5], got <my {name}> ({name})"


def test_items_are_quoted_each_in_a_line_and_a_few_of_them():
    assert brief_items(["a", 1]) == "'a', 1"
    assert brief_items(list(range(10**6))) == "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ..."
    assert brief_items(["x" * 10**6] * 10**6) == ", ".join([f"'{'x' * 37}...{'x' * 38}'"] * 2 + ["..."])
    assert brief_items(["x" * 10**6]) == f"'{'x' * 37}...{'x' * 38}'"


def test_a_path_is_quoted_whole_in_a_refusal(tmp_path):
    """A reader needs all of a path to find its file: one the file system could take is quoted whole
    (`brief` would cut text past 80 characters in its middle), one longer than any as `brief` quotes it."""
    import argparse

    from orca_torch.checks import PATH_MAX, quoted_path
    from orca_torch.lab.cli_args import json_out_arg
    from orca_torch.lab.plots import _check_figure_path

    deep = tmp_path / ("a_directory_with_a_long_name_" * 4) / "figures"
    deep.mkdir(parents=True)
    with pytest.raises(ValueError) as e:
        _check_figure_path(deep)
    assert f"path {str(deep)!r} is a directory; give a file name, e.g. {str(deep / 'figure.png')!r}" in str(e.value)
    with pytest.raises(argparse.ArgumentTypeError, match="got " + re.escape(repr(str(deep / "run.txt")))):
        json_out_arg(str(deep / "run.txt"))
    assert quoted_path("x" * PATH_MAX) == repr("x" * PATH_MAX)
    assert len(quoted_path("x" * (PATH_MAX + 1))) <= 100
