"""Issue 21: a no-op ``pull`` and ``refresh`` list and compare, nothing more (no shard or source
byte read or downloaded), and a change made behind the tool's back is still caught."""

from __future__ import annotations

import json
import os
from pathlib import Path

from guaranteekit import geoshard
from servers import SeaweedS3
from synckit import make_split, sync_plan

from geoshard.manifest import read_region_manifest
from geoshard.refresh import SOURCES_STATE
from geoshard.sync.pull import STATE

EU = "eu-west-1"


def _pull(plan: Path, replica: Path, *extra: str, region: str = EU) -> dict:  # type: ignore[type-arg]
    r = geoshard("pull", "--plan", plan, "--region", region, "--to", replica, "--json", *extra, cwd=replica.parent, timeout=120)
    assert (r.rc, r.err) == (0, ""), r.err
    return json.loads(r.out)  # type: ignore[no-any-return]


def _same_size_change(path: Path, keep_mtime: bool) -> None:
    """One byte flipped in place; with ``keep_mtime`` the mtime is set back (as ``touch -r`` would)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_no_op_pull_reads_nothing_and_a_changed_file_is_still_caught(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "noop")
    aws.make_bucket(buckets[EU])
    out = make_split(tmp_path, plan)
    assert geoshard("sync", out, "--plan", plan, "--region", EU, cwd=tmp_path, timeout=120).rc == 0
    shards = read_region_manifest(out / EU).shards
    n, total = len(shards), sum(s.bytes for s in shards)
    assert n >= 3
    replica = tmp_path / "replica"
    first = _pull(plan, replica)
    assert (first["downloaded"], first["bytes_downloaded"], first["rehashed"], first["stat_matched"]) == (n, total, 0, 0)
    assert (replica / STATE).is_file()

    # The no-op: every file found by its recorded stat; nothing downloaded, nothing read.
    r = geoshard("pull", "--plan", plan, "--region", EU, "--to", replica, cwd=tmp_path, timeout=120)
    assert (r.rc, r.err) == (0, "")
    assert r.out == (
        f"{EU}: 0 shards fetched (0 bytes), {n} already present, into {replica}; checked by xxh3_128; "
        f"{n} local files unchanged by stat, 0 re-read (0 bytes)\n"
    )

    # Truncated: its size differs, so it is fetched again without being read.
    truncated = replica / shards[0].path
    truncated.write_bytes(truncated.read_bytes()[:100])
    # Same size, mtime set back: the ctime still moved, so it is read, found wrong and fetched.
    _same_size_change(replica / shards[1].path, keep_mtime=True)
    doc = _pull(plan, replica)
    assert (doc["downloaded"], doc["skipped"], doc["stat_matched"], doc["rehashed"]) == (2, n - 2, n - 2, 1)
    assert doc["bytes_downloaded"] == shards[0].bytes + shards[1].bytes and doc["bytes_rehashed"] == shards[1].bytes
    for s in shards[:2]:
        assert (replica / s.path).read_bytes() == (out / EU / s.path).read_bytes()
    again = _pull(plan, replica)
    assert (again["downloaded"], again["rehashed"], again["stat_matched"]) == (0, 0, n)

    # A change the stat cannot show (the record made to agree with the damage, as bit rot would):
    # pull trusts the record, verify re-reads everything and names the shard.
    victim = replica / shards[2].path
    _same_size_change(victim, keep_mtime=False)
    state = json.loads((replica / STATE).read_text())
    st = victim.stat()
    state["files"][shards[2].path][:4] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    (replica / STATE).write_text(json.dumps(state))
    assert _pull(plan, replica)["downloaded"] == 0
    v = geoshard("verify", replica, cwd=tmp_path, timeout=60)
    assert (v.rc, v.err, v.out) == (1, "", f"mismatched: {victim}\n{n} shards checked, 0 missing, 1 mismatched\n")

    # A lost or unreadable record: every file is read once, nothing is fetched that is correct.
    (replica / STATE).write_text("not json")
    doc = _pull(plan, replica)
    assert (doc["downloaded"], doc["rehashed"], doc["stat_matched"]) == (1, n, 0)
    assert victim.read_bytes() == (out / EU / shards[2].path).read_bytes()


def test_a_no_op_refresh_hashes_no_source_and_a_changed_source_is_split_again(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "noopref")
    out = tmp_path / "out"
    corpus = tmp_path / "corpus"
    make_split(tmp_path, plan)  # writes the corpus (and a split of it elsewhere, unused)
    sources = sorted(corpus.iterdir())
    total = sum(p.stat().st_size for p in sources)

    def refresh(*extra: str) -> dict:  # type: ignore[type-arg]
        r = geoshard("refresh", corpus, "--plan", plan, "--out", out, "--json", *extra, cwd=tmp_path, timeout=300)
        assert (r.rc, "Traceback" in r.err) == (0, False), r.err
        return json.loads(r.out)  # type: ignore[no-any-return]

    first = refresh("--create-buckets")
    assert first["split"]["generation"] == 1 and first["split"]["sources_checked"] == "hash" and (out / SOURCES_STATE).is_file()
    quiet = refresh()
    assert quiet["split"] == quiet["split"] | {"unchanged": True, "sources_checked": "stat", "source_bytes_hashed": 0, "generation": 1}
    assert all((r["uploaded"], r["bytes_read_locally"], r["published"]) == (0, 0, True) for r in quiet["sync"]["regions"].values())
    regions = sorted(quiet["sync"]["regions"])
    before = {r: {s.path for s in read_region_manifest(out / r).shards} for r in regions}
    for r in regions:
        assert _pull(plan, tmp_path / f"replica-{r}", region=r)["downloaded"] == len(before[r])

    # A source changed in place with its mtime set back: its ctime moved, so the split checks
    # every source by its bytes and splits that one's group again.
    _same_size_change(sources[0], keep_mtime=True)
    changed = refresh()
    s = changed["split"]
    assert (s["unchanged"], s["sources_checked"], s["source_bytes_hashed"], s["generation"]) == (False, "hash", total, 2)
    assert len(s["groups_run"]) >= 1
    assert sum(r["uploaded"] for r in changed["sync"]["regions"].values()) >= 1
    # The bucket changed under the replica: a pull fetches exactly the shards it lacks, and finds
    # the ones it holds by their stat.
    after = {r: {s.path for s in read_region_manifest(out / r).shards} for r in regions}
    assert any(after[r] - before[r] for r in regions)
    for r in regions:
        doc = _pull(plan, tmp_path / f"replica-{r}", region=r)
        new, kept = len(after[r] - before[r]), len(after[r] & before[r])
        assert (doc["downloaded"], doc["stat_matched"], doc["rehashed"], doc["bytes_rehashed"]) == (new, kept, 0, 0), r
    assert refresh()["split"]["sources_checked"] == "stat"
