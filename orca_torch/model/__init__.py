"""The torch model (lecture §4.2, §5.1): `orca_model.OrcaModel` and its attention paths
(`fused_attention`), the K/V storage it reads and writes (`kv_cache.KVManager`,
`paged_kv_cache.PagedKVManager`, their views in `kv_views`), real Llama weights (`hf_llama`), FLOP
accounting (`accounting`) and `torch_executor.TorchExecutor`, which runs the engine's steps on it and
draws the tokens of a request with `sampling.SamplingParams`.

Imports `core`, `specs` and `checks` only; never `sim`, `lab` or `distributed`.
"""
