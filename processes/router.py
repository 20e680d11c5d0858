"""Router process: ``python -m processes.router --config <json file>``."""
from __future__ import annotations

import argparse
import asyncio
import logging

from setproctitle import setproctitle

from pushkv.config import decode_config
from pushkv.router import serve


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="pushkv router (OpenAI-compatible HTTP front)")
    ap.add_argument("--config", required=True, help="deployment config JSON file")
    ap.add_argument("--port", type=int, default=None, help="override the config's port")
    args = ap.parse_args(argv)
    with open(args.config, "rb") as f:
        cfg = decode_config(f.read())
    if args.port is not None:
        import msgspec
        cfg = msgspec.structs.replace(cfg, port=args.port)
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s router %(name)s: %(message)s",
    )
    setproctitle("pushkv router")
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
