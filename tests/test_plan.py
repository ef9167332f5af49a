"""The region plan: valid plans load into frozen dataclasses; every invalid plan names its key."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from geoshard.errors import ConfigError
from geoshard.plan import DEFAULT_SHARD_BYTES, load_plan, parse_plan

FULL = """
[routing]
policy = "field"
field = "json.origin"
default_region = "us-east-1"
[routing.map]
"eu-west-1" = "eu-west-1"
"us-east-1" = "us-east-1"

[shards]
bytes = "32MB"
samples = 1000

[regions.us-east-1]
weight = 2
bucket = "s3://corpus-use1/train"
endpoint = "http://127.0.0.1:18333"
alluxio = "http://alluxio-use1:28080"
local = "/mnt/nvme/geoshard/us-east-1"

[regions.eu-west-1]
weight = 1
"""


def test_full_plan_loads_frozen_with_every_key() -> None:
    plan = parse_plan(FULL)
    assert plan.region_names == ("us-east-1", "eu-west-1")
    use1 = plan.region("us-east-1")
    assert (use1.weight, use1.bucket_name, use1.bucket_prefix) == (2, "corpus-use1", "train")
    assert use1.endpoint == "http://127.0.0.1:18333" and use1.local == "/mnt/nvme/geoshard/us-east-1"
    assert plan.routing.policy == "field" and plan.routing.lookup() == {"eu-west-1": "eu-west-1", "us-east-1": "us-east-1"}
    assert (plan.shards.bytes, plan.shards.samples) == (32_000_000, 1000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.routing = None  # type: ignore[misc,assignment]


def test_defaults_and_hashes() -> None:
    plan = parse_plan("[regions.a]\nweight = 1\n")
    assert plan.routing.policy == "hash" and plan.shards.bytes == DEFAULT_SHARD_BYTES and plan.shards.samples == 0
    # Storage targets do not change the layout hash (what decides shard contents); weights do.
    moved = parse_plan('[regions.a]\nweight = 1\nbucket = "s3://bkt/p"\n')
    heavier = parse_plan("[regions.a]\nweight = 2\n")
    assert moved.layout_sha256() == plan.layout_sha256() and moved.sha256() != plan.sha256()
    assert heavier.layout_sha256() != plan.layout_sha256()


BAD = [
    ("", "regions", "no regions"),
    ("[routing]\npolicy='hash'\n", "regions", "no regions"),
    ("[regions.a]\nweight = 0\n", "regions.a.weight", "> 0"),
    ("[regions.a]\nweight = -1\n", "regions.a.weight", "> 0"),
    ("[regions.a]\nweight = true\n", "regions.a.weight", "> 0"),
    ("[regions.a]\n", "regions.a.weight", "missing"),
    ("[regions.a]\nweight = 1\ncolour = 'red'\n", "regions.a.colour", "unknown key"),
    ("[regions.a]\nweight = 1\n[extra]\nx = 1\n", "extra", "unknown key"),
    ("[regions.a]\nweight = 1\n[routing]\npolicy = 'random'\n", "routing.policy", "must be one of"),
    ("[regions.a]\nweight = 1\nbucket = 'gs://x/y'\n", "regions.a.bucket", "s3://"),
    ("[regions.a]\nweight = 1\nbucket = 's3://'\n", "regions.a.bucket", "s3://"),
    ("[regions.a]\nweight = 1\nendpoint = 'localhost:9000'\n", "regions.a.endpoint", "http"),
    ("[regions.a]\nweight = 1\n[routing]\npolicy = 'field'\nfield = 'origin'\n", "routing.map", "needs a [routing.map]"),
    ("[regions.a]\nweight = 1\n[routing]\npolicy = 'field'\n[routing.map]\nx = 'a'\n", "routing.field", "needs the field"),
    ("[regions.a]\nweight = 1\n[routing]\npolicy = 'field'\nfield = 'o'\n[routing.map]\nx = 'mars'\n", "routing.map.x", "unknown region"),
    ("[regions.a]\nweight = 1\n[routing]\ndefault_region = 'b'\n", "routing.default_region", "unknown region"),
    ("[regions.a]\nweight = 1\n[shards]\nbytes = 'lots'\n", "shards.bytes", "size like"),
    ("[regions.a]\nweight = 1\n[shards]\nbytes = 100\n", "shards.bytes", "at least"),
    ("[regions.a]\nweight = 1\n[shards]\nsamples = -1\n", "shards.samples", ">= 0"),
    ("[regions.A_B]\nweight = 1\n", "regions.A_B", "lowercase"),
]


@pytest.mark.parametrize(("text", "key", "words"), BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_invalid_plan_names_the_key(text: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_plan(text, source="p.toml")
    msg = str(info.value)
    assert msg.startswith("p.toml") and key in msg and words in msg and "\n" not in msg
    assert info.value.exit_code == 2


def test_duplicate_key_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "plan.toml"
    p.write_text("[regions.a]\nweight = 1\nweight = 2\n")
    with pytest.raises(ConfigError) as info:
        load_plan(p)
    assert str(p) in str(info.value) and "line 3" in str(info.value)


def test_error_names_the_line_of_the_key(tmp_path: Path) -> None:
    p = tmp_path / "plan.toml"
    p.write_text("[regions.a]\nweight = 1\n\n[regions.b]\nbucket = 's3://x/y'\nweight = 0\n")
    with pytest.raises(ConfigError) as info:
        load_plan(p)
    assert f"{p}:6: regions.b.weight" in str(info.value)


def test_missing_plan_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="plan file not found"):
        load_plan(tmp_path / "nope.toml")


# One region-name rule (geoshard/plan/names.py): what the plan accepts, ``--regions`` and the WAN
# matrix accept too, and a name one refuses, all three refuse with a line that names it.
GOOD_NAME = "eu_west.2"  # '.' and '_': the plan took these before --regions did
BAD_NAMES = ["EU-West", "-eu", "eu west", "e" * 64, "eu/west"]


def _in_plan(name: str) -> None:
    parse_plan(f'[regions."{name}"]\nweight = 1\n[regions.us-east-1]\nweight = 1\n', source="p.toml")


def _in_regions_option(name: str) -> None:
    from geoshard.trainer.config import parse_regions

    assert [r.region for r in parse_regions(f"{name}:1,us-east-1:2")] == [name, "us-east-1"]


def _in_matrix(name: str) -> None:
    from geoshard.wan.matrix import parse_matrix

    assert parse_matrix(f'[[link]]\na = "{name}"\nb = "us-east-1"\nlatency_ms = 1\n', source="m.toml").regions


@pytest.mark.parametrize("accepts", [_in_plan, _in_regions_option, _in_matrix])
def test_one_region_name_rule_for_plan_regions_option_and_matrix(accepts: Callable[[str], None]) -> None:
    from geoshard.plan import is_region_name

    assert is_region_name(GOOD_NAME)
    accepts(GOOD_NAME)
    for bad in BAD_NAMES:
        assert not is_region_name(bad)
        with pytest.raises(ConfigError) as info:
            accepts(bad)
        msg = str(info.value)
        assert repr(bad) in msg and "must be a region name (lowercase letters" in msg and "\n" not in msg, msg
        assert info.value.exit_code == 2


def test_check_region_name_names_the_key() -> None:
    from geoshard.plan import check_region_name

    assert check_region_name("us-east-1", "--region") == "us-east-1"
    with pytest.raises(ConfigError, match=r"^--region: must be a region name \(.*\), got 'US'$"):
        check_region_name("US", "--region")


def test_run_files_of_any_region_name_are_read_and_guarded(tmp_path: Path) -> None:
    """The report reads ``rounds-<region>.jsonl`` and preflight guards the run folder for every name the
    plan accepts (it skipped ``rounds-dc_1.jsonl`` before: another character set)."""
    from geoshard.trainer.diloco.record import RoundRecord, append, read_rounds, rounds_path
    from geoshard.trainer.preflight import _RUN_FILE

    rec = RoundRecord.from_dict({"region": GOOD_NAME, "job": "j", "event": "join", "round": 0, "step": 0})
    append(rounds_path(tmp_path, GOOD_NAME), rec)
    assert [r.region for r in read_rounds(tmp_path)] == [GOOD_NAME]
    assert _RUN_FILE.match(rounds_path(tmp_path, GOOD_NAME).name)
    assert not _RUN_FILE.match("rounds-US.jsonl")
