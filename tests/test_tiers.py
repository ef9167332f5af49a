"""One contract every storage tier passes (local replica, S3 on SeaweedFS, Alluxio through the
real client and the worker stand-in), mixed into a test class per tier, fsspec-style."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import SeaweedS3

from geoshard.loaders.local_tier import LocalTier
from geoshard.loaders.tier import TIER_KINDS, Tier, TierDefaults, TierMissing, WritableTier, make_tier, register_tier, tier_class

SHARD = "00001-0000-0123456789ab.tar"  # a name of geoshard's shard pattern: a replica may remove it
FILES = {"a.tar": os.urandom(3000), "sub/b.tar": os.urandom((1 << 20) + 7), "one.tar": b"x", SHARD: os.urandom(500)}


class TierContract:
    """Subclasses provide a ``tier`` fixture serving FILES."""

    def test_stat_gives_sizes_and_none_when_absent(self, tier: Tier) -> None:
        assert isinstance(tier, Tier)
        for path, data in FILES.items():
            assert tier.stat(path) == len(data)
        assert tier.stat("nope.tar") is None

    def test_read_is_byte_identical(self, tier: Tier) -> None:
        for path, data in FILES.items():
            assert tier.read(path) == data

    @pytest.mark.parametrize(("offset", "length"), [(0, 1), (10, 100), ((1 << 20) - 3, 9), (1 << 20, 7)])
    def test_read_range(self, tier: Tier, offset: int, length: int) -> None:
        data = FILES["sub/b.tar"]
        assert tier.read_range("sub/b.tar", offset, length) == data[offset : offset + length]

    def test_read_range_with_progress_reports_at_most_what_arrived(self, tier: Tier) -> None:
        data, seen = FILES["sub/b.tar"], []
        got = tier.read_range("sub/b.tar", 5, 300_000, seen.append)
        assert bytes(got) == data[5:300_005] and sum(seen) <= 300_000

    def test_view_is_byte_identical(self, tier: Tier) -> None:
        for path, data in FILES.items():
            assert bytes(tier.view(path)) == data

    def test_writable_says_whether_it_is_a_replica_to_write_to(self, tier: Tier) -> None:
        assert isinstance(tier.writable, bool) and tier.writable == isinstance(tier, WritableTier)

    def test_remove_corrupt_drops_a_replica_copy_and_leaves_read_only_tiers_alone(self, tier: Tier) -> None:
        tier.remove_corrupt(SHARD)
        if tier.writable:
            assert tier.stat(SHARD) is None
        else:
            assert tier.read(SHARD) == FILES[SHARD]

    def test_missing_object_is_a_miss_not_a_failure(self, tier: Tier) -> None:
        with pytest.raises(TierMissing):
            tier.read("nope.tar")


def _write(root: Path) -> Path:
    for path, data in FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return root


class TestLocalTier(TierContract):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Tier:
        return LocalTier(_write(tmp_path), region="eu-west-1")

    def test_write_is_atomic_and_eviction_keeps_the_limit(self, tmp_path: Path) -> None:
        t = LocalTier(tmp_path / "r", limit_bytes=10_000)
        for i in range(5):
            t.write(f"0000{i}-0000-00000000000{i}.tar", bytes(4000))
        kept = sorted(p.name for p in (tmp_path / "r").iterdir())
        assert sum((tmp_path / "r" / k).stat().st_size for k in kept) <= 10_000 and "00004-0000-000000000004.tar" in kept
        assert not [p for p in (tmp_path / "r").iterdir() if p.name.endswith(".partial")]

    def test_paths_outside_the_replica_are_refused(self, tmp_path: Path) -> None:
        with pytest.raises(Exception, match="outside the replica"):
            LocalTier(tmp_path).read("../etc/passwd")


class DictTier(TierDefaults):
    """A tier with only ``stat`` and ``read``: the defaults give it the rest of the protocol."""

    kind, name, region = "dict", "dict:test", "eu-west-1"

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def stat(self, path: str) -> int | None:
        return len(self.files[path]) if path in self.files else None

    def read(self, path: str) -> bytes:
        if path not in self.files:
            raise TierMissing(f"{self.name}: {path}")
        return self.files[path]


class TestTierDefaults(TierContract):
    @pytest.fixture
    def tier(self) -> Tier:
        return DictTier(dict(FILES))


@pytest.fixture(scope="module")
def bucket(s3: SeaweedS3) -> str:
    s3.make_bucket("tier-contract")
    with contextlib.closing(s3.client()) as c:
        for path, data in FILES.items():
            c.put_object(Bucket="tier-contract", Key=f"train/{path}", Body=data)
    return "tier-contract"


class TestS3Tier(TierContract):
    @pytest.fixture
    def tier(self, bucket: str, aws: SeaweedS3) -> Iterator[Tier]:
        t = make_tier("s3", bucket=bucket, prefix="train", endpoint=aws.endpoint, region="us-east-1", timeout_s=5)
        yield t
        t.client.close()  # type: ignore[attr-defined]


def _model(client: object) -> object:
    return client.meta.service_model._service_description  # type: ignore[attr-defined]  # botocore's parsed JSON: no public handle


def test_s3_clients_share_the_parsed_service_model_and_nothing_else(aws: SeaweedS3) -> None:
    from geoshard import s3

    a, b = s3.client(aws.endpoint, region="us-east-1"), s3.client(aws.endpoint, region="eu-west-1")
    with contextlib.closing(a), contextlib.closing(b):
        assert _model(a) is _model(b)  # parsed once (about 60 ms of a core each time otherwise)
        assert a.meta.events is not b.meta.events  # a session each: handlers, credentials
        assert a._endpoint.http_session is not b._endpoint.http_session  # type: ignore[attr-defined]  # a pool each
        assert a.meta.region_name == "us-east-1" and b.meta.region_name == "eu-west-1"
    # boto3 adds its data folder to the loader's search paths per session: not once per client
    paths = list(s3._botocore_session().get_component("data_loader").search_paths)
    for _ in range(5):
        s3.client(aws.endpoint).close()
    assert s3._botocore_session().get_component("data_loader").search_paths == paths
    assert len(paths) == len(set(paths)), paths


def test_a_forked_workers_s3_client_reads_on_the_inherited_model(aws: SeaweedS3, bucket: str) -> None:
    """What a DataLoader worker does: fork from a process that has a client, make its own, read."""
    from geoshard import s3

    with contextlib.closing(s3.client(aws.endpoint, region="us-east-1")) as parent:
        model = _model(parent)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one byte says what it saw, and it leaves without pytest's teardown
            code = b"?"
            try:
                c = s3.client(aws.endpoint, region="us-east-1")
                body = c.get_object(Bucket=bucket, Key="train/a.tar")["Body"].read()
                code = b"1" if body == FILES["a.tar"] and _model(c) is model else b"0"
            finally:
                os.write(w, code)
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            seen = f.read()
        os.waitpid(pid, 0)
    assert seen == b"1"


class TestAlluxioTier(TierContract):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[Tier]:
        from alluxio_standin import AlluxioWorkerStandIn

        with AlluxioWorkerStandIn(_write(tmp_path), "s3://standin/train") as worker:
            t = make_tier("alluxio", url=worker.url, ufs_root="s3://standin/train", region="eu-west-1")
            yield t
            t.close()  # type: ignore[attr-defined]


def test_registry_is_read_only_and_explicit() -> None:
    assert set(TIER_KINDS) >= {"local", "s3", "alluxio"}
    with pytest.raises(TypeError):
        TIER_KINDS["x"] = ("m", "c", "")  # type: ignore[index]
    with pytest.raises(ValueError, match="already registered"):
        register_tier("local", "m", "C")
    with pytest.raises(Exception, match="unknown tier kind 'nfs'"):
        tier_class("nfs")
