"""One decode step for N requests, batched vs one by one (lecture §1.1, code 02 demo 3): one line.

The line of figures follows one naming the machine (`report.machine_line`): the ratio is this machine's.

    python benchmarks/bench_decode_batching.py [--model mini] [--requests 64] [--repeats 9] [--threads 1]
"""
from __future__ import annotations

import sys
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from orca_torch.model.accounting import decode_step_times  # noqa: E402
from orca_torch.checks import check_fits_in_memory  # noqa: E402
from orca_torch.lab.cli_args import (  # noqa: E402
    FP32_BYTES, add_seed_flag, command_parser, count_arg, threads_arg, torch_preset_arg)
from orca_torch.lab.report import machine, machine_line, quiet_exit  # noqa: E402
from orca_torch.model.orca_model import OrcaModel  # noqa: E402
from orca_torch.specs import get_model_spec  # noqa: E402

PAST_HI = 128             # decode_step_times' longest context per request

p = command_parser(__doc__.splitlines()[0])
p.add_argument("--model", type=torch_preset_arg, default="mini",
               help="a Llama-style preset built in fp32 (default mini; tiny also fits anywhere; llama-3-8b needs "
                    "~32 GB and is refused where that much memory is not available)")
p.add_argument("--requests", type=count_arg, default=64, help="requests in the decode step (default 64)")
p.add_argument("--repeats", type=count_arg, default=9, help="timed steps of each side, median kept (default 9)")
p.add_argument("--threads", type=threads_arg, default=1, help="torch threads (default 1)")
add_seed_flag(p, "the weights and the requests' tokens")
a = p.parse_args()
spec = get_model_spec(a.model).with_dtype_bytes(FP32_BYTES)      # as OrcaModel builds it
if PAST_HI + a.repeats + 2 > spec.max_context:
    p.error(f"--repeats {a.repeats}: contexts of up to {PAST_HI} tokens plus {a.repeats} + 2 decode steps exceed "
            f"{spec.name}'s max context {spec.max_context}; --repeats may be at most {spec.max_context - PAST_HI - 2}")
try:        # the weights, and two K/V copies (batched and one by one) of up to PAST_HI + repeats + 2 slots each
    check_fits_in_memory(f"--model {a.model} (fp32 weights and K/V) with --requests {a.requests}",
                         spec.weight_bytes + 2 * spec.kv_bytes_per_token * a.requests * (PAST_HI + a.repeats + 2))
except ValueError as e:
    p.error(str(e))
with quiet_exit():             # (Ctrl-C: one line, no traceback)
    torch.set_num_threads(a.threads)
    t = decode_step_times(OrcaModel(a.model, seed=a.seed), n_requests=a.requests, repeats=a.repeats, seed=a.seed)
    print(machine_line(machine(a.threads)))
    print(f"decode_batching model={a.model} requests={a.requests} threads={a.threads} repeats={a.repeats}: "
          f"one_by_one={t['one_by_one_s'] * 1e3:.1f} ms batched={t['batched_s'] * 1e3:.1f} ms "
          f"one_by_one/batched={t['speedup']:.2f}")
