"""Two DDP ranks (torchrun, gloo), two DataLoader workers each, two epochs over one region."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from servers import free_ports
from test_loaders import EU, region_samples, split

JOB = Path(__file__).parent / "jobs" / "ddp_loader.py"


def torchrun(plan: Path, out: Path, seed: int) -> list[dict]:
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_ports(1)[0]), str(JOB), str(plan), EU, str(out), str(seed)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]


def test_two_ranks_two_workers_two_epochs(tmp_path: Path) -> None:
    plan = split(tmp_path, samples=1500)
    total = len(region_samples(tmp_path / "split" / EU, "wds"))
    runs = [torchrun(plan, tmp_path / f"run{i}", seed=11) for i in range(2)]
    ranks = runs[0]
    for epoch in range(2):
        shares = [r["epochs"][epoch] for r in ranks]
        assert len(shares[0]) == len(shares[1]) == total // 2
        assert not set(shares[0]) & set(shares[1])
        assert len(set(shares[0] + shares[1])) == total - total % 2
    assert ranks[0]["stats"]["dropped_samples"] == total % 2
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1], "each epoch is reshuffled"
    assert [r["epochs"] for r in runs[0]] == [r["epochs"] for r in runs[1]], "same seed, same order"
