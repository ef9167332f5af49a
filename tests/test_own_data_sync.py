"""Your own data, end to end (issue 22, items 7 and 8): ``geoshard sync`` refuses a plan that does
not match the split and a plan whose regions share a bucket prefix, before anything moves;
``geoshard pull`` fills each region's ``local =`` folder of the plan, every region at once.
Each test runs the real command in a subprocess against the SeaweedFS fixture and checks its
whole output and exit code."""

from __future__ import annotations

from pathlib import Path

from guaranteekit import Run, geoshard
from servers import SeaweedS3
from splitkit import REGIONS, make_corpus
from synckit import objects, sync_plan

US, EU, AP = REGIONS


def _split(tmp: Path, plan: Path) -> Path:
    make_corpus(tmp / "corpus", samples=300, shard_samples=100)
    r = geoshard("split", tmp / "corpus", "--plan", plan, "--out", tmp / "split", "--split-workers", "1", cwd=tmp)
    assert r.rc == 0, r.err
    return tmp / "split"


def _refused(r: Run, line: str) -> None:
    """Exit 2, nothing on stdout, and exactly this one line on stderr."""
    assert (r.rc, r.out) == (2, ""), r
    assert r.err.splitlines() == [f"geoshard: error: {line}"], r.err


def _mismatch(plan: Path, split: Path, what: str) -> str:
    return (
        f"{plan} does not match the split in {split}: {what}; re-split with this plan "
        f"(geoshard split SOURCE... --plan {plan} --out {split} --replace) or sync with the plan the split was made with"
    )


def test_sync_refuses_a_plan_whose_weights_changed_since_the_split(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "mismatch", weights=(2, 1, 1))
    for b in buckets.values():
        aws.make_bucket(b)
    split = _split(tmp_path, plan)
    plan.write_text(plan.read_text().replace("weight = 2", "weight = 1"))  # weights changed, not re-split
    r = geoshard("sync", split, "--plan", plan, cwd=tmp_path)
    _refused(r, _mismatch(plan, split, f"weights differ (split -> plan: {US} 2 -> 1)"))
    assert all(objects(aws, b) == {} for b in buckets.values())  # nothing uploaded


def test_sync_refuses_a_plan_with_a_region_the_split_lacks(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "addregion")
    split = _split(tmp_path, plan)
    plan.write_text(plan.read_text() + '[regions.sa-east-1]\nweight = 1\nbucket = "s3://gs-addregion-sa/train"\n')
    r = geoshard("sync", split, "--plan", plan, "--dry-run", cwd=tmp_path)
    _refused(r, _mismatch(plan, split, "the plan has region(s) sa-east-1 the split lacks"))


def test_two_regions_sharing_one_bucket_prefix_are_refused_by_the_plan_check(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "shared")
    split = _split(tmp_path, plan)
    text = plan.read_text().replace(f"s3://{buckets[AP]}/train", f"s3://{buckets[EU]}/train")
    plan.write_text(text)
    r = geoshard("sync", split, "--plan", plan, cwd=tmp_path)
    line = text.splitlines().index(f'bucket = "s3://{buckets[EU]}/train"', text.splitlines().index(f"[regions.{AP}]")) + 1
    _refused(
        r,
        f"{plan}:{line}: regions.{AP}.bucket: regions {EU} and {AP} share s3://{buckets[EU]}/train "
        "(the same prefix); give each region its own bucket or prefix",
    )


def test_pull_fills_every_region_with_a_local_folder_and_says_which_it_skipped(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "pullall")
    split = _split(tmp_path, plan)
    assert geoshard("sync", split, "--plan", plan, "--create-buckets", "--json", cwd=tmp_path).rc == 0
    replica = {US: tmp_path / "replica-us", EU: tmp_path / "replica-eu"}
    text = plan.read_text()
    for region, folder in replica.items():
        text = text.replace(f"[regions.{region}]\n", f'[regions.{region}]\nlocal = "{folder}"\n')
    plan.write_text(text)

    r = geoshard("pull", "--plan", plan, cwd=tmp_path)
    assert (r.rc, r.err) == (0, ""), r
    lines = r.out.splitlines()
    assert len(lines) == 3, r.out
    for line, region in zip(lines[:2], (US, EU), strict=True):
        assert line.startswith(f"{region}: ") and line.endswith(f" already present, into {replica[region]}; checked by xxh3_128"), line
        assert " shards fetched (" in line and not line.startswith(f"{region}: 0 shards"), line
    assert lines[2] == f"{AP}: skipped (no regions.{AP}.local in the plan)"
    for folder in replica.values():
        assert geoshard("verify", folder, cwd=tmp_path).rc == 0

    again = geoshard("pull", "--plan", plan, "--region", EU, cwd=tmp_path)  # --to defaults to the region's local
    assert (again.rc, again.err) == (0, ""), again
    shards = len(list((split / EU).glob("*.tar")))
    line = f"{EU}: 0 shards fetched (0 bytes), {shards} already present, into {replica[EU]}; checked by xxh3_128"
    assert again.out.splitlines() == [f"{line}; {shards} local files unchanged by stat, 0 re-read (0 bytes)"]


def test_pull_without_a_folder_for_the_region_is_one_line(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "pullnone")
    r = geoshard("pull", "--plan", plan, "--region", AP, cwd=tmp_path)
    _refused(r, f"region {AP}: no --to, and the plan sets no regions.{AP}.local; pass --to DIR or set it")
    r = geoshard("pull", "--plan", plan, cwd=tmp_path)
    _refused(r, f"{plan}: no region has a local folder; set regions.<name>.local, or pass --region R --to DIR")
    r = geoshard("pull", "--plan", plan, "--to", tmp_path / "x", cwd=tmp_path)
    _refused(r, f"--to {tmp_path / 'x'}: the replica of one region; name it with --region (the plan has {US}, {EU}, {AP})")
    assert not (tmp_path / "x").exists()
