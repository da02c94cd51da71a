"""The engines' KV caches as vLLM describes them: its prefix-cache block hashes, its KV-cache events, and an
index of which endpoint holds which block. Pure functions and plain data: the router subscribes, the simulated
worker publishes."""
