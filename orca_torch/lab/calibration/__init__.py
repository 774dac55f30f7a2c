"""The parts of calibration, one module each: `samples` (what is measured, and what both fits share),
`measure` (timing the torch model's steps), `roofline_fit` and `refined_fit` (the two cost models
fitted to measured steps). `orca_torch.lab.calibrate` ties them together: its docstring is the map.
"""
