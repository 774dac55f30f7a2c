"""A GPU profile: one card's `GPUSpec` and refined-model constants as a small JSON file.

`orca_torch.lab.calibrate.fit_refined` writes one from timed steps (this CPU, or CUDA events on a GPU);
`get_gpu("path/to/profile.json")` and so `pricer(model, "path/to/profile.json", cost_model=...)`
read it back. The file says what it is (`format`, `version`), the spec, the refined parameters,
and free-form notes on where the numbers came from (`fitted`: model, samples, errors).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, fields
from pathlib import Path

from orca_torch.checks import check_instance, is_int
from orca_torch.sim.hw_model.gpus import GPUSpec
from orca_torch.sim.hw_model.refined_params import RefinedParams

FORMAT, VERSION = "orca-torch-gpu-profile", 1


def profile_dict(gpu: GPUSpec, notes: dict | None = None) -> dict:
    """The JSON-ready form of `gpu` (and its refined parameters), with optional `notes`."""
    if not isinstance(gpu, GPUSpec):
        raise ValueError(f"gpu must be a GPUSpec, got {type(gpu).__name__}")
    check_instance("notes", notes, dict, allow_none=True)
    spec = {k: v for k, v in asdict(gpu).items() if k != "refined"}
    return {"format": FORMAT, "version": VERSION, "gpu": spec, "refined": gpu.refined.to_dict(),
            "notes": dict(notes or {})}


def _path(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file name (a str or a path), got {path!r} ({type(path).__name__})")
    return Path(path)


def save_profile(gpu: GPUSpec, path: str | os.PathLike, notes: dict | None = None) -> Path:
    """Write `gpu` as a JSON profile at `path` (a `.json` name); returns the path."""
    path = _path(path)
    if path.suffix.lower() != ".json":
        raise ValueError(f"a GPU profile is a .json file, got {str(path)!r}")
    d = profile_dict(gpu, notes)
    try:  # a NaN in a profile is a bug: refuse to write it
        text = json.dumps(d, indent=2, allow_nan=False)
    except (TypeError, ValueError) as e:  # the spec is checked, so the notes hold it
        raise ValueError(f"notes must hold finite JSON values (str keys; dicts, lists, str, numbers, bools, "
                         f"None): {e}") from None
    try:
        path.write_text(text + "\n")
    except OSError as e:
        raise ValueError(f"cannot write the GPU profile {str(path)!r}: {e.strerror or e}") from None
    return path


def spec_from_dict(d: dict, where: str = "profile") -> GPUSpec:
    """The inverse of `profile_dict`: a `GPUSpec` with its `RefinedParams`, every field checked."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{where} is not an orca-torch GPU profile (needs \"format\": \"{FORMAT}\")")
    if not (is_int(d.get("version")) and d["version"] == VERSION):
        raise ValueError(f"{where}: profile version {d.get('version')!r} is not supported (this code reads {VERSION})")
    spec = d.get("gpu")
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: \"gpu\" must be an object of GPUSpec fields")
    known = {f.name for f in fields(GPUSpec)} - {"refined"}
    extra, missing = sorted(set(spec) - known), sorted({"name", "peak_flops", "mem_bw", "mem_bytes"} - set(spec))
    if extra or missing:
        raise ValueError(f"{where}: bad GPUSpec fields (unknown: {extra or 'none'}, missing: {missing or 'none'})")
    for k, v in spec.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{where}: gpu.{k} must be finite, got {v!r}"
                             + (" (a number past the largest float)" if math.isinf(v) else ""))
    try:
        refined = RefinedParams.from_dict(d.get("refined", {}))
        return GPUSpec(**spec, refined=refined)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _parse_int(s: str) -> int | float:
    """A JSON integer as an `int`, unless it is longer than any GPU figure (and than Python's 4,300-digit
    parsing limit): that one reads as the float it overflows to, which the field's check refuses by name."""
    return int(s) if len(s) <= 400 else float(s)


def load_profile(path: str | os.PathLike) -> GPUSpec:
    """Read a JSON GPU profile (see `save_profile`)."""
    p = _path(path)
    try:
        d = json.loads(p.read_text(encoding="utf-8"), parse_int=_parse_int)
    except FileNotFoundError:
        raise ValueError(f"no GPU profile at {str(p)!r}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"cannot read the GPU profile {str(p)!r}: not UTF-8 text (byte {e.object[e.start]:#04x} "
                         f"at offset {e.start})") from None
    except OSError as e:
        raise ValueError(f"cannot read the GPU profile {str(p)!r}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # not JSON, or nested past Python's stack
        raise ValueError(f"cannot read the GPU profile {str(p)!r}: not JSON ({e})") from None
    return spec_from_dict(d, where=repr(str(p)))
