"""`pipeserve bench reliability` prints every figure the issue's Report section lists (rendered here
from the scenarios' own result types; `pipeserve bench reliability` runs them for real), and its JSON
holds them all."""

from __future__ import annotations

import json

import pytest

from bench.reliability import FaultResult, OverloadResult, StormResult, report_rows
from bench.report import print_table, write_json
from bench.soak import SoakResult, growth

pytestmark = pytest.mark.timeout(30)


def figures() -> dict:
    soak = SoakResult(60.0, 10.0, 8, 0.3, 1.0, requests={"completed": 700, "cancelled": 300},
                      times=[0.0, 30.0, 60.0], rss_mb={"engine": [600.0, 601.0, 601.0]},
                      pages_at_end=0.0, verdict="flat", requests_per_s=10.0,
                      state_left={"gateway_inflight": 0.0, "pages_used": 0.0})
    soak.growth = [growth("engine", soak.times, soak.rss_mb["engine"], 1.0, requests_per_s=10.0)]
    return {
        "bad_input": {"tried": 41, "passed": 40, "failed": [], "state_left": {"pages_used": 0.0}},
        "abort_storm": StormResult(1000, {"decode": 250}, {"CANCELLED": 700, "completed": 300}, 9.0,
                                   {"pages_used": 0.0, "tombstones": 0.0}),
        "overload": OverloadResult(4, 7.0, 69.5, 208, 18, 190, 4.5, 31.0, 4.4, 5.6, {}),
        "overload_state_left": {"pages_used": 0.0},
        "soak": soak,
        "faults": [FaultResult("engine", 16, {"UNAVAILABLE": 15, "HUNG": 1}, 0.3,
                               ["NOT_SERVING", "SERVING"], True, True)],
    }


def test_report_has_every_figure(tmp_path, capsys):
    rows = report_rows(figures())
    text = "\n".join(" | ".join(row) for row in rows)
    for expected in ("cases tried / passed | 41 / 40", "1,000 / 700 / 300", "state left | none",
                     "refused", "4.5 / 31.0 ms", "4.4 / 5.6 ms", "RSS engine | 600.0 -> 601.0 MiB",
                     "+0.00 MiB/min", "verdict | flat (threshold 1 MiB/min", "1 SIGKILLs / 1 of 16",
                     "NOT_SERVING -> SERVING"):
        assert expected in text, (expected, text)
    print_table("pipeserve bench reliability", ["scenario", "figure", "value"], rows)
    assert "streams hung" in capsys.readouterr().out
    data = json.loads(write_json(tmp_path / "reliability.json", figures()).read_text())
    assert data["soak"]["growth"][0]["slope_mb_per_min"] == 0.0
    assert data["faults"][0]["outcomes"] == {"UNAVAILABLE": 15, "HUNG": 1}
