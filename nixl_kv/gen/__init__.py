"""The gen side's pipeline, one module a step: admit -> plan -> enter -> pull -> prove -> finish
(docs/reading_path.md).

``nixl_kv.gen.receiver.CacheReceiver`` drives it: the request table, deadlines, and which thread advances what.
``side`` holds what every step uses; ``pull`` the per-peer pulls and their one step enum; ``direct`` advances the
pulls of the fast path (posted and finished on the caller's thread), ``stepped`` those advanced by the progress
loop (staged, layer-wise, peers without a hold board); ``reads`` posts and times READs; ``plan_cache`` keeps plan
templates, ``poll_queue`` orders the direct pulls' polls, ``stuck`` holds READs abandoned in flight.
"""
