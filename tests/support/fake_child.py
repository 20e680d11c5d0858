"""A stand-in for any pushkv child, for supervisor tests.

Built on pushkv.actor.Actor: connects to the control endpoint of the config,
sends Ready, answers Ping and Shutdown. Options make it misbehave.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading

from pushkv.actor import Actor
from pushkv.config import SHM_DIR, decode_config, shm_prefix


class FakeChild(Actor):
    def __init__(self, name: str, cfg, args):
        super().__init__(name, control_endpoint=cfg.control_endpoint)
        self.cfg, self.args = cfg, args
        self.shm = os.path.join(SHM_DIR, shm_prefix(cfg.deployment_id) + name)

    def setup(self) -> None:
        with open(self.shm, "wb") as f:  # left behind on purpose: the supervisor unlinks it
            f.write(b"x")
        if self.args.crash_at_start is not None:
            os._exit(self.args.crash_at_start)
        if self.args.ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.args.hang_at_start:  # never Ready; SIGTERM still ends it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            threading.Event().wait()

    def on_Shutdown(self, msg) -> None:
        if not self.args.ignore_term:
            super().on_Shutdown(msg)

    def tick(self, now: float) -> None:
        if self.args.crash_after is not None and now - self.started_mono > self.args.crash_after:
            os._exit(7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--crash-at-start", type=int, default=None, help="exit with this code before Ready")
    ap.add_argument("--crash-after", type=float, default=None, help="exit(7) this many seconds after start")
    ap.add_argument("--hang-at-start", action="store_true", help="never send Ready")
    ap.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM and Shutdown")
    args, _ = ap.parse_known_args()
    with open(args.config, "rb") as f:
        cfg = decode_config(f.read())
    if args.ignore_term:  # before the actor installs its own handler
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = FakeChild(args.name, cfg, args)
    child.run()


if __name__ == "__main__":
    main()
