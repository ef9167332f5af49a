"""geoshard.sync.probe against SeaweedFS on 127.0.0.1, one region reached through bench/netproxy.py.

The plan's regions all point at the same server: ``near`` directly, ``far`` through a proxy that
adds 40 ms each way, ``down`` at a port nothing listens on. Credentials only come from the
environment (the AWS SDK chain), as in production.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import SeaweedS3, closed_port

from geoshard.plan import Plan, parse_plan
from geoshard.sync.probe import PROBE_OBJECT, ProbeResult, ProbeSettings, display_endpoint, probe, render_heatmap, render_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from netproxy import NetProxy

BUCKET = "probe-data"
PREFIX = "eu"
LATENCY = 0.04
SHARD_BYTES = 5 * 10**6


def _plan(**regions: tuple[str, str]) -> Plan:
    text = "".join(
        f'[regions.{name}]\nweight = 1\nbucket = "{bucket}"\nendpoint = "{endpoint}"\n' for name, (bucket, endpoint) in regions.items()
    )
    return parse_plan(text)


@pytest.fixture(scope="module")
def data(s3: SeaweedS3) -> str:
    """``s3://probe-data/eu`` with a region manifest and one 5 MB shard."""
    s3.make_bucket(BUCKET)
    with contextlib.closing(s3.client()) as c:
        c.put_object(Bucket=BUCKET, Key=f"{PREFIX}/manifest.json", Body=json.dumps({"version": 1, "shards": []}).encode())
        c.put_object(Bucket=BUCKET, Key=f"{PREFIX}/train-00000.tar", Body=bytes(range(256)) * (SHARD_BYTES // 256))
    return f"s3://{BUCKET}/{PREFIX}"


@pytest.fixture
def aws_env(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in s3.UNSET_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in s3.env(endpoint=False).items():  # the plan names every endpoint
        monkeypatch.setenv(k, v)


@pytest.fixture
def far(s3: SeaweedS3) -> Iterator[NetProxy]:
    with NetProxy.to_url(s3.endpoint, latency_s=LATENCY) as link:
        yield link


def _secrets_absent(s3: SeaweedS3, *texts: str) -> None:
    for text in texts:
        assert s3.secret_key not in text
        assert s3.access_key not in text


@pytest.mark.usefixtures("aws_env")
def test_probe_matrix_near_far_and_down(s3: SeaweedS3, data: str, far: NetProxy, tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{closed_port()}"
    plan = _plan(near=(data, s3.endpoint), far=(data, far.endpoint), down=(data, down))
    t0 = time.perf_counter()
    result = probe(plan, ProbeSettings(samples=5), origin="test-host")
    elapsed = time.perf_counter() - t0

    assert result.regions == ("near", "far", "down")
    near, far_cell, down_cell = (result.cell(n) for n in result.regions)
    assert near.ok and far_cell.ok, (near.error, far_cell.error)
    assert near.latency_samples == far_cell.latency_samples == 10
    assert near.latency_ms_median is not None and near.latency_ms_median < 40
    assert far_cell.latency_ms_median is not None and far_cell.latency_ms_median >= 2 * LATENCY * 1e3
    assert far_cell.latency_ms_p90 is not None and far_cell.latency_ms_p90 >= far_cell.latency_ms_median
    for c in (near, far_cell):
        assert c.throughput_mb_s is not None and c.throughput_mb_s > 0
        assert c.throughput_bytes == 4 * 10**6  # a 4 MB range of the 5 MB shard, the largest object
        assert c.throughput_key == f"{PREFIX}/train-00000.tar"
        assert c.upload_mb_s is None  # nothing written without write=True
    # A 4 MB GET over 2 x 40 ms cannot beat 4 MB / 80 ms.
    assert far_cell.throughput_mb_s is not None and far_cell.throughput_mb_s <= 4 / (2 * LATENCY)

    assert down_cell.error is not None and down in down_cell.error
    assert down_cell.latency_ms_median is None and down_cell.throughput_mb_s is None
    assert down_cell.seconds < 10
    assert elapsed < 20

    text = render_text(result)
    doc = json.dumps(result.to_dict())
    assert ProbeResult.from_dict(json.loads(doc)) == result
    assert "test-host" in text and "near" in text and down in text
    _secrets_absent(s3, text, doc, repr(result))

    png = render_heatmap(result, tmp_path / "probe.png")
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 5000
    from matplotlib.image import imread

    image = imread(png)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[1] > image.shape[0] > 100  # a wide row of three region cells
    print(f"\nnear {near}\nfar {far_cell}\ndown {down_cell.error} in {down_cell.seconds:.3f} s\n{text}")


@pytest.mark.usefixtures("aws_env")
def test_cut_link_is_an_error_cell_not_an_exception(s3: SeaweedS3, data: str, far: NetProxy) -> None:
    far.cut()
    result = probe(_plan(far=(data, far.endpoint)), ProbeSettings(samples=2))
    cell = result.cell("far")
    assert cell.error is not None and far.endpoint in cell.error and "cannot connect" in cell.error
    assert cell.seconds < 5


@pytest.mark.usefixtures("aws_env")
def test_empty_prefix_measures_nothing_unless_writing_is_allowed(s3: SeaweedS3) -> None:
    s3.make_bucket("probe-empty")
    plan = _plan(empty=("s3://probe-empty/fresh", s3.endpoint))

    read_only = probe(plan, ProbeSettings(samples=2)).cell("empty")
    assert read_only.ok and read_only.latency_samples == 4
    assert read_only.throughput_mb_s is None and read_only.throughput_key is None

    written = probe(plan, ProbeSettings(samples=2, write=True)).cell("empty")
    assert written.ok, written.error
    assert written.throughput_key == f"fresh/{PROBE_OBJECT}" and written.throughput_bytes == 4 * 10**6
    assert written.throughput_mb_s is not None and written.throughput_mb_s > 0
    assert written.upload_mb_s is not None and written.upload_mb_s > 0
    with contextlib.closing(s3.client()) as c:  # the probe object is removed again
        assert c.list_objects_v2(Bucket="probe-empty", Prefix="fresh/").get("KeyCount", 0) == 0


@pytest.mark.usefixtures("aws_env")
def test_missing_bucket_and_wrong_secret_are_error_cells(s3: SeaweedS3, data: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(nobucket=("s3://no-such-probe-bucket/x", s3.endpoint), ok=(data, s3.endpoint))
    result = probe(plan, ProbeSettings(samples=1))
    assert result.cell("ok").ok
    err = result.cell("nobucket").error
    assert err is not None and "does not exist" in err and s3.endpoint in err

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + s3.secret_key)
    denied = probe(plan, ProbeSettings(samples=1))
    for cell in denied.cells:
        assert cell.error is not None and s3.endpoint in cell.error and "HeadBucket" in cell.error
    _secrets_absent(s3, render_text(denied), json.dumps(denied.to_dict()))
    assert "wrong-" not in render_text(denied) + json.dumps(denied.to_dict())


@pytest.mark.usefixtures("aws_env")
def test_missing_profile_and_folder_markers(s3: SeaweedS3) -> None:
    s3.make_bucket("probe-markers")
    with contextlib.closing(s3.client()) as c:
        c.put_object(Bucket="probe-markers", Key="m/", Body=b"")  # a zero-byte "folder": no ranged GET of it
        c.put_object(Bucket="probe-markers", Key="m/a.tar", Body=b"a" * 1000)
    plan = parse_plan(
        f'[regions.p]\nweight = 1\nbucket = "s3://probe-markers/p"\nendpoint = "{s3.endpoint}"\nprofile = "no-such-profile"\n'
        f'[regions.m]\nweight = 1\nbucket = "s3://probe-markers/m"\nendpoint = "{s3.endpoint}"\n'
    )
    result = probe(plan, ProbeSettings(samples=1))
    err = result.cell("p").error
    assert err is not None and "regions.p.profile" in err and s3.endpoint in err
    markers = result.cell("m")
    assert markers.ok, markers.error
    assert markers.throughput_key == "m/a.tar" and markers.throughput_bytes == 1000


def test_regions_without_bucket_are_skipped_and_unknown_names_rejected() -> None:
    from geoshard.errors import ConfigError

    plan = parse_plan("[regions.a]\nweight = 1\n[regions.b]\nweight = 1\n")
    result = probe(plan)
    assert result.cells == () and result.skipped == ("a", "b")
    assert "not probed (no bucket): a, b" in render_text(result)
    with pytest.raises(ConfigError, match="unknown region 'c'"):
        probe(plan, ProbeSettings(regions=("c",)))


def test_endpoints_are_shown_without_user_and_password() -> None:
    assert display_endpoint("https://AKIAXX:s3cr3t@s3.example.com:9000/path?X-Amz-Signature=1") == "https://s3.example.com:9000/path"
    assert display_endpoint(None) == "the default AWS endpoint"


def test_heatmap_of_several_hosts_without_global_matplotlib_state(tmp_path: Path) -> None:
    import matplotlib
    from matplotlib.image import imread

    doc: dict[str, Any] = {
        "origin": "host-eu",
        "created": "2026-01-01T00:00:00+00:00",
        "cells": [
            {"region": "eu", "url": "s3://b/eu", "endpoint": "http://127.0.0.1:1", "latency_ms_median": 1.5, "latency_ms_p90": 2.0},
            {"region": "us", "url": "s3://b/us", "endpoint": "http://127.0.0.1:2", "latency_ms_median": 82.0, "latency_ms_p90": 90.0},
        ],
    }
    eu = ProbeResult.from_dict(doc)
    us = ProbeResult.from_dict(
        {**doc, "origin": "host-us", "cells": [{**doc["cells"][1], "latency_ms_median": 1.2}, {**doc["cells"][0], "error": "x"}]}
    )
    backend, pyplot_loaded = matplotlib.rcParams["backend"], "matplotlib.pyplot" in sys.modules
    png = render_heatmap([eu, us], tmp_path / "two.png")
    assert imread(png).shape[0] > 100
    assert matplotlib.rcParams["backend"] == backend
    assert ("matplotlib.pyplot" in sys.modules) == pyplot_loaded
    text = render_text([eu, us])
    assert text.splitlines()[1].split()[:3] == ["from", "\\", "to"]
    assert "host-us -> eu: x" in text


def test_probe_cli_prints_the_matrix_writes_the_png_and_fails_on_a_dead_region(
    s3: SeaweedS3, data: str, aws_env: None, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from geoshard.cli import main

    plan = tmp_path / "plan.toml"
    dead = f"http://127.0.0.1:{closed_port()}"
    plan.write_text(
        f'[regions.near]\nweight = 1\nbucket = "{data}"\nendpoint = "{s3.endpoint}"\n'
        f'[regions.gone]\nweight = 1\nbucket = "{data}"\nendpoint = "{dead}"\n'
    )
    r = CliRunner().invoke(main, ["probe", "--plan", str(plan), "--png", str(tmp_path / "m.png"), "--json"])
    assert r.exit_code == 1, r.output  # one region is down
    doc = json.loads(r.stdout)
    cells = {c["region"]: c for c in doc["cells"]}
    assert cells["near"]["latency_ms_median"] > 0 and cells["near"]["error"] is None
    assert dead in cells["gone"]["error"]
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = CliRunner().invoke(main, ["probe", "--plan", str(plan), "--region", "near", "--png", str(tmp_path / "n.png")])
    assert text.exit_code == 0 and "near" in text.stdout and "heatmap:" in text.stdout
