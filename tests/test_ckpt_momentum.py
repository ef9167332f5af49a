"""Issue 23's leftovers: under p2p the checkpoint's outer momentum is gathered to the region's
leader only (``resume.gathered``), so a rank other than the leader never holds the whole fp32
vector while a checkpoint is written. Real processes (gloo on 127.0.0.1) through
``bench/ckpt_momentum_bench.py``, against the broadcast gather it replaced, in the same run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\s*([\d,]+)\s+(broadcast|leader)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(yes|NO)$")


@pytest.mark.slow
def test_the_checkpoints_momentum_is_gathered_to_the_leader_only() -> None:
    """One region of 3 ranks in a job whose S is 4 (in-region rank 0 owns shards 0 and 3), 20 M
    values (80 MB): every shard is two pieces (4 M + 1 M values). The leader gets every value
    (checked there), and the others' extra peak RSS stays under 4 MB where the broadcast's was the
    whole vector; the leader's is the vector it saves, as before."""
    argv = [sys.executable, "bench/ckpt_momentum_bench.py", "--sizes", "20", "--ranks", "3", "--shards", "4"]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 5, r.stdout
    assert lines[0] == "checkpoint momentum gather: 3 ranks, S=4, gloo on 127.0.0.1, pieces of 16 MiB"
    assert lines[1].split() == ["values", "variant", "leader", "MB", "other", "MB", "own", "MB", "seconds", "load", "checked"]
    whole = 80.0  # MB
    rows = {}
    for line in lines[2:4]:
        m = ROW.match(line)
        assert m, line
        assert m[1] == "20,000,000" and m[8] == "yes", line  # every value checked on the leader; None when a rank holds none
        rows[m[2]] = (float(m[3]), float(m[4]), float(m[5]))
    assert list(rows) == ["broadcast", "leader"]
    (lb, ob, own), (ll, ol, _) = rows["broadcast"], rows["leader"]
    assert own == 20.0  # the last rank's one shard of 5 M values
    assert ob >= 0.95 * whole and lb >= 0.95 * whole, rows  # before: the whole vector on every rank
    assert ol < 4.0, rows  # now: its own shards, sent in place (CPU), and nothing more
    assert 0.95 * whole <= ll <= whole + 8.0, rows  # the leader: the vector it saves
    m = re.match(r"^\s*20,000,000\s+ratio\s+([\d.]+)\s+([\d.]+)\s+\(leader / broadcast\)$", lines[4])
    assert m and float(m[2]) < 0.05 and 0.9 <= float(m[1]) <= 1.1, lines[4]
