"""``pushkv up --role ...`` on namespace hosts for the several-hosts tests; it lives in
``tools/hosts_up.py`` so that tools (``tools/link_bench.py``) start hosts the same way."""
from tools.hosts_up import START_TIMEOUT_S, HostUp, health, http, up_engines, wait_for

__all__ = ["START_TIMEOUT_S", "HostUp", "health", "http", "up_engines", "wait_for"]
