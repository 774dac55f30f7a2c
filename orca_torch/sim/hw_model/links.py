"""The link between two devices (lecture §4.4; the interconnect half of the paper GPU).

The datasheet links (NVLink, InfiniBand) live on the `GPUSpec`s in `gpus.py`; a `LinkSpec` is any
other one, such as the loopback link `orca_torch.distributed.measured_link.get_link("cpu")` measures
between two worker processes. `with_link(gpu, link)` puts a link on a card, so the paper GPU's TP
all-reduce and PP transfer pricing (`roofline.StepPricer`) can be read with that link.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from orca_torch.checks import check_instance, check_real
from orca_torch.sim.hw_model.gpus import GPUSpec, get_gpu


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link: bytes/s and the fixed cost of a message."""

    name: str
    bandwidth: float
    latency_s: float
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("name", "source"):
            check_instance(f"LinkSpec.{f}", getattr(self, f), str)
        for f, lo_open, unit in (("bandwidth", True, "bytes/s"), ("latency_s", False, "seconds")):
            object.__setattr__(self, f, check_real(f"LinkSpec.{f}", getattr(self, f), 0.0, lo_open=lo_open, unit=unit))


def with_link(gpu: GPUSpec | str, link: LinkSpec) -> GPUSpec:
    """`gpu` (a spec, a card's name or a profile path) with `link` (a `LinkSpec`) inside and between nodes,
    reached in full (a measured link has no efficiency). The card keeps its `gpus_per_node`: with one
    link on both sides, where a node ends changes no transfer's price."""
    check_instance("link", link, LinkSpec)
    gpu = get_gpu(gpu)
    return replace(gpu, name=f"{gpu.name}+{link.name}-link", nvlink_bw=link.bandwidth, ib_bw=link.bandwidth,
                   nvlink_latency_s=link.latency_s, ib_latency_s=link.latency_s, comm_efficiency=1.0)
