"""`torchrun ... -m orca_torch.distributed`: Orca's engine and its workers on one or more machines.

Every process torchrun starts is one worker (global rank r of `tp x pp`, so torchrun's world
size must be `tp * pp`). Global rank 0 also runs the engine: it starts its own worker as a child
process, listens on `--control-port` (default: torchrun's master port + 1, on the master address)
for the other ranks' control connections, serves a closed workload of `--requests` seeded requests
with Orca's scheduler, checks every request's tokens against one-by-one generation, prints one
JSON line and stops the workers. One machine, two stages:

    torchrun --nnodes 1 --nproc-per-node 2 -m orca_torch.distributed --pp 2 --n-workers 2

Two machines, tp=2 inside each and pp=2 across (static rendezvous, so rank 0 is on the master):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank {0|1} --master-addr HOST0 --master-port 29500 \\
        -m orca_torch.distributed --tp 2 --pp 2 --n-workers 2 --device cuda
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from .control import control_mode
from .launch import join_torchrun, serve_torchrun
from .shard import ShardLayout
from .worker import WorkerConfig, worker_main


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orca_torch.distributed", description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--model", default="tiny", help="model preset (every worker builds it from --seed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the requests")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-bs", type=int, default=4)
    p.add_argument("--n-workers", type=int, default=1, help="batches in flight (Orca's n_workers; pp for pipelining)")
    p.add_argument("--control", default="apart", choices=("apart", "data"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--control-addr", default=None, help="engine's control address (default MASTER_ADDR)")
    p.add_argument("--control-port", type=int, default=None, help="default MASTER_PORT + 1")
    p.add_argument("--timeout", type=float, default=120.0, help="bound on connecting and on every step, seconds")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        raise SystemExit("run this under torchrun (RANK and WORLD_SIZE are not set); from Python use "
                         "orca_torch.distributed.DistributedExecutor, which starts its own workers")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    from ..specs import get_model_spec

    layout = ShardLayout(get_model_spec(args.model), args.tp, args.pp)
    if world != layout.world_size:
        raise SystemExit(f"torchrun started {world} processes but tp x pp = {args.tp} x {args.pp} = "
                         f"{layout.world_size}; make --nnodes x --nproc-per-node equal it")
    address = (args.control_addr or env.get("MASTER_ADDR", "127.0.0.1"),
               args.control_port or int(env.get("MASTER_PORT", "29500")) + 1)
    cfg = WorkerConfig(layout=layout, state=None, preset=args.model, seed=args.seed,
                       n_slots=256 * layout.spec.max_context, init_method="env://",
                       control=control_mode(args.control), step_timeout_s=args.timeout, device=args.device)
    if rank != 0:
        worker_main(rank, cfg, join_torchrun(rank, address, args.timeout))
        return 0
    return serve(args, cfg, address)


def serve(args: argparse.Namespace, cfg: WorkerConfig, address: tuple[str, int]) -> int:
    """Rank 0: the engine over the whole group."""
    import torch

    from ..engine import Engine
    from ..memory import UnlimitedMemory
    from ..model import OrcaModel, generate_alone
    from ..scheduler import SchedulerConfig
    from ..workload import make_requests, with_prompt_ids
    from .executor import DistributedExecutor

    torch.set_num_threads(1)
    group = serve_torchrun(cfg, address, args.timeout)
    model = OrcaModel(args.model, seed=args.seed)
    with DistributedExecutor(model, cfg.layout.tp, cfg.layout.pp, control=args.control, group=group,
                             step_timeout_s=args.timeout) as ex:
        rng = np.random.default_rng(args.seed)
        n = args.requests
        reqs = with_prompt_ids(make_requests(np.zeros(n), rng.integers(4, 17, n), rng.integers(4, 11, n), "closed"),
                               model.spec.vocab, seed=args.seed)
        t0 = time.perf_counter()
        res = Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=args.max_bs, n_workers=args.n_workers)).run(reqs)
        wall = time.perf_counter() - t0
    identical = all(res.output_ids[r.req_id] == generate_alone(model, r.prompt_ids, r.output_len) for r in reqs)
    print(json.dumps({"tp": cfg.layout.tp, "pp": cfg.layout.pp, "n_workers": args.n_workers, "requests": n,
                      "steps": int(res.n_steps), "tokens_identical": identical,
                      "throughput_tok_s": float(res.output_len.sum() / wall)}), flush=True)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
