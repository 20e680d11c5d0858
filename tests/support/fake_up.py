"""``pushkv up`` with fake children: ``python tests/support/fake_up.py <up flags>``.

$FAKE_CHILD_ARGS is a JSON object {process name: [extra fake_child args]}.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
from processes.cli import main

EXTRA = json.loads(os.environ.get("FAKE_CHILD_ARGS", "{}"))


def fake_argv(spec):
    config = spec.argv[list(spec.argv).index("--config") + 1]
    return [sys.executable, os.path.join(HERE, "fake_child.py"), "--config", config, "--name", spec.name,
            *EXTRA.get(spec.name, [])]


if __name__ == "__main__":
    sys.exit(main(["up"] + sys.argv[1:], child_argv=fake_argv))
