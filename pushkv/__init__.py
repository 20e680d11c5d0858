"""pushkv: disaggregated LLM serving with push KV transfer over NIXL (see docs/design.md)."""
import sys

# tomllib (config files) and asyncio.timeout (the router's request deadline) are 3.11+.
if sys.version_info < (3, 11):
    raise ImportError(f"pushkv needs Python >= 3.11 (tomllib, asyncio.timeout); this is {sys.version.split()[0]}")

__version__ = "0.1.0"  # pyproject.toml's (tests/tools/test_dependencies.py holds them equal)
