"""Orca's distributed execution, for real: worker processes over torch.distributed, pipeline and
tensor parallelism, the control plane apart from the data plane (lecture §4.4, exercise 6).

    from orca_torch.distributed import DistributedExecutor
    with DistributedExecutor(OrcaModel("tiny"), tp=1, pp=2) as ex:
        Engine(ex, memory, SchedulerConfig(n_workers=2)).run(requests)

Modules: `shard` (what one worker holds and computes), `control` (the control messages),
`worker` (a worker's loop), `launch` (starting and watching a group: torch.multiprocessing or
torchrun), `executor` (the engine's side), `__main__` (the torchrun entry point), `stages` and
`runs` (experiment 06's figures, read off the workers' timestamps), `measured_link` (this
machine's loopback link, measured).

The top layer: imports any other (`lab`'s workloads and argument types included); nothing in the
package imports it.
"""
from orca_torch.distributed.control import Control
from orca_torch.distributed.executor import DistributedExecutor, StageRecord
from orca_torch.distributed.launch import WorkerFailure, WorkerGroup, free_port, launch_local
from orca_torch.distributed.shard import ShardLayout, StageShard, slice_state

__all__ = ["Control", "DistributedExecutor", "StageRecord", "WorkerFailure", "WorkerGroup", "free_port",
           "launch_local", "ShardLayout", "StageShard", "slice_state"]
