"""Entry point: one scheduler per instance."""
from processes.common import parse


def main() -> None:
    args, cfg = parse("scheduler")
    from pushkv import faults
    from pushkv.scheduler import scheduler_for
    from pushkv.scheduler.shell import SchedulerShell

    core = scheduler_for(cfg, cfg.instance(args.role, args.instance))
    SchedulerShell(core, faults.from_env(core.name)).run()


if __name__ == "__main__":
    main()
