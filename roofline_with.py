import runpy, sys, pushkv.model.batched as b
b.SDPA_PROMPT_TOKENS = int(sys.argv.pop(1))
orig = b.BatchedForward.warmup
def warm(self, *a, **k):
    r = orig(self, *a, **k)
    print(f"fresh plans up to 8192: {self.warm_fresh(8192):.2f} s", flush=True)
    return r
b.BatchedForward.warmup = warm
runpy.run_module("tools.roofline", run_name="__main__")
