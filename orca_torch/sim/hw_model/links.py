"""The link between two devices (lecture §4.4; the interconnect half of the paper GPU).

The datasheet links (NVLink, InfiniBand) live on the `GPUSpec`s in `gpus.py`; a `LinkSpec` is any
other one, such as the loopback link `orca_torch.distributed.measured_link.get_link("cpu")` measures
between two worker processes. `with_link(gpu, link)` puts a link on a card, so the paper GPU's TP
all-reduce and PP transfer pricing (`roofline.StepPricer`) can be read with that link.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from orca_torch.checks import check_instance, check_int, check_real
from orca_torch.sim.hw_model.gpus import GPUSpec, get_gpu


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link: bytes/s and the fixed cost of a message."""

    name: str
    bandwidth: float
    latency_s: float
    source: str = ""

    def __post_init__(self) -> None:
        check_instance("LinkSpec.name", self.name, str)
        check_instance("LinkSpec.source", self.source, str)
        object.__setattr__(self, "bandwidth", check_real("LinkSpec.bandwidth", self.bandwidth, 0.0, lo_open=True,
                                                         unit="bytes/s"))
        object.__setattr__(self, "latency_s", check_real("LinkSpec.latency_s", self.latency_s, 0.0, unit="seconds"))


def with_link(gpu: GPUSpec | str, link: LinkSpec, devices_per_node: int = 8) -> GPUSpec:
    """`gpu` (a spec, a card's name or a profile path) with `link` inside and between nodes, reached in
    full (a measured link has no efficiency)."""
    gpu, link = get_gpu(gpu), check_instance("link", link, LinkSpec)
    devices_per_node = check_int("devices_per_node", devices_per_node, 1)
    return replace(gpu, name=f"{gpu.name}+{link.name}-link", nvlink_bw=link.bandwidth, ib_bw=link.bandwidth,
                   nvlink_latency_s=link.latency_s, ib_latency_s=link.latency_s, gpus_per_node=devices_per_node,
                   comm_efficiency=1.0)
