"""`pushkv layout-report`'s arguments (no deployment runs)."""
from __future__ import annotations

import json

import pytest

from tools import layout_report


def test_only_that_matches_no_layout_is_refused(tmp_path, capsys):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as e:
        layout_report.main(["--no-deploy", "--only", "smal p16", "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--only smal p16 matches no layout" in err and "'small p16/d32'" in err
    assert not out.exists()


def test_only_picks_the_layouts_it_names(tmp_path):
    out = tmp_path / "r.json"
    assert layout_report.main(["--no-deploy", "--lengths", "64", "--only", "p16/d32", "--out", str(out)]) == 0
    names = {r["layout"] for r in json.loads(out.read_text())["rows"]}
    assert names and all("p16/d32" in n for n in names)
