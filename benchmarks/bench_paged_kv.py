"""One decode step for N requests with contiguous vs paged K/V on the torch model (lecture §7): one line.

The paged step gathers each request's blocks per layer; the contiguous one reads a view. The ratio
is what the gather costs on this machine's split loop (a paged kernel on CUDA reads the blocks in place),
so the line of figures follows one naming the machine (`report.machine_line`). The two layouts' decode
steps are taken in turn, best of `--repeats` each.

    python benchmarks/bench_paged_kv.py [--model mini] [--requests 32] [--context 256] [--block-size 16]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from orca_torch.core.batch import SeqWork  # noqa: E402
from orca_torch.checks import check_fits_in_memory  # noqa: E402
from orca_torch.lab.cli_args import (  # noqa: E402
    FP32_BYTES, add_seed_flag, command_parser, count_arg, threads_arg, torch_preset_arg)
from orca_torch.lab.report import machine, machine_line, quiet_exit  # noqa: E402
from orca_torch.model.orca_model import OrcaModel  # noqa: E402
from orca_torch.model.paged_kv_cache import PagedKVManager  # noqa: E402
from orca_torch.specs import get_model_spec  # noqa: E402

p = command_parser(__doc__.splitlines()[0])
p.add_argument("--model", type=torch_preset_arg, default="mini",
               help="a Llama-style preset built in fp32 (default mini; llama-3-8b needs ~32 GB and is refused where "
                    "that much memory is not available)")
p.add_argument("--requests", type=count_arg, default=32, help="requests in the decode step (default 32)")
p.add_argument("--context", type=count_arg, default=256, help="prompt tokens per request (context + repeats must "
               "fit in the model's max context; default 256)")
p.add_argument("--block-size", type=count_arg, default=16, help="tokens per K/V block, at most the max context "
               "(default 16)")
p.add_argument("--repeats", type=count_arg, default=7, help="timed decode steps of each layout, best kept (default 7)")
p.add_argument("--threads", type=threads_arg, default=1, help="torch threads (default 1)")
add_seed_flag(p, "the weights and the prompts")
a = p.parse_args()
spec = get_model_spec(a.model).with_dtype_bytes(FP32_BYTES)      # as OrcaModel builds it
if a.context + a.repeats > spec.max_context:
    p.error(f"--context {a.context} + --repeats {a.repeats} decode steps exceed {spec.name}'s max context "
            f"{spec.max_context}")
if a.block_size > spec.max_context:
    p.error(f"--block-size {a.block_size} is larger than {spec.name}'s max context {spec.max_context}")
n_blocks = -(-(a.context + a.repeats) // a.block_size)
try:
    check_fits_in_memory(f"--model {a.model} (fp32 weights and K/V) with --requests {a.requests}, --context "
                         f"{a.context}, --block-size {a.block_size}",
                         spec.weight_bytes
                         + spec.kv_bytes_per_token * a.requests * (a.context + a.repeats + n_blocks * a.block_size))
except ValueError as e:
    p.error(str(e))


def best_decodes() -> tuple[float, float]:
    """Best of `repeats` decode steps of each layout (contexts ctx .. ctx + repeats - 1), the two taken in
    turn at each context: a slower stretch of a shared machine falls on both, not on one."""
    ids, best = torch.zeros(n, dtype=torch.long), [float("inf")] * 2
    for j in range(a.repeats):
        for i, kv in enumerate((contiguous, paged)):
            t0 = time.perf_counter()
            model.forward_batch(ids, [SeqWork(1, ctx + j)] * n, list(range(n)), kv)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


with quiet_exit():             # (Ctrl-C: one line, no traceback)
    torch.set_num_threads(a.threads)
    model = OrcaModel(a.model, seed=a.seed)
    g = torch.Generator().manual_seed(a.seed)
    n, ctx = a.requests, a.context
    prompts = torch.randint(0, model.spec.vocab, (n, ctx), generator=g)
    room = ctx + a.repeats
    contiguous = model.new_kv(n * room)
    paged = PagedKVManager(model.spec, n * -(-room // a.block_size), a.block_size)
    for i in range(n):
        contiguous.reserve(i, room)
        paged.add(i)
        paged.ensure(i, room)
    for kv in (contiguous, paged):                     # prefill every request, one at a time
        for i in range(n):
            model.forward_batch(prompts[i], [SeqWork(ctx, 0)], [i], kv)
    c, pg = best_decodes()
    print(machine_line(machine(a.threads)))
    print(f"paged_kv model={a.model} requests={n} context={ctx} block_size={a.block_size} threads={a.threads}: "
          f"contiguous={c * 1e3:.1f} ms paged={pg * 1e3:.1f} ms paged/contiguous={pg / c:.2f}")
