"""The model math in plain numpy: forward pass, KV cache, sampling, generation.

Import from the modules (moetier.model.forward.Model, moetier.model.kv_cache.KVCache, ...):
this package is imported by the adapters for ModelArgs alone and stays free of imports.
"""
