"""Shipped configs (YAML), installed as ``lightrft.configs``; see ``lightrft ls``."""
