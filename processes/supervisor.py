"""Supervisor entry: ``python -m processes.supervisor --config <file>`` (same flags as ``pushkv up``)."""
from __future__ import annotations

import sys

from processes.cli import main

if __name__ == "__main__":
    sys.exit(main(["up"] + sys.argv[1:]))
