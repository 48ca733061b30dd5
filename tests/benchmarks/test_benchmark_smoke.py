"""Every benchmark runs, at its smallest size: nothing else runs the benchmarks, so without this
one could break unseen (bench_placement.py did, on a setting the config came to refuse).

Each benchmark's smoke run (BENCH_SMOKE=1, tests/benchmarks/conftest.py) must exit 0 and end
with the JSON object that benchmarks/_common.py's LAST_LINES promises for it: every key present,
the numeric ones finite. The figures of a smoke run mean nothing and are not checked."""

from __future__ import annotations

import importlib.util
import json

import pytest
from benchmark_smoke import benchmark_scripts, last_line_problems, last_lines, smoke_chains


def test_every_benchmark_declares_its_last_line():
    """A benchmark without a LAST_LINES entry (or an entry without its benchmark) fails here in
    `make test`, and its smoke run fails among the slow tests."""
    scripts, promises = benchmark_scripts(), last_lines()
    assert len(scripts) > 20
    undeclared, unknown = sorted(set(scripts) - set(promises)), sorted(set(promises) - set(scripts))
    assert not undeclared, f"declare their last lines in benchmarks/_common.py LAST_LINES: {undeclared}"
    assert not unknown, f"LAST_LINES names no such benchmark: {unknown}"
    for script, promise in promises.items():
        assert promise.after is None or promise.after in promises, (script, promise.after)
        assert promise.numbers or promise.others, script


def test_smoke_runs_are_chained_after_what_they_read():
    """The smoke runs go two at a time in chains: each benchmark once, after the one whose output
    it reads, in the same chain; one selected alone brings what it reads."""
    scripts, after = benchmark_scripts(), {s: p.after for s, p in last_lines().items()}
    chains = smoke_chains(scripts, after)
    ran = [s for chain in chains for s in chain]
    assert sorted(ran) == sorted(scripts)
    readers = [s for s in scripts if after.get(s)]
    assert readers, "no benchmark reads another's output: nothing to chain"
    for reader in readers:
        chain = next(c for c in chains if reader in c)
        assert after[reader] in chain and chain.index(after[reader]) < chain.index(reader), chain
        assert smoke_chains([reader], after) == [[after[reader], reader]]
    assert chains[0] == smoke_chains([readers[0]], after)[0]  # chains of several runs first
    assert smoke_chains(["bench_lora.py"], after) == [["bench_lora.py"]]
    assert smoke_chains([after[readers[0]]], after) == [[after[readers[0]]]]  # not what reads it


def test_the_check_finds_a_broken_last_line():
    """The check against a promise fails on what a rotten benchmark prints."""
    promise = last_lines()["bench_rl_vs_trl.py"]
    trl = importlib.util.find_spec("trl") is not None
    good = {"yatt_s_per_step": 0.5, "trl_s_per_step": 0.4 if trl else None, "ratio": 0.8 if trl else None,
            "rows": {}, "setting": "tiny", "tiny": {}}
    assert last_line_problems(f"round 1\n{json.dumps(good)}\n", promise) == []
    assert last_line_problems("", promise) == ["printed nothing"]
    traceback_last = last_line_problems(f"{json.dumps(good)}\nTraceback ...\n", promise)
    assert traceback_last[0].startswith("the last line is not JSON")
    assert last_line_problems("[1, 2]", promise)[0].startswith("the last line is not a JSON object")
    assert last_line_problems(json.dumps({**good, "yatt_s_per_step": float("nan")}), promise) == [
        "'yatt_s_per_step' is nan, not a finite number"]
    assert last_line_problems(json.dumps({**good, "yatt_s_per_step": True}), promise) == [
        "'yatt_s_per_step' is True, not a finite number"]
    assert last_line_problems(json.dumps({k: v for k, v in good.items() if k != "rows"}), promise) == [
        "missing key 'rows'"]
    wrong_trl = {**good, "ratio": None if trl else 0.8}
    assert len(last_line_problems(json.dumps(wrong_trl), promise)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("script", benchmark_scripts())
def test_smoke_run_ends_with_the_promised_line(script, smoke_runs):
    promise = last_lines().get(script)
    assert promise is not None, f"{script}: declare its last line in benchmarks/_common.py LAST_LINES"
    run = smoke_runs(script)
    returncode, output = run.returncode, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-5000:]}"
    assert returncode is not None, f"{script} took longer than its smoke limit\n{output}"
    assert returncode == 0, f"{script} exited with {returncode}\n{output}"
    problems = last_line_problems(run.stdout, promise)
    assert not problems, f"{script}: {problems}\n{output}"
