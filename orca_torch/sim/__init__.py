"""The paper GPU and the simulators over it (lecture §1, §2.6, §5): `hw_model` prices a step of a
real-size model on a real card, `executors` puts that price behind the engine's `Executor`
interface, `fast_engine` runs the same scheduler faster than step by step (equal to it,
step for step), and `bounds` gives the limits a schedule cannot beat.

Imports `core`, `specs` and `checks` only; never `model`, `lab` or `distributed`.
"""
