"""tests/cpu_log.py: a test's CPU seconds include the children it waited for."""

import json
import subprocess
import sys
import time

from cpu_log import cpu_seconds, logged, summary

BUSY = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"


def test_a_blocks_cpu_seconds_count_the_child_it_waited_for_and_not_its_sleep(tmp_path):
    log = tmp_path / "cpu.jsonl"
    with logged(log, "busy child"):
        subprocess.run([sys.executable, "-c", BUSY], check=True, timeout=60)
    with logged(log, "asleep"):
        time.sleep(0.3)
    busy, asleep = [json.loads(line) for line in log.read_text().splitlines()]
    assert busy["test"] == "busy child" and busy["cpu_s"] >= 0.5  # the child's 0.5 s of a core, and its start
    assert asleep["cpu_s"] < 0.1 and asleep["wall_s"] >= 0.3
    lines = summary(log)
    assert lines[0].endswith("busy child") and lines[-1].startswith(f"{busy['cpu_s'] + asleep['cpu_s']:8.1f} CPU-s in 2")
    assert cpu_seconds() > 0
