"""The paper GPU and the simulators over it (lecture §1, §2.6, §5): `hw_model` prices a step of a
real-size model on a real card, `executors` puts that price behind the engine's `Executor`
interface (`PricedExecutor`: a step, or a run of decode steps, priced without running it),
`fast_engine` (`FastEngine`, with `decode_runs`) runs the core's scheduler over it with the runs of
decode steps taken in bulk, for the same result as `Engine` step by step, and `bounds` gives the
limits a schedule cannot beat.

Imports `core`, `specs` and `checks` only; never `model`, `lab` or `distributed`.
"""
