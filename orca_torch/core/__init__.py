"""The algorithm (lecture §4.3, §5.1): `Request`, the step's works (`batch`), Orca's `Scheduler`
and its policies, the scheduler's memory managers, the `Engine` that runs one iteration per
`step()` and the `RunResult` it returns, `Pipeline`, and the `Executor` interface. Of the project
it imports only `orca_torch.checks`; docs/architecture.md has the map, docs/tour.md the walk.
"""
