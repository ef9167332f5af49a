"""The CLI through click's CliRunner: results, exit codes, and one-line errors for bad input
with nothing published."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from splitkit import make_corpus, tar_bytes, write_plan

from geoshard.cli import main
from geoshard.formats import tfrecord
from geoshard.formats.example import encode_example


@pytest.fixture(scope="module")
def scheduler() -> Iterator[str]:
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        yield cluster.scheduler_address


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def split(scheduler: str, tmp_path: Path, *sources: str | Path, plan: Path | None = None, extra: tuple[str, ...] = ()) -> Result:
    plan = plan or write_plan(tmp_path / "plan.toml")
    return run("split", *sources, "--plan", plan, "--out", tmp_path / "out", "--scheduler", scheduler, *extra)


def assert_one_line_error(result: Result, code: int, *words: str) -> None:
    assert result.exit_code == code, result.output
    err = result.stderr.strip()
    assert err.startswith("geoshard: error: ") and "\n" not in err, err
    assert "Traceback" not in result.output
    for w in words:
        assert w in err, err


def assert_nothing_published(out: Path) -> None:
    assert not (out / "manifest.json").exists()
    assert not [p for p in out.rglob("*") if p.is_file() and p.suffix in (".tar", ".tfrecord", ".json")] if out.exists() else True


def test_split_json_verify_and_inspect(tmp_path: Path, scheduler: str) -> None:
    make_corpus(tmp_path / "c", samples=900)
    r = split(scheduler, tmp_path, tmp_path / "c", extra=("--json",))
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["samples_in"] == 900 and sum(x["samples"] for x in doc["regions"].values()) == 900
    assert set(doc["regions"]) == {"us-east-1", "eu-west-1", "ap-southeast-1"}
    v = run("verify", tmp_path / "out")
    assert v.exit_code == 0 and "0 missing, 0 mismatched" in v.output
    i = run("inspect", tmp_path / "out")
    assert i.exit_code == 0 and "us-east-1" in i.output and "generation 1" in i.output
    ij = json.loads(run("inspect", tmp_path / "out", "--json").stdout)
    assert ij["regions"] == doc["regions"]


def test_split_table_with_default_in_process_cluster(tmp_path: Path) -> None:
    make_corpus(tmp_path / "c", samples=300)
    r = run("split", tmp_path / "c", "--plan", write_plan(tmp_path / "plan.toml"), "--out", tmp_path / "out", "--workers", "1")
    assert r.exit_code == 0, r.output
    assert "ap-southeast-1" in r.stdout and "300 samples" in r.stdout


def test_verify_reports_missing_and_altered_shards(tmp_path: Path, scheduler: str) -> None:
    make_corpus(tmp_path / "c", samples=600)
    assert split(scheduler, tmp_path, tmp_path / "c").exit_code == 0
    shards = sorted((tmp_path / "out").glob("*/*.tar"))
    shards[0].unlink()
    data = bytearray(shards[1].read_bytes())
    data[700] ^= 1
    shards[1].write_bytes(bytes(data))
    r = run("verify", tmp_path / "out")
    assert r.exit_code == 1
    assert f"missing: {shards[0]}" in r.output and f"mismatched: {shards[1]}" in r.output


def test_synth_both_formats(tmp_path: Path) -> None:
    r = run("synth", tmp_path / "w", "--samples", "50", "--sample-bytes", "64", "--shard-samples", "20", "--origins", "a,b")
    assert r.exit_code == 0 and len(list((tmp_path / "w").glob("*.tar"))) == 3
    r = run("synth", tmp_path / "t", "--format", "tfrecord", "--samples", "10", "--shard-samples", "10")
    assert r.exit_code == 0
    with open(tmp_path / "t" / "train-00000.tfrecord", "rb") as f:
        assert len(list(tfrecord.iter_records(f, "t"))) == 10


# --- bad input: one test each -----------------------------------------------------------------


def test_missing_source(tmp_path: Path, scheduler: str) -> None:
    r = split(scheduler, tmp_path, tmp_path / "nope" / "train-{000..003}.tar")
    assert_one_line_error(r, 2, "train-{000..003}.tar", "source not found")
    assert_nothing_published(tmp_path / "out")


def test_empty_source(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "empty.tar").write_bytes(b"")
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "empty.tar"), 1, "empty.tar", "empty source file")
    assert_nothing_published(tmp_path / "out")


def test_not_a_tar(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "notes.tar").write_text("just some notes\n" * 100)
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "notes.tar"), 1, "notes.tar", "not a tar archive")
    assert_nothing_published(tmp_path / "out")


def test_not_a_tfrecord(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "x.tfrecord").write_text("not records at all\n" * 100)
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "x.tfrecord"), 1, "x.tfrecord", "bad length CRC in record 0")
    assert_nothing_published(tmp_path / "out")


def test_unknown_format(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "data.bin").write_text("hello")
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "data.bin"), 2, "data.bin", "cannot tell the format")


def _records(n: int) -> bytes:
    return b"".join(tfrecord.frame(encode_example({"key": f"k{i}".encode(), "origin": b"eu-west-1"})) for i in range(n))


def test_truncated_tfrecord_names_file_and_offset(tmp_path: Path, scheduler: str) -> None:
    data = _records(20)
    (tmp_path / "t.tfrecord").write_bytes(data[:-7])
    last = len(data) - len(_records(20)[len(_records(19)) :])
    r = split(scheduler, tmp_path, tmp_path / "t.tfrecord")
    assert_one_line_error(r, 1, "t.tfrecord", f"truncated TFRecord at byte {last}: record 19")
    assert_nothing_published(tmp_path / "out")


def test_bad_crc_names_file_and_record(tmp_path: Path, scheduler: str) -> None:
    data = bytearray(_records(20))
    data[len(_records(5)) + 14] ^= 0x40
    (tmp_path / "t.tfrecord").write_bytes(bytes(data))
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "t.tfrecord"), 1, "t.tfrecord", "bad data CRC in record 5")
    assert_nothing_published(tmp_path / "out")


def test_member_belonging_to_no_sample(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "a.tar").write_bytes(tar_bytes([(b"s1.jpg", b"1"), (b"LICENSE", b"MIT")]))
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "a.tar"), 1, "a.tar", "'LICENSE'", "belongs to no sample")
    assert_nothing_published(tmp_path / "out")


def test_duplicate_key_across_files(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.tar").write_bytes(tar_bytes([(f"s{i}.jpg".encode(), b"x" * 300) for i in range(300)]))
    (tmp_path / "c" / "b.tar").write_bytes(tar_bytes([(f"t{i}.jpg".encode(), b"y" * 300) for i in range(299)] + [(b"s17.jpg", b"z")]))
    plan = write_plan(tmp_path / "plan.toml", shard_bytes="4KB")  # small groups: one file per Dask task
    r = split(scheduler, tmp_path, tmp_path / "c", plan=plan)
    assert_one_line_error(r, 1, "duplicate sample key 's17'", "a.tar", "b.tar")
    assert_nothing_published(tmp_path / "out")


def test_duplicate_key_within_a_file(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "a.tar").write_bytes(tar_bytes([(b"s1.jpg", b"1"), (b"s2.jpg", b"2"), (b"s1.cls", b"3")]))
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "a.tar"), 1, "a.tar", "duplicate sample key 's1'")
    assert_nothing_published(tmp_path / "out")


def test_key_with_newline(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "a.tar").write_bytes(tar_bytes([(b"ok.jpg", b"1"), (b"bad\nkey.jpg", b"2")]))
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "a.tar"), 1, "a.tar", "control character")
    assert_nothing_published(tmp_path / "out")


def test_tfrecord_key_feature_missing(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "t.tfrecord").write_bytes(_records(3))
    plan = write_plan(tmp_path / "plan.toml", extra='key = "sample_id"')
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "t.tfrecord", plan=plan), 1, "record 0 has no feature 'sample_id'")


@pytest.mark.parametrize(
    ("plan_text", "words"),
    [
        ("[routing]\npolicy = 'hash'\n", "no regions"),
        ("[regions.a]\nweight = 1\n[regions.a]\nweight = 2\n", "invalid TOML"),
        ("[regions.a]\nweight = 1\nzone = 'x'\n", "regions.a.zone: unknown key"),
        ("[regions.a]\nweight = 0\n", "regions.a.weight"),
        ("[regions.a]\nweight = 1\n[routing]\npolicy = 'field'\nfield = 'origin'\n", "routing.map"),
        (
            "[regions.a]\nweight = 1\n[routing]\npolicy = 'field'\nfield = 'o'\n[routing.map]\nx = 'b'\n",
            "routing.map.x: maps to unknown region 'b'",
        ),
        ("[regions.a]\nweight = 1\nbucket = 'https://x/y'\n", "regions.a.bucket"),
    ],
)
def test_bad_plan_exits_2(tmp_path: Path, scheduler: str, plan_text: str, words: str) -> None:
    make_corpus(tmp_path / "c", samples=10)
    (tmp_path / "bad.toml").write_text(plan_text)
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "c", plan=tmp_path / "bad.toml"), 2, "bad.toml", words)
    assert_nothing_published(tmp_path / "out")


def test_out_holding_a_different_plan(tmp_path: Path, scheduler: str) -> None:
    make_corpus(tmp_path / "c", samples=100)
    assert split(scheduler, tmp_path, tmp_path / "c").exit_code == 0
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    other = write_plan(tmp_path / "other.toml", weights=(1, 1, 1))
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "c", plan=other), 2, "holds a split of a different plan", "--replace")
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before


def test_field_routing_json_with_tfrecord_is_a_config_error(tmp_path: Path, scheduler: str) -> None:
    (tmp_path / "t.tfrecord").write_bytes(_records(3))
    plan = write_plan(tmp_path / "plan.toml", policy="field")
    assert_one_line_error(split(scheduler, tmp_path, tmp_path / "t.tfrecord", plan=plan), 2, "routing.field", "name a feature")


def test_regions_option_refuses_a_bad_region_name_in_one_line(tmp_path: Path) -> None:
    """`geoshard train --regions` applies the plan's region-name rule (geoshard/plan/names.py)."""
    plan = write_plan(tmp_path / "plan.toml")
    r = run("train", "--plan", plan, "--out", tmp_path / "run", "--steps", "1", "--regions", "EU-West:1")
    assert_one_line_error(r, 2, "--regions", "'EU-West'", "must be a region name")
    assert not (tmp_path / "run").exists()
