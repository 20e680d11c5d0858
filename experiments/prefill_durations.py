import json, sys
for f in sys.argv[1:]:
    tl = json.load(open(f))["timelines"]
    d = sorted(round((t["prefill.prefill_end"] - t["prefill.prefill_start"]) * 1e3) for t in tl)
    print(f.split("/")[-1], "prefill ms (sorted):", d)
