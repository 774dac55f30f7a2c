"""A GPU profile: one card's `GPUSpec` and refined-model constants as a small JSON file.

`orca_torch.calibrate.fit_refined` writes one from timed steps (this CPU, or CUDA events on a GPU);
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

from .gpus import GPUSpec
from .refined_params import RefinedParams

FORMAT, VERSION = "orca-torch-gpu-profile", 1


def profile_dict(gpu: GPUSpec, notes: dict | None = None) -> dict:
    """The JSON-ready form of `gpu` (and its refined parameters), with optional `notes`."""
    if not isinstance(gpu, GPUSpec):
        raise ValueError(f"gpu must be a GPUSpec, got {type(gpu).__name__}")
    spec = {k: v for k, v in asdict(gpu).items() if k != "refined"}
    return {"format": FORMAT, "version": VERSION, "gpu": spec, "refined": gpu.refined.to_dict(),
            "notes": dict(notes or {})}


def save_profile(gpu: GPUSpec, path: str | os.PathLike, notes: dict | None = None) -> Path:
    """Write `gpu` as a JSON profile at `path` (a `.json` name); returns the path."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        raise ValueError(f"a GPU profile is a .json file, got {str(path)!r}")
    d = profile_dict(gpu, notes)
    text = json.dumps(d, indent=2, allow_nan=False)  # a NaN in a profile is a bug: refuse to write it
    path.write_text(text + "\n")
    return path


def spec_from_dict(d: dict, where: str = "profile") -> GPUSpec:
    """The inverse of `profile_dict`: a `GPUSpec` with its `RefinedParams`, every field checked."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{where} is not an orca-torch GPU profile (needs \"format\": \"{FORMAT}\")")
    if d.get("version") != VERSION:
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
            raise ValueError(f"{where}: gpu.{k} must be finite, got {v!r}")
    try:
        refined = RefinedParams.from_dict(d.get("refined", {}))
        return GPUSpec(**spec, refined=refined)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def load_profile(path: str | os.PathLike) -> GPUSpec:
    """Read a JSON GPU profile (see `save_profile`)."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"no GPU profile at {str(p)!r}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the GPU profile {str(p)!r}: {e}") from None
    return spec_from_dict(d, where=repr(str(p)))
