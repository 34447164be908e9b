"""``benchmarks/serving/ttft_waves.py``: a closed-loop run's TTFTs split into the first wave (the ``concurrency``
earliest arrivals) and the rest, against hand-computed values; unfinished requests and open-loop points left out."""

from __future__ import annotations

import gzip
import json

import pytest
from engine_scripts import load_serving_script

pytestmark = [pytest.mark.cpu]


def load_script():
    return load_serving_script("ttft_waves")


def run(policy: str, concurrency: int | None, ttfts: list[float | None]) -> dict:
    # Listed out of arrival order: the split goes by arrival, not by list position.
    reqs = [{"arrival": 0.1 * i, "ttft": t} for i, t in enumerate(ttfts)]
    return {"policy": policy, "concurrency": concurrency, "requests": reqs[::-1]}


def test_first_wave_is_the_earliest_arrivals():
    waves = load_script().wave_split(run("dps", 2, [4.0, 3.0, 0.5, None, 0.25])["requests"], 2)
    assert waves == {"all": [4.0, 3.0, 0.5, 0.25], "first wave": [4.0, 3.0], "rest": [0.5, 0.25]}


def test_table_from_gzipped_results(tmp_path, capsys):
    module = load_script()
    path = tmp_path / "dense-dps.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"runs": [run("dps", 2, [4.0, 2.0, 1.0, 0.5, 0.0]),
                                                        run("dps", None, [1.0])]}).encode()))
    lines = module.main([str(path)]).splitlines()
    assert lines == capsys.readouterr().out.splitlines()
    assert len(lines) == 4  # the header and three parts of the closed-loop point; the rate point has none
    part = {line.split()[2] if "wave" not in line else "first": line.split()[-4:] for line in lines[1:]}
    # all: mean 1.5, P50 1.0, P90 between 2.0 and 4.0 at 0.6 -> 3.2; first: 3.0 / 3.0 / 3.8; rest: 0.5 / 0.5 / 0.9
    assert part["all"] == ["5", "1.50s", "1.00s", "3.20s"]
    assert part["first"] == ["2", "3.00s", "3.00s", "3.80s"]
    assert part["rest"] == ["3", "0.50s", "0.50s", "0.90s"]
