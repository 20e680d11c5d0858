"""Router process: ``python -m processes.router --config <json file>``."""
from __future__ import annotations

import argparse
import asyncio

import msgspec

from processes.common import setup
from pushkv.config import decode_config
from pushkv.router.server import serve


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="pushkv router (OpenAI-compatible HTTP front)")
    ap.add_argument("--config", required=True, help="deployment config JSON file")
    ap.add_argument("--port", type=int, default=None, help="override the config's port")
    args = ap.parse_args(argv)
    with open(args.config, "rb") as f:
        cfg = decode_config(f.read())
    if args.port is not None:
        cfg = msgspec.structs.replace(cfg, port=args.port)
    setup("pushkv router", cfg.log_level, cfg.log_config, cfg.deployment_id)
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
