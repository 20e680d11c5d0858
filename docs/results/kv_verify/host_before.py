"""The host-side costs of --kv-verify full as the code at e6dfddc paid them (sums as Python ints), measured
as `python -m experiments.kv_verify_bench --host-only` measures them after: P's tolist + to_wire, one hop's decode and
encode of VerifyKV, D's tolist + to_wire + compare. Run against that commit's package (README.md says how)."""
import statistics, time, msgspec, torch
from pushkv import messages as m
from pushkv.config import preset
from pushkv.kv import checksum as C, layout as L
lay = L.layout_for(preset("qwen3-8b"), 1, 0, L.blocks_for(8192, 16), 16, layer_split=4)
units = C.plan_units("full", 8192, 16)
sums = torch.randint(-2**62, 2**62, (4, len(units), lay.kv_heads), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
exp = C.to_wire(lay, sums.tolist(), units, 16, 8192)
wire = m.encode(m.VerifyKV("t", 0, tuple(range(len(units))), exp)); dec = msgspec.msgpack.Decoder(m.VerifyKV)
def ms(f, reps=20):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e3, 3)
print({"message_bytes": len(wire), "to_wire_ms": ms(lambda: C.to_wire(lay, sums.tolist(), units, 16, 8192)),
       "decode_ms": ms(lambda: dec.decode(wire)), "encode_ms": ms(lambda: m.encode(dec.decode(wire))),
       "d_check_ms": ms(lambda: C.compare(lay, exp, C.to_wire(lay, sums.tolist(), units, 16, 8192)))})
