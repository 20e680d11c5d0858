"""Entry point: one scheduler per instance."""
from processes.common import parse


def main() -> None:
    args, cfg = parse("scheduler")
    from pushkv.scheduler import scheduler_for
    from pushkv.scheduler.shell import SchedulerShell

    SchedulerShell(scheduler_for(cfg, cfg.instance(args.role, args.instance))).run()


if __name__ == "__main__":
    main()
