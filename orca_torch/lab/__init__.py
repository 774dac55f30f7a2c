"""The experiment toolkit (lecture §5, §6): workloads (`workload`), metrics and goodput (`metrics`),
the one-call API (`api.simulate`, `api.goodput`), the systems Orca is compared with (`baselines`),
Orca's evaluation (`orca_evaluation`), calibration of the paper GPU against this machine
(`calibrate`, its parts in `calibration`), reports, plots, timelines and traces, the paper-GPU calculator (`gpu_calculator`)
and the command-line argument types (`cli_args`).

Imports any layer below it (`core`, `specs`, `checks`, `model`, `sim`); never `distributed`.
"""
