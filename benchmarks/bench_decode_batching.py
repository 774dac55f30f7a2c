"""One decode step for N requests, batched vs one by one (lecture §1.1, code 02 demo 3): one line.

    python benchmarks/bench_decode_batching.py [--model mini] [--requests 64] [--repeats 9] [--threads 1]
"""
from __future__ import annotations

import argparse

import torch

from orca_torch.accounting import decode_step_times
from orca_torch.model import OrcaModel
from orca_torch.report import seed_arg

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", default="mini")
p.add_argument("--requests", type=int, default=64)
p.add_argument("--repeats", type=int, default=9)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--seed", type=seed_arg, default=0)
a = p.parse_args()
if a.requests < 1 or a.repeats < 1 or a.threads < 1:
    raise SystemExit("--requests, --repeats and --threads must be >= 1")
torch.set_num_threads(a.threads)
t = decode_step_times(OrcaModel(a.model, seed=a.seed), n_requests=a.requests, repeats=a.repeats, seed=a.seed)
print(f"decode_batching model={a.model} requests={a.requests} threads={a.threads} repeats={a.repeats}: "
      f"one_by_one={t['one_by_one_s'] * 1e3:.1f} ms batched={t['batched_s'] * 1e3:.1f} ms "
      f"ratio={t['speedup']:.2f}")
