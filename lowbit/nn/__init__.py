"""Modules and caches: quantized linears (one per scheme) and the paged KV cache."""
