"""`lazyserve bench threads` times the same work in each scenario, each in a fresh process."""

from bench.threads import SCENARIOS, main


def test_every_scenario_runs_in_a_fresh_process_and_reports(tmp_path):
    out = tmp_path / "threads.json"
    assert main(["--dtypes", "float32", "--calls", "20", "--repeats", "1", "--out", str(out)]) == 0
    import json

    [result] = json.loads(out.read_text())["results"]
    assert set(result["median_us"]) == set(SCENARIOS)
    assert all(value > 0 for value in result["median_us"].values())
    assert result["over_main"]["main"] == 1.0
