"""`torchrun ... -m orca_torch.distributed`: Orca's engine and its workers on one or more machines.

Every process torchrun starts is one worker (global rank r of `tp x pp`, so torchrun's world
size must be `tp * pp`). Global rank 0 also runs the engine: it starts its own worker as a child
process, hosts the control channel (a torch.distributed `TCPStore`, which the other ranks join) on
`--control-port` (default: torchrun's master port + 1, on the master address), serves a closed
workload of `--requests` seeded requests with Orca's scheduler (fp32 weights), checks every
request's tokens against one-by-one generation, prints one JSON line and stops the workers. One machine, two stages:

    torchrun --nnodes 1 --nproc-per-node 2 -m orca_torch.distributed --pp 2 --n-workers 2

Two machines, tp=2 inside each and pp=2 across (static rendezvous, so rank 0 is on the master):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank {0|1} --master-addr HOST0 --master-port 29500 \\
        -m orca_torch.distributed --tp 2 --pp 2 --n-workers 2 --device cuda --trusted-network

The control port has no authentication: anyone who reaches it can push messages to the engine and
the workers (plain values: `control.load`). Rank 0 refuses to listen on an address other than
loopback unless `--trusted-network` says that every host that can reach it is trusted (a run over
several machines needs it, as torchrun's own rendezvous port needs such a network).

Every node is given the same `--tp`, `--pp`, `--model`, `--seed`, `--control` and `--device` (each
rank builds its shard from them): rank 0 refuses a rank started with others, naming them, and that
rank says so on its own node.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import time

from orca_torch.checks import brief, check_fits_in_memory
from orca_torch.core.scheduler_config import MAX_WORKERS
from orca_torch.distributed.control import control_mode, host_port
from orca_torch.distributed.launch import WorkerFailure, control_listener, join_torchrun, serve_torchrun
from orca_torch.distributed.shard import ShardLayout
from orca_torch.distributed.worker import WorkerConfig, default_n_slots, worker_main
from orca_torch.lab.cli_args import (FP32_BYTES, add_seed_flag, command_parser, count_arg, flag_names, host_arg,
                                     in_flag_terms, int_arg, port_arg, timeout_arg, torch_preset_arg)


def parser() -> argparse.ArgumentParser:
    p = command_parser(prog="python -m orca_torch.distributed", description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=count_arg, default=1, help="tensor-parallel ranks per stage; must divide the model's "
                   "heads, K/V heads, MLP columns and vocabulary (default 1)")
    p.add_argument("--pp", type=count_arg, default=1, help="pipeline stages; must divide the layers (default 1)")
    p.add_argument("--model", type=torch_preset_arg, default="tiny",
                   help="a Llama-style model preset (every worker builds it in fp32 from --seed; default tiny)")
    add_seed_flag(p, "the weights and of the requests")
    p.add_argument("--requests", type=count_arg, default=8, help="seeded requests to serve (default 8)")
    p.add_argument("--max-bs", type=count_arg, default=4, help="Orca's max batch size (default 4)")
    p.add_argument("--n-workers", type=int_arg(1, MAX_WORKERS), default=1,
                   help=f"batches in flight (Orca's n_workers, at most {MAX_WORKERS}; pp for pipelining; default 1)")
    p.add_argument("--control", default="apart", choices=("apart", "data"),
                   help="how batches reach the workers: apart (a channel of their own, Orca) or data (with the "
                        "activations, stage to stage) (default apart)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu, or cuda: one GPU per local rank (default cpu)")
    p.add_argument("--control-addr", type=host_arg, default=None,
                   help="engine's control address (default MASTER_ADDR); one other than loopback needs "
                        "--trusted-network")
    p.add_argument("--control-port", type=port_arg, default=None,
                   help="engine's control port (default MASTER_PORT + 1)")
    p.add_argument("--trusted-network", action="store_true",
                   help="let rank 0 listen for the control channel on an address other than loopback (a run over "
                        "several machines): the port has no authentication, and anyone who reaches it can push "
                        "messages to the engine and the workers, so give it only on a network whose every host "
                        "you trust")
    p.add_argument("--timeout", type=timeout_arg, default=120.0,
                   help="bound on connecting and on every step, seconds (default 120)")
    return p


def flags(p: argparse.ArgumentParser) -> dict[str, str]:
    """The library's parameters -> the flags that set them here (`tp` -> `--tp`; the executor's
    `step_timeout_s` and the launch's `launch_timeout_s` -> `--timeout`), for `in_flag_terms`."""
    return {**flag_names(p), "step_timeout_s": "--timeout", "launch_timeout_s": "--timeout"}


def shared_settings(args: argparse.Namespace) -> tuple:
    """The flags every rank must be given alike, as `(flag, value)` pairs: each rank builds its shard
    from them, and each node's torchrun gets its own command line (`launch.handshake` compares them)."""
    return (("--tp", args.tp), ("--pp", args.pp), ("--model", args.model), ("--seed", args.seed),
            ("--control", args.control), ("--device", args.device))


def _env_int(p: argparse.ArgumentParser, env, name: str, default: str | None = None) -> int:
    text = env.get(name, default)
    try:
        return int(text)
    except (TypeError, ValueError):
        p.error(f"the environment variable {name}={brief(text)} is not an integer (torchrun sets it)")


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        p.error("run this under torchrun (RANK and WORLD_SIZE are not set); from Python use "
                "orca_torch.distributed.DistributedExecutor, which starts its own workers")
    rank, world = _env_int(p, env, "RANK"), _env_int(p, env, "WORLD_SIZE")
    local = _env_int(p, env, "LOCAL_WORLD_SIZE", "1")
    from orca_torch.core.scheduler_config import SchedulerConfig
    from orca_torch.lab.api import BYTES_PER_REQUEST
    from orca_torch.specs import get_model_spec

    try:                                            # every rank, before any process group exists
        # fp32 bytes, as the served OrcaModel's spec says: the executor checks the group's layout against it.
        layout = ShardLayout(get_model_spec(args.model).with_dtype_bytes(FP32_BYTES), args.tp, args.pp)
        SchedulerConfig(max_bs=args.max_bs, n_workers=args.n_workers)
        # Each worker builds the whole model before cutting its shard, and a node's workers start together.
        check_fits_in_memory(f"--model {args.model} (fp32 weights, built whole by each of this machine's "
                             f"{local} worker process{'es' if local > 1 else ''})",
                             local * layout.spec.weight_bytes)
        if rank == 0:                               # the engine's process makes and holds every request
            check_fits_in_memory(f"--requests {args.requests:,} (at least {BYTES_PER_REQUEST:,} bytes a request, "
                                 "held by rank 0)", args.requests * BYTES_PER_REQUEST)
    except ValueError as e:
        p.error(in_flag_terms(str(e), flags(p)))
    if world != layout.world_size:
        p.error(f"torchrun started {world} processes but tp x pp = {args.tp} x {args.pp} = "
                f"{layout.world_size}; make --nnodes x --nproc-per-node equal it")
    if not 0 <= rank < world:
        p.error(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < local:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            p.error(f"--device cuda needs one GPU per local rank ({local}), but {have} are visible")
    port = args.control_port or _env_int(p, env, "MASTER_PORT", "29500") + 1
    if not 1 <= port <= 65535:
        p.error(f"the control port MASTER_PORT + 1 = {port} is not a port (1..65535); give --control-port")
    address = (args.control_addr or env.get("MASTER_ADDR", "127.0.0.1"), port)
    cfg = WorkerConfig(layout=layout, state=None, preset=args.model, seed=args.seed,
                       n_slots=default_n_slots(layout.spec), init_method="env://",
                       control=control_mode(args.control), step_timeout_s=args.timeout,
                       launch_timeout_s=args.timeout, device=args.device,
                       watch_peers=True)
    if rank != 0:
        worker_main(rank, cfg, join_torchrun(rank, address, args.timeout, shared_settings(args)), interruptible=True)
        return 0                                    # stopped by the engine (one gone away: exit 1, `abandoned`)
    where = (f"--control-addr {address[0]}" if args.control_addr else f"MASTER_ADDR={address[0]}",
             f"--control-port {port}" if args.control_port else f"MASTER_PORT + 1 = {port}")
    try:                                            # before any process starts
        listener = control_listener(address, layout.world_size)
    except OSError as e:
        p.error(f"cannot listen for the workers' control connections on {host_port(address[0], port)} "
                f"({where[1]}): {e.strerror or e}; give an address of this machine (--control-addr) and a free port "
                "(--control-port)")
    bound = listener.getsockname()[0]
    if not ipaddress.ip_address(bound).is_loopback and not args.trusted_network:
        listener.close()
        p.error(f"the control channel would listen on {host_port(bound, port)} ({where[0]}), not a loopback "
                "address, and it has no authentication: anyone who reaches the port could push messages to the engine "
                "and the workers; add --trusted-network where every host that can reach it is trusted (a run over "
                "several machines), or keep a one-machine run on loopback (--control-addr 127.0.0.1)")
    return serve(args, cfg, listener)


def serve(args: argparse.Namespace, cfg: WorkerConfig, listener) -> int:
    """Rank 0: the engine over the whole group, its control port already bound (`listener`)."""
    import torch

    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import UnlimitedMemory
    from orca_torch.core.scheduler_config import SchedulerConfig
    from orca_torch.distributed.executor import DistributedExecutor
    from orca_torch.distributed.runs import closed_workload
    from orca_torch.model.orca_model import OrcaModel, generate_alone

    torch.set_num_threads(1)
    group = serve_torchrun(cfg, listener, args.timeout, shared_settings(args))
    model = OrcaModel(args.model, seed=args.seed)
    with DistributedExecutor(model, cfg.layout.tp, cfg.layout.pp, control=args.control, group=group,
                             n_slots=cfg.n_slots, step_timeout_s=args.timeout) as ex:
        n = args.requests
        reqs = closed_workload(n, (4, 16), (4, 10), args.seed, model.spec.vocab)
        t0 = time.perf_counter()
        res = Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=args.max_bs, n_workers=args.n_workers)).run(reqs)
        wall = time.perf_counter() - t0
    identical = all(res.output_ids[r.req_id] == generate_alone(model, r.prompt_ids, r.output_len) for r in reqs)
    print(json.dumps({"tp": cfg.layout.tp, "pp": cfg.layout.pp, "n_workers": args.n_workers, "requests": n,
                      "steps": int(res.n_steps), "tokens_identical": identical,
                      "throughput_tok_s": float(res.output_len.sum() / wall)}), flush=True)
    return 0 if identical else 1


def cli(argv=None) -> int:
    """`main` with its two ends said in one line, not a traceback: a rank that died, hung or was
    never there (exit 1), and Ctrl-C, which torchrun passes on to every rank (exit 130, the shell's
    code for SIGINT; rank 0's executor has stopped its workers on the way out, and a worker rank
    ends inside `worker_main`)."""
    try:
        return main(argv)
    except WorkerFailure as e:
        print(f"orca_torch.distributed: {in_flag_terms(str(e), flags(parser()))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"orca_torch.distributed: rank {os.environ.get('RANK', '?')} interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
