"""Transfer agents, installed as nixl_kv.agents (pyproject.toml maps this folder into the package)."""
