"""Reference disaggregated servers that embed nixl_kv: ctx (prefill), gen (decode) and a router (``nixl-kv serve``)."""
