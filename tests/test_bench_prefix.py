"""`pipeserve bench prefix` on stories260K with tiny workloads: the JSON it writes, its ideal hit
rate, and its plot (figures are not checked: the machine is shared)."""

from __future__ import annotations

import argparse
import json

import pytest

from pipeserve.bench import prefix
from tests.conftest import png_panels


def test_ideal_shared_tokens_counts_whole_pages_shared_with_earlier_or_sibling_prompts() -> None:
    ideal = prefix.Prefixes(page_size=4)
    a, b = list(range(10)), list(range(8)) + [99, 98]
    assert ideal.shared_tokens([a]) == 0
    assert ideal.shared_tokens([a]) == 8  # 2 full pages, the last token excluded
    assert ideal.shared_tokens([b, list(range(50, 60))]) == 8
    assert ideal.shared_tokens([[7] * 9, [7] * 9]) == 16  # siblings share with each other


@pytest.mark.slow
def test_bench_prefix(stories_dir: str, tmp_path) -> None:
    parser = argparse.ArgumentParser()
    prefix.add_arguments(parser)
    args = parser.parse_args(["--models", stories_dir, "--requests", "4", "--system-len", "32",
                              "--user-len", "8", "--output-len", "2", "--chats", "2", "--turns", "2",
                              "--repeats", "2", "--page-size", "4", "--threads", "1",
                              "--json", str(tmp_path / "p.json"), "--out", str(tmp_path)])  # fmt: skip
    assert prefix.main(args) == 0
    result = json.loads((tmp_path / "p.json").read_text())
    model = result["models"]["stories260K"]
    shared, unique = model["shared"], model["unique"]
    # Warm (after the unmeasured repetition), the 32-token system prompt is 8 cached pages of 4.
    assert shared["on"]["ideal_rate"] == pytest.approx(32 / 40)
    assert shared["on"]["hit_rate"] == pytest.approx(32 / 40) and shared["off"]["hit_rate"] == 0
    assert unique["on"]["hit_rate"] == unique["on"]["ideal_rate"] == 0
    assert 0 < model["chat"]["on"]["hit_rate"] <= model["chat"]["on"]["ideal_rate"]
    assert len(shared["repetitions"]["on"]) == 2 and len(shared["repetitions"]["on"][0]["ttft_s"]) == 4
    assert set(model["targets"]) >= {"shared_ttft_met", "shared_throughput_met", "unique_met"}
    assert png_panels(tmp_path / "prefix.png") == 2
