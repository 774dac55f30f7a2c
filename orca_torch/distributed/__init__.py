"""Orca's distributed execution, for real: worker processes over torch.distributed, pipeline and
tensor parallelism, the control plane apart from the data plane (lecture §4.4, exercise 6).

    from orca_torch.distributed import DistributedExecutor
    with DistributedExecutor(OrcaModel("tiny"), tp=1, pp=2) as ex:
        Engine(ex, memory, SchedulerConfig(n_workers=2)).run(requests)

One batch, engine to workers and back (rank r serves stage `r // tp` as tensor-parallel rank
`r % tp`; `ShardLayout`):

1. `core.pipeline.Pipeline` keeps up to `n_workers` batches submitted: `DistributedExecutor.submit`
   maps request ids to integer handles and encodes the batch as a `control.BatchControl` (handles,
   `SeqWork`s, new token ids, K/V to reserve and free, stop ids a work may not make yet), which
   `launch.WorkerGroup.send` pushes onto every worker's queue of the control channel
   (`Control.APART`; `Control.DATA`: rank 0's only, and each stage passes it on through the data
   plane ahead of its activations).
2. Each worker (`worker.Worker.run`) takes the message (`Worker.next_control`), frees and reserves
   K/V, and plans the step (`shard.StageShard.plan`) before its input is there (`Worker.step`).
3. Input: the first stage's ranks look the token ids up in their vocabulary rows
   (`StageShard.embed`, one all-reduce); a later stage's rank receives `[tokens, hidden]` from the
   same tp rank of the stage before (`worker.DataPlane.recv`, point to point: the PP hop).
4. `StageShard.layers`: per layer, attention with Q/K/V split by heads and `wo` by its input
   columns, then the MLP with gate/up split by columns and `w_down` by its input columns; each
   branch's output is a partial sum, all-reduced in the stage's TP group (`DataPlane.all_reduce`).
5. Output: a middle stage's rank sends its activations to the same tp rank of the next stage
   (`DataPlane.send`); the last stage's ranks take the vocab-parallel greedy token
   (`StageShard.greedy`: each rank's best logit, all-gathered; a stop id of a request short of its
   `min_tokens` left out by the rank that holds its logit); for a request with `sampling` that
   draws, sets a logit bias or penalties, or asks for log probabilities, its whole raw logits row
   (before the bans) is gathered too, one row a request (`executor.returned_rows`), and the
   engine's process picks its token from it, the bans applied there (`DistributedExecutor.wait`, on
   the request's own generator and with its tokens so far, as `TorchExecutor` does), and takes its
   log probabilities from the raw row (`torch_executor.step_logprobs`) for the token picked there
   or by the workers' argmax.
6. Every rank reports `("done", ...)` with its timestamps on the control channel, the last
   stage's tp rank 0 with the tokens; `DistributedExecutor.wait` collects all `tp x pp` reports of
   the oldest batch (`WorkerGroup.receive`, bounded) and returns its tokens and times.

The control channel is torch.distributed's `TCPStore`, hosted by the engine's process (a queue
per worker, one back to the engine: `control.py`); activations and collectives are
torch.distributed's process groups (gloo on CPU, NCCL on CUDA). Steps 3–5 without processes, threads standing
in for the collectives: `test_shards_in_one_process_compute_the_full_models_step` in
tests/test_distributed.py.

Both parallelisms are applied to the model from outside it (`shard`, as gpt-fast applies tensor
parallelism): `OrcaModel` knows no ranks; a worker builds one of its shard's shapes and adds the
collectives around its per-layer calls.

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
from orca_torch.distributed.launch import WorkerFailure, WorkerGroup, launch_local
from orca_torch.distributed.shard import ShardLayout, StageShard, slice_state

__all__ = ["Control", "DistributedExecutor", "StageRecord", "WorkerFailure", "WorkerGroup", "launch_local",
           "ShardLayout", "StageShard", "slice_state"]
