"""The test and benchmark harness: ``nixl-kv pair`` and ``nixl-kv bench``, their baselines and the deterministic
fill that lets a receiver check every element. Kept apart because a server that embeds nixl_kv needs none of it."""
