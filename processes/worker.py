"""Entry point: one worker (model forward into the pool) per TP rank."""
from processes.common import parse


def main() -> None:
    args, cfg = parse("worker")
    from pushkv.worker.engine import Worker

    Worker(cfg, cfg.instance(args.role, args.instance), args.rank).run()


if __name__ == "__main__":
    main()
