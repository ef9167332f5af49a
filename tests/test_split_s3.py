"""`geoshard split` reading s3:// sources from a real S3 server (SeaweedFS on 127.0.0.1, SigV4 checked).

The corpus is uploaded twice: to ``corpus-a``, a bucket the plan names (with its endpoint), and to
``corpus-b``, which only ``--endpoint`` reaches. Credentials are passed only through
``CliRunner.invoke(env=...)``: the S3 listing runs in the CLI's process, the reads run in Dask
worker processes, so a successful split shows both saw them. Every split from S3 must give the
same region manifests and shards, byte for byte, as the same split from local files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner, Result
from servers import SeaweedS3, closed_port

from geoshard.cli import main
from geoshard.local.synth import SynthSpec, synth
from geoshard.manifest import MANIFEST

PLAN_BUCKET = "corpus-a"  # named by a plan region, with the endpoint
OTHER_BUCKET = "corpus-b"  # not in the plan: reached through --endpoint
PREFIX = "raw/v1/"
NSHARDS = 4
EPOCH = "1700000000"  # SOURCE_DATE_EPOCH: fixed `created`, so whole top manifests compare


@dataclass(frozen=True)
class Corpus:
    dir: Path
    files: tuple[Path, ...]
    plan: Path
    reference: Path  # split of all local files
    env: dict[str, str | None]  # for CliRunner: credentials, no endpoint


def plan_text(endpoint: str) -> str:
    return f"""
[routing]
policy = "hash"

[shards]
bytes = "16KB"

[regions.us-east]
weight = 2
bucket = "s3://{PLAN_BUCKET}/geoshard"
endpoint = "{endpoint}"

[regions.eu-west]
weight = 1
bucket = "s3://eu-west-dest/geoshard"
"""


def cli_env(server: SeaweedS3) -> dict[str, str | None]:
    """Credentials only (the plan or --endpoint must name the server).

    AWS_ENDPOINT_URL points at a closed local port: the plan's endpoint and --endpoint must win
    over it, and if they ever did not, the split fails here at once instead of calling real AWS.
    """
    trap = f"http://127.0.0.1:{closed_port()}"
    env: dict[str, str | None] = dict.fromkeys(SeaweedS3.UNSET_ENV)
    env.update(server.env(endpoint=False))
    env.update({"AWS_ENDPOINT_URL": trap, "AWS_ENDPOINT_URL_S3": trap, "SOURCE_DATE_EPOCH": EPOCH})
    return env


def split(sources: list[str], plan: Path, out: Path, env: Mapping[str, str | None], *extra: str) -> Result:
    args = ["split", *sources, "--plan", str(plan), "--out", str(out), "--workers", "2", "--json", *extra]
    return CliRunner().invoke(main, args, env=dict(env), catch_exceptions=True)


def ok(result: Result) -> dict:
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}\n{result.exception!r}"
    return json.loads(result.stdout)


def failed(result: Result) -> str:
    """The error of a failed split: one 'geoshard: error:' line, no traceback; returns that line."""
    assert result.exit_code not in (0, None), result.output
    assert isinstance(result.exception, SystemExit), f"unexpected exception {result.exception!r}"
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("geoshard: error: "), result.stderr
    return lines[0]


def files_of(out: Path) -> dict[str, bytes]:
    """Every file a split published, but the top manifest (its sources name the inputs) and dot-files (lock, tmp)."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.relative_to(out) != Path(MANIFEST) and not any(part.startswith(".") for part in p.relative_to(out).parts)
    }


def assert_same_split(s3_out: Path, local_out: Path, s3_urls: list[str]) -> None:
    """Region manifests and shards byte-identical; top manifest equal but for source URLs."""
    got, want = files_of(s3_out), files_of(local_out)
    assert sorted(got) == sorted(want)
    assert any(k.endswith(".tar") for k in want) and sum(k.endswith(MANIFEST) for k in want) == 2
    for name in want:
        assert got[name] == want[name], f"{name} differs between the S3 and the local split"
    top_s3 = json.loads((s3_out / MANIFEST).read_bytes())
    top_local = json.loads((local_out / MANIFEST).read_bytes())
    src_s3, src_local = top_s3.pop("sources"), top_local.pop("sources")
    assert top_s3 == top_local
    assert [s["url"] for s in src_s3] == s3_urls
    assert [Path(s["url"]).name for s in src_local] == [u.rsplit("/", 1)[1] for u in s3_urls]
    strip = [{k: v for k, v in s.items() if k != "url"} for s in src_s3]
    assert strip == [{k: v for k, v in s.items() if k != "url"} for s in src_local]
    for s in src_local:
        data = Path(s["url"]).read_bytes()
        assert s["size"] == len(data) and s["xxh3_128"] == xxhash.xxh3_128(data).hexdigest() and "sha256" not in s


@pytest.fixture(scope="module")
def corpus(s3: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    root = tmp_path_factory.mktemp("s3corpus")
    files = tuple(synth(SynthSpec(out=root / "src", fmt="wds", samples=4 * 30, sample_bytes=600, shard_samples=30, seed=7)))
    assert len(files) == NSHARDS
    for bucket in (PLAN_BUCKET, OTHER_BUCKET):
        s3.make_bucket(bucket)
        s3.upload(bucket, PREFIX, list(files))
    plan = root / "plan.toml"
    plan.write_text(plan_text(s3.endpoint))
    env = cli_env(s3)
    reference = root / "ref"
    ok(split([str(root / "src")], plan, reference, env))
    return Corpus(dir=root / "src", files=files, plan=plan, reference=reference, env=env)


def urls(bucket: str, files: tuple[Path, ...] | list[Path]) -> list[str]:
    return [f"s3://{bucket}/{PREFIX}{f.name}" for f in files]


@pytest.mark.parametrize(
    ("bucket", "extra"),
    [(PLAN_BUCKET, ()), (OTHER_BUCKET, ("--endpoint",))],
    ids=["endpoint-from-plan", "endpoint-option"],
)
def test_split_from_s3_prefix_matches_local(s3: SeaweedS3, corpus: Corpus, tmp_path: Path, bucket: str, extra: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    options = [*extra, s3.endpoint] if extra else []
    report = ok(split([f"s3://{bucket}/{PREFIX}"], corpus.plan, out, corpus.env, *options))
    assert report["samples_in"] == 4 * 30
    assert report["bytes_in"] == sum(f.stat().st_size for f in corpus.files)
    assert_same_split(out, corpus.reference, urls(bucket, corpus.files))


def test_split_from_s3_glob_matches_local(corpus: Corpus, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ok(split([f"s3://{PLAN_BUCKET}/{PREFIX}*.tar"], corpus.plan, out, corpus.env))
    assert_same_split(out, corpus.reference, urls(PLAN_BUCKET, corpus.files))


def test_split_from_s3_brace_range_matches_local(corpus: Corpus, tmp_path: Path) -> None:
    pattern = "train-{00000..00002}.tar"
    local_out, s3_out = tmp_path / "local", tmp_path / "s3"
    ok(split([str(corpus.dir / pattern)], corpus.plan, local_out, corpus.env))
    report = ok(split([f"s3://{PLAN_BUCKET}/{PREFIX}{pattern}"], corpus.plan, s3_out, corpus.env))
    assert report["samples_in"] == 3 * 30  # train-00003.tar is left out
    assert_same_split(s3_out, local_out, urls(PLAN_BUCKET, corpus.files[:3]))


def test_wrong_secret_fails_naming_source_and_endpoint_without_leaking_it(s3: SeaweedS3, corpus: Corpus, tmp_path: Path) -> None:
    wrong = "Wr0ngSecret-" + s3.secret_key[:8][::-1] + "-zz"
    source = f"s3://{PLAN_BUCKET}/{PREFIX}"
    out = tmp_path / "out"
    result = split([source], corpus.plan, out, {**corpus.env, "AWS_SECRET_ACCESS_KEY": wrong})
    line = failed(result)
    assert source in line and s3.endpoint in line
    assert "SignatureDoesNotMatch" in line
    for secret in (wrong, s3.secret_key):
        assert secret not in result.output and secret not in result.stderr
    assert not (out / MANIFEST).exists()


def test_endpoint_down_fails_fast_naming_it(corpus: Corpus, tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{closed_port()}"
    source = f"s3://{OTHER_BUCKET}/{PREFIX}"
    out = tmp_path / "out"
    t0 = time.monotonic()
    result = split([source], corpus.plan, out, corpus.env, "--endpoint", down)
    elapsed = time.monotonic() - t0
    line = failed(result)
    assert elapsed < 15, f"took {elapsed:.1f}s to give up on {down}"
    assert down in line and source in line and "cannot reach" in line
    assert not (out / MANIFEST).exists()


@pytest.mark.parametrize(
    ("source", "code", "words"),
    [
        (f"s3://no-such-bucket-gs/{PREFIX}", 1, "NoSuchBucket"),
        (f"s3://{OTHER_BUCKET}/{PREFIX}train-00099.tar", 2, "source not found"),
        (f"s3://{OTHER_BUCKET}/no/such/prefix/", 2, "source not found"),
    ],
    ids=["missing-bucket", "missing-key", "missing-prefix"],
)
def test_missing_bucket_or_key_fails_and_writes_nothing(
    s3: SeaweedS3, corpus: Corpus, tmp_path: Path, source: str, code: int, words: str
) -> None:
    out = tmp_path / "out"
    result = split([source], corpus.plan, out, corpus.env, "--endpoint", s3.endpoint)
    line = failed(result)
    assert result.exit_code == code
    assert source in line and words in line
    assert not (out / MANIFEST).exists()
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]
