"""Entry point: one worker (model forward into the pool) per TP rank."""
from processes.common import parse


def main() -> None:
    args, cfg = parse("worker")
    from pushkv import faults
    from pushkv.worker.engine import Worker, worker_name

    inst = cfg.instance(args.role, args.instance)
    Worker(cfg, inst, args.rank, faults.from_env(worker_name(inst, args.rank))).run()


if __name__ == "__main__":
    main()
