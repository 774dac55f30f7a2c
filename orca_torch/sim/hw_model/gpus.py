"""The cards the paper GPU knows (lecture §0.5 "paper GPU", §4.5): datasheet figures for
the H100, A100 and the other cards the experiments price on.

Datasheet peaks, not measurements: dense bf16/fp16 tensor-core FLOP/s (no sparsity), HBM
bandwidth, and memory in *decimal* GB as the lecture counts it (80e9 B for an "80 GB" H100; its
driver reports 81,559 MiB, 7% more, so the K/V figures here are slightly conservative). What a real
kernel reaches is the peak times an efficiency factor (`flop_efficiency`, `bw_efficiency`,
`comm_efficiency`), kept on the spec so a measured spec can say "already achieved" with 1.0.

Interconnect, per GPU and per direction (half of NVIDIA's bidirectional totals):
- NVLink 3 (A100): 12 links x 25 GB/s = 300 GB/s ("600 GB/s" bidirectional).
- NVLink 4 (H100, H200): 18 links x 25 GB/s = 450 GB/s ("900 GB/s" bidirectional).
- InfiniBand between nodes, one NIC per GPU: Orca's Azure A100 VMs have 1.6 Tb/s per 8-GPU VM
  (8 x 200 Gb/s HDR) = 25 GB/s per GPU (Orca §6); H100/H200 nodes 8 x 400 Gb/s NDR = 50 GB/s per GPU.
Latencies are NCCL small-message orders of magnitude (nccl-tests), not datasheet numbers.

Host link (GPU <-> CPU memory, what a K/V swap crosses), per direction: PCIe 4.0 x16 on the A100
(datasheet "PCIe Gen4 64 GB/s" bidirectional: 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s each way),
PCIe 5.0 x16 on the H100 and H200 (datasheets "PCIe Gen5 128 GB/s": 63 GB/s each way). The ~10 us
per transfer is a cudaMemcpyAsync launch plus DMA setup, an order of magnitude as above.

`get_gpu("cpu")` describes *this* machine from a quick measurement (fp32 matmul rate, copy
bandwidth), taken once per process: the torch presets run in fp32 on it.

A GPU profile is one card's `GPUSpec` and refined-model constants as a small JSON file:
`orca_torch.lab.calibration.refined_fit.fit_refined` writes one from timed steps (this CPU, or CUDA
events on a GPU); `get_gpu("path/to/profile.json")` and so `pricer(model, "path/to/profile.json",
cost_model=...)` read it back. The file says what it is (`format`, `version`), the spec, the refined parameters,
and free-form notes on where the numbers came from (`fitted`: model, samples, errors).
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from orca_torch.checks import brief, brief_items, check_instance, check_int, check_real, is_int, quoted_path
from orca_torch.sim.hw_model.refined_params import RefinedParams

FLOP_EFFICIENCY = 0.7
"""Share of dense peak a step's matmuls reach: large bf16 GEMMs sustain ~70% of an H100 SXM's
989 TFLOP/s in practice. The Llama-3-8B anchors are memory-bound and do not depend on it (any
value >= 0.45 leaves them unchanged); it decides prefill times and the roofline crossover."""

BW_EFFICIENCY = 0.8
"""Share of peak HBM bandwidth a decode step reaches. 0.8 is what the lecture's figures imply:
16.06 GB / (0.8 x 3.35 TB/s) = 5.99 ms ("6 ms"), 18.8 ms at batch 256 x 1K, 559 and 34 within 20 ms."""

COMM_EFFICIENCY = 0.8
"""Share of link bandwidth NCCL collectives reach (bus bandwidth ~240 of 300 GB/s on NVLink 3)."""


_REAL_FIELDS = (  # (fields, upper bound, 0 excluded, unit, None allowed): every field is a number >= 0
    (("peak_flops", "mem_bw", "mem_bytes"), None, True, "", False),
    (("nvlink_bw", "ib_bw", "host_link_bw"), None, True, "bytes/s", True),
    (("nvlink_latency_s", "ib_latency_s", "host_link_latency_s"), None, False, "seconds", False),
    (("flop_efficiency", "bw_efficiency", "comm_efficiency"), 1.0, True, "", False),
)


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: peaks, memory, links to its neighbours, and how much of each peak is reached."""

    name: str
    peak_flops: float              # dense bf16/fp16 FLOP/s (fp32 for the measured CPU)
    mem_bw: float                  # bytes/s
    mem_bytes: float               # decimal bytes
    nvlink_bw: float | None = None # bytes/s per GPU per direction, inside a node
    ib_bw: float | None = None     # bytes/s per GPU per direction, between nodes
    gpus_per_node: int = 1
    nvlink_latency_s: float = 10e-6
    ib_latency_s: float = 15e-6
    host_link_bw: float | None = None  # bytes/s per direction between the card and host memory
    host_link_latency_s: float = 10e-6
    flop_efficiency: float = FLOP_EFFICIENCY
    bw_efficiency: float = BW_EFFICIENCY
    comm_efficiency: float = COMM_EFFICIENCY
    source: str = ""
    refined: RefinedParams = field(default=RefinedParams(), repr=False)  # the refined cost model's constants

    def __post_init__(self) -> None:
        put = lambda f, v: object.__setattr__(self, f, v)  # noqa: E731  (frozen: store the checked value)
        for f, cls in (("name", str), ("source", str), ("refined", RefinedParams)):
            check_instance(f"GPUSpec.{f}", getattr(self, f), cls)
        for names, hi, lo_open, unit, optional in _REAL_FIELDS:
            for f in names:
                if not (optional and getattr(self, f) is None):
                    put(f, check_real(f"GPUSpec.{f}", getattr(self, f), 0.0, hi, lo_open=lo_open, unit=unit))
        put("gpus_per_node", check_int("GPUSpec.gpus_per_node", self.gpus_per_node, 1))


_NVLINK3, _NVLINK4 = 300e9, 450e9
_SMS_A100, _SMS_H100 = RefinedParams(n_sms=108), RefinedParams(n_sms=132)  # datasheet SM counts
_PCIE4_X16, _PCIE5_X16 = 16e9 * 16 * 128 / 130 / 8, 32e9 * 16 * 128 / 130 / 8
_IB_A100_AZURE, _IB_NDR = 1.6e12 / 8 / 8, 400e9 / 8

GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("h100", 989.4e12, 3.35e12, 80e9, _NVLINK4, _IB_NDR, 8, host_link_bw=_PCIE5_X16,
                    source="NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s bf16 dense, 3.35 TB/s HBM3, "
                           "80 GB, NVLink 4 900 GB/s; 8 x 400 Gb/s NDR per node", refined=_SMS_H100),
    "a100-40gb": GPUSpec("a100-40gb", 312e12, 1.555e12, 40e9, _NVLINK3, _IB_A100_AZURE, 8, host_link_bw=_PCIE4_X16,
                         source="NVIDIA A100 SXM4 40GB datasheet: 312 TFLOP/s fp16/bf16 dense, "
                                "1,555 GB/s, NVLink 3 600 GB/s; Orca's Azure VMs 1.6 Tb/s IB per 8 GPUs",
                         refined=_SMS_A100),
    "a100-80gb": GPUSpec("a100-80gb", 312e12, 2.039e12, 80e9, _NVLINK3, _IB_A100_AZURE, 8, host_link_bw=_PCIE4_X16,
                         source="NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s, 2,039 GB/s, NVLink 3 "
                                "600 GB/s; 1.6 Tb/s IB per 8 GPUs as Orca's cluster", refined=_SMS_A100),
    "h200": GPUSpec("h200", 989.4e12, 4.8e12, 141e9, _NVLINK4, _IB_NDR, 8, host_link_bw=_PCIE5_X16,
                    source="NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense (1,979 sparse), "
                           "4.8 TB/s HBM3e, 141 GB, NVLink 4 900 GB/s; 8 x 400 Gb/s NDR per node",
                    refined=_SMS_H100),
}


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch pages, thread pool start
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9  # platforms without sysconf: a nominal laptop, said so in `source`


def measure_cpu() -> GPUSpec:
    """This machine's CPU as a `GPUSpec`: best-of-5 fp32 matmul rate (512 x 512) and copy bandwidth
    (32 MiB), on the threads torch uses now.

    Rates are what torch achieves, so the efficiencies are 1.0. Measured once per process and
    thread count (about 0.1 s); timings on a shared machine are noisy, which is why nothing asserts
    on them.
    """
    import torch

    return _measure_cpu(torch.get_num_threads())


@functools.lru_cache(maxsize=8)
def _measure_cpu(threads: int) -> GPUSpec:
    import torch

    matmul_n, copy_mib, repeats = 512, 32, 5
    g = torch.Generator().manual_seed(0)
    a = torch.randn(matmul_n, matmul_n, generator=g, dtype=torch.float32)
    b = torch.randn(matmul_n, matmul_n, generator=g, dtype=torch.float32)
    mm_s = _best_seconds(lambda: torch.mm(a, b), repeats)
    src = torch.empty(copy_mib * 2**20 // 4, dtype=torch.float32).uniform_(generator=g)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), repeats)
    flops = 2 * matmul_n**3 / mm_s
    bw = 2 * src.numel() * 4 / copy_s  # a copy reads and writes every byte
    return GPUSpec("cpu", flops, bw, physical_memory_bytes(), flop_efficiency=1.0, bw_efficiency=1.0,
                   comm_efficiency=1.0,
                   source=f"measured on this machine: fp32 {matmul_n}^3 matmul {flops / 1e9:.1f} GFLOP/s, "
                          f"{copy_mib} MiB copy {bw / 1e9:.1f} GB/s, {threads} thread{'s' if threads > 1 else ''}")


def known_gpus() -> list[str]:
    return sorted(GPUS) + ["cpu"]


def card_for(device_name: str) -> str | None:
    """The datasheet card a CUDA device's name points at ("NVIDIA A100-SXM4-80GB" -> "a100-80gb"), or
    None for a card with no datasheet here: what a measurement on that device is compared with."""
    n = device_name.lower()
    if "h200" in n:
        return "h200"
    if "h100" in n:
        return "h100"
    if "a100" in n:
        return "a100-80gb" if "80" in n else "a100-40gb"
    return None


def card_key(name: str) -> str:
    """A card's name as `GPUS` keys it, in whatever case it was typed ("H200" -> "h200"): the one rule
    for every entry point that takes a card's name (`get_gpu`, a calibration's `machine`)."""
    return name.lower()


def get_gpu(name: str | GPUSpec) -> GPUSpec:
    """Look a card up by name ("h100", "a100-40gb", "a100-80gb", "h200", or "cpu" measured), or load a
    JSON GPU profile by path ("profiles/a100.json", written by `save_profile`)."""
    if isinstance(name, GPUSpec):
        return name
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    key = card_key(name) if isinstance(name, str) else None
    if key is not None and key.endswith(".json"):
        return load_profile(name)
    if key == "cpu":
        return measure_cpu()
    if key not in GPUS:
        what = f"unknown GPU {brief(name)}" if key is not None else \
            f"gpu must be a GPUSpec, a name or a profile path, got {brief(name)}"
        raise ValueError(f"{what}; known GPUs: {', '.join(known_gpus())}, or a GPU profile's .json path")
    return GPUS[key]


FORMAT, VERSION = "orca-torch-gpu-profile", 1
PROFILE_KEYS = ("format", "version", "gpu", "refined", "notes")
"""What a profile holds: a key beside these (a misspelt "refined") would be read as nothing at all."""


def _profile_dict(gpu: GPUSpec, notes: dict | None) -> dict:
    """The JSON-ready form of `gpu` (and its refined parameters), with `notes`."""
    spec = {k: v for k, v in asdict(gpu).items() if k != "refined"}
    return {"format": FORMAT, "version": VERSION, "gpu": spec, "refined": gpu.refined.to_dict(),
            "notes": dict(notes or {})}


def _path(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file name (a str or a path), got {brief(path)} ({type(path).__name__})")
    if os.fspath(path) == "":   # (Path('') is '.', the current directory: it would be named so, unsaid)
        raise ValueError("path is empty; give the GPU profile's .json file name, such as 'profile.json'")
    return Path(path)


NOTES_DEPTH = 100
"""How many levels of dicts and lists a profile's notes may nest: far more than a fit's notes need, and
well within what JSON's reader (`load_profile`) and writer take before Python's recursion limit."""


NOTES_VALUES = 10**6
"""How many values (items of the dicts and lists, as JSON writes them out) a profile's notes may hold:
far more than a fit's notes need, and a file JSON writes in seconds."""


def _keys_not_str(notes: object) -> list:
    """The dict keys in `notes` (nested in dicts and lists) that are no str, the shallowest first: JSON
    writes an int, float, bool or None key as a string, so the notes read back would not be those given.
    Read a level at a time, each dict or list once a level (no recursion, and a part shared by many is
    read once); notes nested deeper than `NOTES_DEPTH` (or holding themselves) are refused, and so are
    notes JSON would write as more than `NOTES_VALUES` values: it writes a shared part once in each place
    that holds it, so each part is counted as many times as it is held (`[a, a]` nested 60 deep is
    2**60 values, though it is 60 lists)."""
    bad: list = []
    level = {id(notes): (notes, 1)} if isinstance(notes, (dict, list, tuple)) else {}
    n_values = 0
    for _ in range(NOTES_DEPTH):
        below: dict[int, tuple[object, int]] = {}
        for x, times in level.values():
            n_values += times * len(x)
            bad += [k for k in x if not isinstance(k, str)] if isinstance(x, dict) else []
            for v in (x.values() if isinstance(x, dict) else x):
                if isinstance(v, (dict, list, tuple)):
                    below[id(v)] = (v, below.get(id(v), (v, 0))[1] + times)
        if n_values > NOTES_VALUES:
            raise ValueError(f"notes must hold at most {NOTES_VALUES:,} values as JSON writes them (a part held in "
                             f"several places is written in each), got more than {NOTES_VALUES:,} within "
                             f"{_ + 1} levels; share less, or keep the notes short")
        level = below
    if level:
        raise ValueError(f"notes must nest at most {NOTES_DEPTH} levels of dicts and lists (JSON's reader takes "
                         "back no deep nest); these nest deeper, or hold themselves")
    return bad


def save_profile(gpu: GPUSpec, path: str | os.PathLike, notes: dict | None = None) -> Path:
    """Write `gpu` (a `GPUSpec`) as a JSON profile at `path` (a `.json` name); returns the path."""
    check_instance("gpu", gpu, GPUSpec)
    path = _path(path)
    if path.suffix.lower() != ".json":
        raise ValueError(f"a GPU profile is a .json file, got {quoted_path(path)}")
    check_instance("notes", notes, dict, allow_none=True)
    bad = _keys_not_str(notes)
    if bad:
        try:                            # (the key as JSON writes it; a tuple, or an int too long, it cannot)
            how = f"JSON would write {brief(bad[0])} as {json.dumps(next(iter(json.loads(json.dumps({bad[0]: 0})))))}"
        except (TypeError, ValueError):
            how = "JSON cannot write it as a key"
        raise ValueError(f"notes must hold str keys only ({how}), got key {brief(bad[0])} ({type(bad[0]).__name__})")
    d = _profile_dict(gpu, notes)
    try:  # a NaN in a profile is a bug: refuse to write it (nothing is written then)
        text = json.dumps(d, indent=2, allow_nan=False) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except (TypeError, ValueError) as e:  # not JSON: the spec is checked, so the notes hold it
        raise ValueError(f"notes must hold finite JSON values (str keys; dicts, lists, str, numbers, bools, "
                         f"None): {e}") from None
    except OSError as e:
        raise ValueError(f"cannot write the GPU profile {quoted_path(path)}: {e.strerror or e}") from None
    return path


def _profile_problem(d: object) -> str | None:
    """What makes `d` no readable profile (its format, version or `gpu` fields), or None."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        return f" is not an orca-torch GPU profile (needs \"format\": \"{FORMAT}\")"
    if not (is_int(d.get("version")) and d["version"] == VERSION):
        return f": profile version {brief(d.get('version'))} is not supported (this code reads {VERSION})"
    unknown = sorted(set(d) - set(PROFILE_KEYS))
    if unknown:
        return f": unknown key(s) {brief_items(unknown)}; a profile holds {', '.join(PROFILE_KEYS)}"
    spec = d.get("gpu")
    if not isinstance(spec, dict):
        return ': "gpu" must be an object of GPUSpec fields'
    known = {f.name for f in fields(GPUSpec)} - {"refined"}
    extra, missing = sorted(set(spec) - known), sorted({"name", "peak_flops", "mem_bw", "mem_bytes"} - set(spec))
    if extra or missing:
        return (f": bad GPUSpec fields (unknown: {brief_items(extra) or 'none'}, "
                f"missing: {brief_items(missing) or 'none'})")
    for k, v in spec.items():
        if isinstance(v, float) and not math.isfinite(v):
            return (f": gpu.{k} must be finite, got {v!r}"
                    + (" (a number past the largest float)" if math.isinf(v) else ""))
    return None


def _spec_from_dict(d: dict, where: str) -> GPUSpec:
    """The inverse of `_profile_dict`: a `GPUSpec` with its `RefinedParams`, every field checked."""
    problem = _profile_problem(d)
    if problem is None:
        try:
            return GPUSpec(**d["gpu"], refined=RefinedParams.from_dict(d.get("refined", {})))
        except (TypeError, ValueError) as e:
            problem = f": {e}"
    raise ValueError(f"{where}{problem}")


def _parse_int(s: str) -> int | float:
    """A JSON integer as an `int`, unless it is longer than any GPU figure (and than Python's 4,300-digit
    parsing limit): that one reads as the float it overflows to, which the field's check refuses by name."""
    return int(s) if len(s) <= 400 else float(s)


def _unreadable(p: Path, e: Exception) -> str:
    """Why the GPU profile at `p` cannot be read, from the error reading or parsing it raised."""
    if isinstance(e, FileNotFoundError):
        return f"no GPU profile at {quoted_path(p)}"
    if isinstance(e, UnicodeDecodeError):
        why = f"not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"
    elif isinstance(e, OSError):
        why = e.strerror or str(e)
    else:  # not JSON, or nested past Python's stack
        why = f"not JSON ({e})"
    return f"cannot read the GPU profile {quoted_path(p)}: {why}"


def load_profile(path: str | os.PathLike) -> GPUSpec:
    """Read a JSON GPU profile (see `save_profile`). A hand-written profile may leave out `refined`,
    or some of its fields: those take `RefinedParams`' defaults (a datasheet card's), as for a
    card built in code."""
    p = _path(path)
    try:
        d = json.loads(p.read_text(encoding="utf-8"), parse_int=_parse_int)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(_unreadable(p, e)) from None
    return _spec_from_dict(d, where=quoted_path(p))
