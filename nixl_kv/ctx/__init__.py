"""The ctx side's pipeline, one module a step: respond -> serve (claims, grants, layers) -> count (ReadDone,
NoReaders) -> release (the one path that unpins). ``nixl_kv.ctx.sender.CacheSender`` drives it; ``table`` is the
request table the steps share and ``readers`` the gen agents it answers (docs/reading_path.md)."""
