"""Entry point: one writer (owns the KV pool and the NIXL agent) per TP rank."""
from processes.common import parse, run_profiled


def main() -> None:
    args, cfg = parse("writer")
    inst = cfg.instance(args.role, args.instance)
    if args.role == "prefill":
        from pushkv.writer.prefill import PrefillWriter as W
    elif args.role == "decode":
        from pushkv.writer.decode import DecodeWriter as W
    else:
        from pushkv.writer.local import LocalWriter as W
    run_profiled(W(cfg, inst, args.rank).run, f"{inst.name}-writer-{args.rank}")


if __name__ == "__main__":
    main()
