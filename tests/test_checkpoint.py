"""Checkpoints: round trips (local folder and SeaweedFS), atomic pointer moves under failing writes,
retries with exact delays, keep-last pruning, fallback past a corrupt newest, no secrets in errors."""

from __future__ import annotations

import contextlib
import fractions
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import torch
from servers import SeaweedS3, free_ports

from geoshard.errors import ConfigError, DataError, StorageError
from geoshard.trainer import checkpoint
from geoshard.trainer.checkpoint import CheckpointStore
from geoshard.util.retry import Backoff

FAST = Backoff(attempts=3, base=0.1, jitter=0)


def train_state(seed: int = 0, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """A small model and AdamW after a few real steps, and the state the trainer would save."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
    loader = {"epoch": 3, "region": "eu-west-1", "shard_order": [4, 0, 2], "position": {"shard": 2, "sample": 17}, "seed": 1234}
    return model, opt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": loader, "rng": torch.get_rng_state()}


def pointer(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / "latest.json").read_text())
    return data


def ckpt_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "latest.json")


def store(target: str | Path, sleeps: list[float] | None = None, **kw: Any) -> CheckpointStore:
    return CheckpointStore(str(target), backoff=FAST, sleep=(sleeps if sleeps is not None else []).append, **kw)


@contextlib.contextmanager
def failing_replace(fails: Callable[[str], bool]) -> Iterator[list[str]]:
    """os.replace raising ENOSPC for destinations ``fails`` picks; yields the destinations that failed."""
    real, failed = os.replace, []

    def replace(src: Any, dst: Any) -> None:
        if fails(str(dst)):
            failed.append(Path(dst).name)
            raise OSError(28, "No space left on device")
        real(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint.os, "replace", replace)
        yield failed


# -- local folder ---------------------------------------------------------------------------------


def test_local_round_trip_restores_model_optimizer_and_loader_state(tmp_path: Path) -> None:
    model, opt, state = train_state()
    s = store(tmp_path / "ckpt")
    seconds = s.save(100, state)
    assert isinstance(seconds, float) and seconds > 0
    p = pointer(tmp_path / "ckpt")
    data = (tmp_path / "ckpt" / "ckpt-000000100.pt").read_bytes()
    assert p == {"step": 100, "path": "ckpt-000000100.pt", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "previous": []}

    loaded = store(tmp_path / "ckpt").load_latest()
    assert loaded is not None
    step, got = loaded
    assert step == 100 and got["loader"] == state["loader"] and torch.equal(got["rng"], state["rng"])
    fresh, fresh_opt, _ = train_state(seed=1, steps=0)
    fresh.load_state_dict(got["model"])
    fresh_opt.load_state_dict(got["optimizer"])
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], fresh_opt.state[b]["exp_avg"])
    # Training on from the restored state matches training on from the original.
    x = torch.randn(4, 6)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert store(tmp_path / "never-created").load_latest() is None
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "ckpt-000000005.pt").write_bytes(b"x")
    # Issue 20: checkpoint files without a pointer are never a fresh start (tests/test_trust_checkpoints.py).
    with pytest.raises(StorageError, match=r"no latest.json, and none of its 1 checkpoint files loads .*refusing to start from scratch"):
        store(tmp_path / "stray").load_latest()


def test_a_failed_write_is_retried_after_the_backoff(tmp_path: Path) -> None:
    sleeps: list[float] = []
    s = store(tmp_path, sleeps)
    first = iter([True])
    with failing_replace(lambda dst: dst.endswith(".pt") and next(first, False)) as failed:
        s.save(7, {"w": torch.ones(3)})
    assert failed == ["ckpt-000000007.pt"] and sleeps == [0.1]
    assert pointer(tmp_path)["step"] == 7 and ckpt_files(tmp_path) == ["ckpt-000000007.pt"]  # no .partial left
    loaded = s.load_latest()
    assert loaded is not None and torch.equal(loaded[1]["w"], torch.ones(3))


@pytest.mark.parametrize(("failing", "keep"), [(".pt", 2), ("latest.json", 2), ("latest.json", 1)])
def test_a_write_failing_every_attempt_leaves_the_previous_checkpoint_loadable(tmp_path: Path, failing: str, keep: int) -> None:
    sleeps: list[float] = []
    s = store(tmp_path, sleeps, keep=keep)
    s.save(10, {"w": torch.full((2,), 10.0)})
    before = (tmp_path / "latest.json").read_bytes()
    with failing_replace(lambda dst: dst.endswith(failing)) as failed, pytest.raises(StorageError) as err:
        s.save(20, {"w": torch.full((2,), 20.0)})
    assert len(failed) == 3 and sleeps == [0.1, 0.2]
    assert str(tmp_path) in str(err.value) and "after 3 attempts" in str(err.value) and "No space left" in str(err.value)
    assert (tmp_path / "latest.json").read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    loaded = store(tmp_path).load_latest()
    assert loaded is not None and loaded[0] == 10 and torch.equal(loaded[1]["w"], torch.full((2,), 10.0))
    # The next save moves on; a checkpoint the pointer never named does not count as kept.
    s.save(30, {"w": torch.full((2,), 30.0)})
    assert ckpt_files(tmp_path) == ["ckpt-000000010.pt", "ckpt-000000030.pt"][2 - keep :]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_last_keep_checkpoints_stay(tmp_path: Path, keep: int) -> None:
    s = store(tmp_path, keep=keep)
    for step in range(1, 6):
        s.save(step * 50, {"step": step})
    kept = [step * 50 for step in range(5, 5 - keep, -1)]
    assert ckpt_files(tmp_path) == sorted(checkpoint.checkpoint_name(k) for k in kept)
    p = pointer(tmp_path)
    assert [p["step"], *(e["step"] for e in p["previous"])] == kept


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = store(tmp_path, keep=3)
    for step in (1, 2, 3):
        s.save(step, {"step": torch.tensor(step)})
    newest = tmp_path / "ckpt-000000003.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    (tmp_path / "ckpt-000000002.pt").unlink()
    with caplog.at_level(logging.WARNING):
        loaded = s.load_latest()
    assert loaded is not None and loaded[0] == 1 and int(loaded[1]["step"]) == 1
    assert "ckpt-000000003.pt is corrupt" in caplog.text and "ckpt-000000002.pt is missing" in caplog.text

    (tmp_path / "ckpt-000000001.pt").write_bytes(b"garbage")
    with pytest.raises(StorageError, match=r"no usable checkpoint: ckpt-000000003.pt corrupt .*ckpt-000000001.pt corrupt"):
        s.load_latest()


def test_resuming_from_an_older_checkpoint_drops_the_abandoned_newer_ones(tmp_path: Path) -> None:
    s = store(tmp_path, keep=3)
    for step in (10, 20, 30):
        s.save(step, {"step": step})
    s.save(25, {"step": 25})  # as after falling back to 20 and training on
    assert [e["step"] for e in pointer(tmp_path)["previous"]] == [20, 10]
    assert ckpt_files(tmp_path) == ["ckpt-000000010.pt", "ckpt-000000020.pt", "ckpt-000000025.pt"]


def test_a_malformed_pointer_fails_loading_and_is_replaced_by_the_next_save(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = store(tmp_path)
    (tmp_path / "latest.json").write_text("{not json")
    with pytest.raises(StorageError, match=r"latest.json is malformed"):
        s.load_latest()
    s.save(3, {"step": 3})
    assert "replacing it" in caplog.text and pointer(tmp_path)["step"] == 3


def test_state_holding_objects_is_refused_on_load_by_weights_only(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(1, {"frac": fractions.Fraction(1, 3)})
    with pytest.raises(DataError, match="weights_only loading refuses"):
        s.load_latest()


@pytest.mark.parametrize(
    ("target", "kw", "message"),
    [
        ("/tmp/x", {"keep": 0}, "keep: must be an integer >= 1"),
        ("gs://bucket/run", {}, "a local folder or s3://bucket/prefix"),
        ("s3:///run", {}, "needs a bucket"),
        ("/tmp/x", {"endpoint_url": "http://127.0.0.1:1"}, "only to an s3:// checkpoint target"),
        ("s3://b/run", {"endpoint_url": "ftp://host"}, "must be http://HOST"),
    ],
)
def test_bad_configuration_is_a_config_error(target: str, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointStore(target, **kw)


def test_endpoint_with_user_and_password_is_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as err:
        CheckpointStore("s3://b/run", endpoint_url="http://AKIAUSER:hunter2secret@127.0.0.1:9000/?token=abc")
    assert "hunter2secret" not in str(err.value) and "AKIAUSER" not in str(err.value) and "abc" not in str(err.value)
    assert "http://127.0.0.1:9000/" in str(err.value)


def test_bad_steps_are_refused(tmp_path: Path) -> None:
    for step in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="step: must be an integer"):
            store(tmp_path).save(step, {})  # type: ignore[arg-type]


# -- S3 (SeaweedFS) -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bucket(s3: SeaweedS3) -> str:
    s3.make_bucket("ckpt-tests")
    return "ckpt-tests"


def s3_keys(server: SeaweedS3, bucket: str, prefix: str) -> list[str]:
    with contextlib.closing(server.client()) as c:
        return sorted(o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def test_s3_round_trip_with_pruning_and_fallback(aws: SeaweedS3, bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    s = store(f"s3://{bucket}/run-a", endpoint_url=aws.endpoint, keep=2)
    assert s.load_latest() is None
    model, _, state = train_state()
    for step in (100, 200, 300):
        state["loader"]["epoch"] = step
        assert s.save(step, state) > 0
    assert s3_keys(aws, bucket, "run-a/") == ["run-a/ckpt-000000200.pt", "run-a/ckpt-000000300.pt", "run-a/latest.json"]
    loaded = store(f"s3://{bucket}/run-a/", endpoint_url=aws.endpoint).load_latest()
    assert loaded is not None and loaded[0] == 300 and loaded[1]["loader"]["epoch"] == 300
    for name, t in model.state_dict().items():
        assert torch.equal(loaded[1]["model"][name], t)

    with contextlib.closing(aws.client()) as c:
        c.put_object(Bucket=bucket, Key="run-a/ckpt-000000300.pt", Body=b"torn")
    with caplog.at_level(logging.WARNING):
        loaded = s.load_latest()
    assert loaded is not None and loaded[0] == 200 and "ckpt-000000300.pt is corrupt" in caplog.text


def test_s3_wrong_secret_fails_at_once_without_showing_it(
    aws: SeaweedS3, bucket: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "wrong-secret-" + aws.secret_key[::-1]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    sleeps: list[float] = []
    s = store(f"s3://{bucket}/run-b", sleeps, endpoint_url=aws.endpoint)
    with caplog.at_level(logging.DEBUG, logger="geoshard"), pytest.raises(StorageError) as err:
        s.save(1, {"w": torch.zeros(2)})
    msg = str(err.value)
    assert "SignatureDoesNotMatch" in msg and aws.endpoint in msg and "s3://ckpt-tests/run-b" in msg
    assert sleeps == []  # wrong credentials do not get better by waiting
    for secret in (wrong, aws.secret_key):
        assert secret not in msg and secret not in caplog.text


def test_s3_missing_bucket_names_the_target(aws: SeaweedS3) -> None:
    with pytest.raises(StorageError, match=r"s3://no-such-ckpt-bucket/run at .*NoSuchBucket; create the bucket"):
        # A load: SeaweedFS creates a missing bucket on PUT for its admin identity, AWS would not.
        store("s3://no-such-ckpt-bucket/run", endpoint_url=aws.endpoint).load_latest()


def test_s3_unreachable_endpoint_retries_then_names_it(aws: SeaweedS3, caplog: pytest.LogCaptureFixture) -> None:
    (port,) = free_ports(1)
    sleeps: list[float] = []
    s = store("s3://any/run", sleeps, endpoint_url=f"http://127.0.0.1:{port}")
    with pytest.raises(StorageError) as err:
        s.load_latest()
    assert sleeps == [0.1, 0.2]
    assert str(err.value).startswith(f"s3://any/run at http://127.0.0.1:{port}: reading latest.json failed after 3 attempts")
    assert aws.secret_key not in str(err.value) and aws.secret_key not in caplog.text


def test_the_trainer_hands_the_checkpoint_buckets_region_to_its_store(tmp_path: Path) -> None:
    """Ranks in eu-west-1 writing checkpoints to a us-east-1 bucket sign for us-east-1, not for their own AWS_REGION."""
    from click.testing import CliRunner

    from geoshard.trainer.config import TrainConfig
    from geoshard.trainer.options import config_from, train_options

    seen: list[TrainConfig] = []

    @click.command()
    @train_options
    def probe(**kwargs: Any) -> None:
        seen.append(config_from(**kwargs))

    plan = tmp_path / "plan.toml"
    plan.write_text('[regions.eu-west-1]\nweight = 1\nlocal = "x"\n')
    argv = ["--plan", str(plan), "--steps", "1", "--out", str(tmp_path / "run"), "--checkpoint", "s3://ckpt/run"]
    r = CliRunner().invoke(probe, [*argv, "--checkpoint-region", "us-east-1"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    cfg = seen[0]
    assert cfg.checkpoint_region == "us-east-1"
    assert cfg.to_argv()[cfg.to_argv().index("--checkpoint-region") + 1] == "us-east-1", "passed on to torchrun's ranks"
