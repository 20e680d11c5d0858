"""The GPU harness runs on the CPU too (CPU tensors, marks without events): real P and D
processes, their real writers and NIXL, layer-streamed WRITEs checked head by head."""
from __future__ import annotations

import json

from tools import vllm_gpu_harness as H


def test_the_harness_streams_and_checks_layouts_on_the_cpu(tmp_path):
    rc = H.main(["--device", "cpu", "--quick", "--groups", "2", "--skip-measure",
                 "--cases", "flash_attn_nhd,mla", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert {k: v["pass"] for k, v in res["layouts"].items()} == {"flash_attn_nhd": True, "mla": True}, res
    whole = H.cache_bytes("flash_attn_nhd", 4, 5, 16, 4, 64, H.DTYPES["bf16"])  # 4 layers of 5 blocks
    assert res["layouts"]["flash_attn_nhd"]["nbytes"] == whole  # the parts and the last WRITE: each byte once
    assert "flash_attn_nhd   PASS" in (tmp_path / "summary.txt").read_text() and rc == 0
