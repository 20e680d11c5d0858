"""Entry point: one writer (owns the KV pool and the NIXL agent) per TP rank."""
from processes.common import parse, run_profiled
from pushkv import faults
from pushkv.writer.base import WriterBase
from pushkv.writer.kv_damage import KVDamage


def main() -> None:
    args, cfg = parse("writer")
    inst = cfg.instance(args.role, args.instance)
    writer: WriterBase
    if args.role == "prefill":
        from pushkv.writer.prefill import PrefillWriter
        writer = PrefillWriter(cfg, inst, args.rank)
    elif args.role == "decode":
        from pushkv.writer.decode import DecodeWriter
        writer = DecodeWriter(cfg, inst, args.rank)
    else:
        from pushkv.writer.local import LocalWriter
        writer = LocalWriter(cfg, inst, args.rank)
    armed = faults.from_env(writer.name)
    if armed is not None:  # tests: the KV damage of --kv-verify's fault tests, wired in once
        writer.damaged_by(KVDamage(armed, writer))
        writer.copy_hold_s = armed.copy_hold_s()  # (its staging copies, once its area is made)
    run_profiled(writer.run, writer.name)


if __name__ == "__main__":
    main()
