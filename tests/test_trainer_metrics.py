"""The trainer serves its live metrics while it trains (one rank, in-process, gloo)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from servers import free_ports
from test_loaders import EU, split

from geoshard.trainer.config import TrainConfig
from geoshard.trainer.loop import train


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*rank=\"0\"[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


def test_metrics_are_served_while_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = split(tmp_path, samples=1500)
    master, metrics = free_ports(2)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    # num_workers=0: DataLoader workers must fork off the main thread, and this loop runs in another.
    cfg = TrainConfig(plan=plan, out=tmp_path / "run", steps=300, region=EU, num_workers=0, metrics_port=metrics, hidden=256)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            train(cfg)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    seen = None
    deadline = time.monotonic() + 120
    while t.is_alive() and time.monotonic() < deadline:
        text = _scrape(metrics)
        if text and "geoshard_samples_total{" in text and _value(text, "geoshard_samples_total") >= 64:
            seen = text
            break
        time.sleep(0.05)
    t.join(120)
    assert not errors, errors
    assert seen is not None, "no metrics were served during training"
    assert _value(seen, "geoshard_data_wait_seconds_total") > 0
    assert 0 <= _value(seen, "geoshard_io_wait_share") <= 1
    assert f'tier="local:{EU}"' in seen and 'region="eu-west-1"' in seen
    assert _scrape(metrics) is None, "the server stops with the training loop"
