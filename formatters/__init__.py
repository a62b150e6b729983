"""Cache formatters, installed as nixl_kv.formatters (pyproject.toml maps this folder into the package)."""
