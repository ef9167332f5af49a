"""Issue 14, "the first hour with geoshard": the conventions a new user expects (environment
variables named after the options, tables that survive a pipe, file modes that follow the umask,
...), each checked through the real command or the public API, asserting what the user sees."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from servers import SeaweedS3
from splitkit import make_corpus, write_plan
from synckit import cli, make_split, remote_manifest, sync_plan
from test_report import make_run

from geoshard.cli import main

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))


def run(*args: object, env: dict[str, str] | None = None, cwd: Path | None = None, umask: int = -1) -> subprocess.CompletedProcess[str]:
    """``geoshard ARGS`` as a user runs it: a subprocess whose stdout is a pipe, not a terminal."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GEOSHARD_") and k not in ("COLUMNS", "PYTHONPATH")}
    environ.update(env or {})
    return subprocess.run(
        [GEOSHARD, *(str(a) for a in args)], capture_output=True, text=True, timeout=300, env=environ, cwd=cwd, check=False, umask=umask
    )


# --- 5. environment variables: GEOSHARD_<COMMAND>_<OPTION>, named after the option -----------------


def _commands(group: click.Group = main, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command (and group) with the words that invoke it: (), ("sync",), ("wan", "check"), ..."""
    out: list[tuple[tuple[str, ...], click.Command]] = [(path, group)]
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            out += _commands(command, (*path, name))
        else:
            out.append(((*path, name), command))
    return out


def _expected_name(command: tuple[str, ...], option: click.Option) -> str:
    """What docs/cli.md promises, derived here independently: the first long option, upper-cased."""
    long = next(o for o in option.opts if o.startswith("--"))
    return "_".join(("GEOSHARD", *command, long[2:])).upper().replace("-", "_")


def _env_value(option: click.Option, tmp: Path) -> tuple[str, Any]:
    """A value for the option's variable that differs from its default, and what click must make of it."""
    t = option.type
    if option.count:
        return "2", 2
    if option.is_flag:
        return ("0", False) if option.default else ("1", True)
    if isinstance(t, click.Choice):
        choice = next(c for c in reversed(t.choices) if c != option.default)
        return str(choice), choice
    if t.name == "DURATION":
        return "80ms", 0.08
    if t.name == "SIZE":
        return "2MB", 2_000_000
    if isinstance(t, click.Path):
        p = tmp / "plan.toml" if t.exists else tmp / f"new-{option.name}"
        return str(p), p
    if isinstance(t, click.FloatRange) or t is click.FLOAT:
        return "0.25", 0.25
    if isinstance(t, click.IntRange) or t is click.INT:
        return "7", 7
    if option.multiple:
        return "a b", ("a", "b")
    return f"v-{option.name}", f"v-{option.name}"


def test_every_option_of_every_command_reads_its_documented_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_plan(tmp_path / "plan.toml")
    checked = []
    for command, cmd in _commands():
        options = [p for p in cmd.params if isinstance(p, click.Option) and p.expose_value]
        expected = {}
        for env in [k for k in os.environ if k.startswith("GEOSHARD_")]:
            monkeypatch.delenv(env)
        for o in options:
            name = _expected_name(command, o)
            assert o.envvar == name, (command, o.opts, o.envvar)
            raw, expected[o.name] = _env_value(o, tmp_path)
            monkeypatch.setenv(name, raw)
            checked.append(name)
        parent = None
        for word in ("geoshard", *command[:-1]):
            parent = click.Context(main if parent is None else parent.command.commands[word], info_name=word, parent=parent)  # type: ignore[attr-defined]
        args = ["x" for p in cmd.params if isinstance(p, click.Argument) and p.required]
        if isinstance(cmd, click.Group):
            args += [next(iter(cmd.commands))]
        ctx = cmd.make_context(command[-1] if command else "geoshard", args, parent=parent)
        for o in options:
            assert ctx.params[o.name] == expected[o.name], (command, o.opts, ctx.params[o.name])
    # the names the issue tried, now as documented
    for name in ("GEOSHARD_SYNC_PLAN", "GEOSHARD_SPLIT_JSON", "GEOSHARD_SPLIT_FORMAT", "GEOSHARD_PULL_TO", "GEOSHARD_TRAIN_BATCH_SIZE"):
        assert name in checked
    assert len(checked) > 80


def test_help_shows_each_option_variable() -> None:
    for command, cmd in _commands():
        if not command:
            continue
        r = run(*command, "--help")
        assert r.returncode == 0, r.stderr
        text = " ".join(r.stdout.split())  # help wraps at 80 columns
        for o in cmd.params:
            if isinstance(o, click.Option) and o.expose_value:
                assert f"env var: {_expected_name(command, o)}" in text, (command, o.opts)


def test_sync_plan_from_the_environment_publishes(aws: SeaweedS3, tmp_path: Path) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "envvar")
    split = make_split(tmp_path, plan, samples=200)
    env = {"GEOSHARD_SYNC_PLAN": str(plan), "GEOSHARD_SYNC_CREATE_BUCKETS": "1", "GEOSHARD_SYNC_JSON": "1"}
    r = run("sync", split, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    assert all(remote_manifest(aws, b) is not None for b in buckets.values())


# --- 6. tables are not cut when stdout is not a terminal ------------------------------------------

LONG_REGIONS = ("us-east-1-with-a-long-name-for-this-test", "eu-west-1-with-a-long-name-for-this-test")


def _long_split(tmp: Path) -> Path:
    plan = tmp / "plan.toml"
    plan.write_text('[shards]\nbytes = "64KB"\n' + "".join(f"[regions.{r}]\nweight = 1\n" for r in LONG_REGIONS))
    make_corpus(tmp / "corpus", samples=300, shard_samples=100)
    r = run("split", tmp / "corpus", "--plan", plan, "--out", tmp / "split", "--workers", "1")
    assert r.returncode == 0, r.stderr
    return tmp / "split"


def test_tables_are_whole_in_a_pipe(tmp_path: Path) -> None:
    split = _long_split(tmp_path)
    r = run("inspect", split)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout, r.stdout
    rows = [line for line in r.stdout.splitlines() if "with-a-long-name" in line]
    assert len(rows) == 2, r.stdout
    cells = [[c.strip() for c in row.strip("│ ").split("│")] for row in rows]
    assert sorted(c[0] for c in cells) == sorted(LONG_REGIONS)
    assert all(c[-1].endswith("%") and len(c) == 5 for c in cells), rows
    assert max(len(line) for line in r.stdout.splitlines()) > 80  # wider than rich's 80-column guess


def test_report_tables_are_whole_in_a_pipe(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run")
    r = run("report", run_dir)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout, r.stdout
    for word in ("s3:us-east-1", "misses", "errors", "corrupt", "1st batch", "over budget"):
        assert word in r.stdout, word


# --- 7. files follow the umask (a replica or report read by another user) ----------------------

_WRITERS = """
import sys
from pathlib import Path
from geoshard.loaders.local_tier import LocalTier
from geoshard.trainer.checkpoint import CheckpointStore
root = Path(sys.argv[1])
LocalTier(root / "replica", region="eu-west-1").write("00001-0000-0123456789ab.tar", b"shard bytes")
CheckpointStore(str(root / "ckpt")).save(3, {"w": 1})
"""


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_written_files_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    plan = write_plan(tmp_path / "plan.toml")
    make_corpus(tmp_path / "corpus", samples=300, shard_samples=100)
    r = run("split", tmp_path / "corpus", "--plan", plan, "--out", tmp_path / "split", "--workers", "1", umask=umask)
    assert r.returncode == 0, r.stderr
    run_dir = make_run(tmp_path / "run")
    r = run("report", run_dir, umask=umask)
    assert r.returncode == 0, r.stderr
    p = subprocess.run([sys.executable, "-P", "-c", _WRITERS, tmp_path / "api"], capture_output=True, text=True, umask=umask, check=False)
    assert p.returncode == 0, p.stderr

    modes = {**_modes(tmp_path / "split"), **_modes(tmp_path / "api")}
    modes.update({f: m for f, m in _modes(run_dir).items() if f.startswith("report.")})
    assert {"manifest.json", "eu-west-1/manifest.json", "replica/00001-0000-0123456789ab.tar", "ckpt/latest.json"} <= set(modes)
    assert {"report.json", "report.png", "ckpt/ckpt-000000003.pt"} <= set(modes)
    assert any(f.endswith(".tar") and f.startswith("us-east-1/") for f in modes)
    assert {f: m for f, m in modes.items() if m != mode} == {}


def test_pulled_replica_is_readable_by_others(aws: SeaweedS3, tmp_path: Path) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "umask")
    split = make_split(tmp_path, plan, samples=200)
    assert cli("sync", split, "--plan", plan, "--create-buckets").exit_code == 0
    r = run("pull", "--plan", plan, "--region", "eu-west-1", "--to", tmp_path / "replica", umask=0o022)
    assert r.returncode == 0, r.stderr
    modes = _modes(tmp_path / "replica")
    assert "manifest.json" in modes and any(f.endswith(".tar") for f in modes)
    assert {f: m for f, m in modes.items() if m != 0o644} == {}
    # 11. a pulled replica holds a region manifest: verify and inspect accept it
    shards = sum(1 for f in modes if f.endswith(".tar"))
    r = run("verify", tmp_path / "replica")
    assert r.returncode == 0 and r.stdout.strip() == f"{shards} shards checked, 0 missing, 0 mismatched", r.stdout + r.stderr
    r = run("inspect", tmp_path / "replica", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["regions"]["eu-west-1"]["shards"] == shards


# --- 8. dependencies as ranges; the exact pins only for the project's own venvs -----------------

ROOT = Path(__file__).resolve().parents[1]


def test_requirements_are_ranges_and_the_venv_pins_live_in_constraints() -> None:
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    exact = [str(r) for r in reqs if any(s.operator in ("==", "===") for s in r.specifier)]
    assert exact == []
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name] = version
    assert pins["torch"] == "2.13.0" and {"webdataset", "prometheus-client", "tensorflow-cpu", "alluxio"} <= set(pins)
    for r in reqs:  # every pin satisfies the range the package asks for
        if r.name in pins:
            assert r.specifier.contains(pins[r.name]), (str(r), pins[r.name])
    makefile = (ROOT / "Makefile").read_text()
    assert makefile.count("-c constraints.txt") == 3  # .venv, .venv-tf, the bench extras


def test_readme_install_section_and_code_fences() -> None:
    text = (ROOT / "README.md").read_text()
    fences = [line for line in text.splitlines() if "```" in line]
    assert all(line.startswith("```") and line.strip("`").strip() in ("", "python", "toml") for line in fences), fences
    assert len(fences) % 2 == 0
    assert "## Install" in text and "pip install geoshard" in text and "geoshard[alluxio]" in text
    assert "/work/" not in text  # no developer's path in the demo output it shows
    assert "in timed(loader)" not in text  # the Timed object holds the waits: keep it


# --- 9. one S3 client factory (the bucket's region, bounded waits) and one error classification --


def test_every_s3_client_carries_the_buckets_region_and_bounded_timeouts(s3: SeaweedS3) -> None:
    from geoshard import s3 as s3lib
    from geoshard.loaders.s3_tier import S3Tier
    from geoshard.plan import Region
    from geoshard.sync.remote import Bucket, BucketTarget
    from geoshard.trainer.checkpoint import CheckpointStore

    region = Region("ap-southeast-2", 1, bucket="s3://b/p", endpoint=s3.endpoint)
    clients = {
        "factory": s3lib.client(s3.endpoint, None, "eu-west-2"),
        "sync": Bucket(BucketTarget.of(region, None)).client,
        "tier": S3Tier("b", "p", endpoint=s3.endpoint, region="ap-southeast-2").client,
        "checkpoint": CheckpointStore("s3://b/p", endpoint_url=s3.endpoint, region="sa-east-1")._backend.client,  # type: ignore[union-attr]
    }
    regions = {name: c.meta.region_name for name, c in clients.items()}
    assert regions == {"factory": "eu-west-2", "sync": "ap-southeast-2", "tier": "ap-southeast-2", "checkpoint": "sa-east-1"}
    for c in clients.values():
        assert 0 < c.meta.config.connect_timeout <= 5 and 0 < c.meta.config.read_timeout <= 120
    # a plan region that is not an AWS region name (a lab's "dc-1") leaves the SDK's default
    assert s3lib.bucket_region("dc-1") is None and s3lib.bucket_region("us-gov-west-1") == "us-gov-west-1"


def test_one_classification_for_a_missing_key_and_a_missing_bucket(aws: SeaweedS3) -> None:
    """The same failures, against the real S3 server, read the same way by the S3 tier,
    checkpoints and sync: a missing key is a miss; a missing bucket is an error that says what
    to change, never a silent miss (the S3 tier used to take it for one)."""
    s3 = aws
    from geoshard.errors import StorageError
    from geoshard.loaders.s3_tier import S3Tier
    from geoshard.loaders.tier import TierError, TierMissing
    from geoshard.plan import Region
    from geoshard.sync.remote import Bucket, BucketTarget, MissingBucket
    from geoshard.trainer.checkpoint import CheckpointStore
    from geoshard.util.retry import Backoff

    bucket = s3.make_bucket("gs-classify")[5:]
    tier = S3Tier(bucket, "p", endpoint=s3.endpoint, region="eu-west-1")
    sync_bucket = Bucket(BucketTarget.of(Region("eu-west-1", 1, bucket=f"s3://{bucket}/p", endpoint=s3.endpoint), None))
    assert tier.stat("nope.tar") is None
    with pytest.raises(TierMissing):
        tier.read("nope.tar")
    assert sync_bucket.get("nope.json") is None
    assert CheckpointStore(f"s3://{bucket}/run", endpoint_url=s3.endpoint).load_latest() is None

    gone = S3Tier("gs-no-such-bucket", "p", endpoint=s3.endpoint, region="eu-west-1")
    with pytest.raises(TierError, match="NoSuchBucket; create the bucket") as e:
        gone.read("a.tar")
    assert not isinstance(e.value, TierMissing)
    with pytest.raises(MissingBucket):
        Bucket(BucketTarget.of(Region("eu-west-1", 1, bucket="s3://gs-no-such-bucket/p", endpoint=s3.endpoint), None)).get("m.json")
    # (a load: SeaweedFS creates a missing bucket on PUT for its admin identity; AWS would not)
    store = CheckpointStore("s3://gs-no-such-bucket/run", endpoint_url=s3.endpoint, backoff=Backoff(attempts=1))
    with pytest.raises(StorageError, match="NoSuchBucket; create the bucket"):
        store.load_latest()


def test_wrong_secret_is_one_line_with_a_remedy(s3: SeaweedS3, tmp_path: Path) -> None:
    bucket = s3.make_bucket("gs-wrong-secret")[5:]
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[regions.eu-west-1]\nweight = 1\nbucket = "s3://{bucket}/train"\nendpoint = "{s3.endpoint}"\n')
    env = {**s3.env(endpoint=False), "AWS_SECRET_ACCESS_KEY": "not-the-secret-" + "x" * 20}
    r = run("split", f"s3://{bucket}/train/", "--plan", plan, "--out", tmp_path / "out", env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("geoshard: error: ") and "SignatureDoesNotMatch; check the credentials (secret key)" in lines[0]
    assert "not-the-secret" not in r.stderr + r.stdout and not (tmp_path / "out" / "manifest.json").exists()


# --- 11. the smaller things -------------------------------------------------------------------


def test_verify_and_inspect_accept_a_region_folder(tmp_path: Path) -> None:
    split = _long_split(tmp_path)
    region = split / LONG_REGIONS[0]
    shards = sorted(region.rglob("*.tar"))
    r = run("verify", region)
    assert r.returncode == 0 and r.stdout.strip() == f"{len(shards)} shards checked, 0 missing, 0 mismatched", r.stdout + r.stderr
    r = run("inspect", region)
    assert r.returncode == 0, r.stderr
    assert f"(region {LONG_REGIONS[0]}, generation 1, wds)" in r.stdout and "100.0%" in r.stdout
    shards[0].write_bytes(b"x" + shards[0].read_bytes()[1:])
    r = run("verify", region)
    assert r.returncode == 1 and f"mismatched: {shards[0]}" in r.stdout


def test_synth_rerun_leaves_only_its_new_shards(tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run("synth", out, "--samples", "300", "--shard-samples", "100").returncode == 0
    r = run("synth", out, "--samples", "100", "--shard-samples", "100", "--format", "tfrecord")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("; removed 3 shard(s) of an earlier synth run"), r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "train-00000.tfrecord"]


def test_report_with_another_budget_leaves_report_json(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run")
    r = run("report", run_dir)
    assert r.returncode == 0 and "over budget" in r.stdout, r.stdout + r.stderr
    written = (run_dir / "report.json").read_bytes()
    stamp = (run_dir / "report.json").stat().st_mtime_ns
    r = run("report", run_dir, "--budget", "0.5")
    assert r.returncode == 0, r.stderr
    assert "budget 50.0%: within budget" in r.stdout
    assert f"what-if at budget 50.0%: {run_dir / 'report.json'} left as written (budget 5.0%)" in r.stdout
    assert (run_dir / "report.json").read_bytes() == written and (run_dir / "report.json").stat().st_mtime_ns == stamp
    assert json.loads(written)["budget"] == 0.05
    r = run("report", run_dir, "--json")  # no --budget: the run's own, and the file is rewritten alike
    assert r.returncode == 0 and json.loads(r.stdout)["budget"] == 0.05


def test_one_idea_one_option_name_across_commands(tmp_path: Path) -> None:
    """Dask workers are --split-workers, s5cmd's are --transfer-workers, and the folder a command
    fills is --out, wherever they appear; the older names keep working."""

    def names(command: str) -> dict[str, list[str]]:
        return {p.name: p.opts for p in main.commands[command].params if isinstance(p, click.Option) and p.name}

    for command in ("split", "demo"):
        assert "--split-workers" in names(command)["workers"]
    assert "--split-workers" in names("refresh")["split_workers"]
    for command in ("sync", "pull", "refresh"):
        assert "--transfer-workers" in names(command)["workers"]
    for command in ("split", "refresh", "pull", "train", "demo"):
        assert "--out" in [o for opts in names(command).values() for o in opts], command
    plan = write_plan(tmp_path / "plan.toml")
    for old, new in (("--to", "--out"), ("--workers", "--transfer-workers")):
        for flag in (old, new):
            value = "3" if "workers" in flag else str(tmp_path / "r")
            args = ["--plan", str(plan), "--region", "eu-west-1", "--to", str(tmp_path / "r"), flag, value]
            ctx = main.commands["pull"].make_context("pull", args)
            assert ctx.params["workers" if "workers" in flag else "to"] == (3 if "workers" in flag else tmp_path / "r")


def test_a_dead_alluxio_warns_once_per_tier_and_the_stats_count_every_failure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from tierkit import dead_alluxio, replica_beside_dead_alluxio

    from geoshard.loaders.chain import ChainSettings, TierChain
    from geoshard.util.retry import Backoff

    data, shards, local, port = replica_beside_dead_alluxio(tmp_path, 6)
    alluxio = dead_alluxio(port)
    # no cooldown: every shard tries the dead Alluxio again, as a long run does after each cooldown
    settings = ChainSettings(backoff=Backoff(attempts=1, base=0.01, jitter=0), cooldown_s=0)
    chain = TierChain("eu-west-1", [alluxio, local], settings)
    with caplog.at_level(logging.WARNING, logger="geoshard"):
        for s in shards:
            assert bytes(chain.fetch(s)) == data[s.path]
    warnings = [r.getMessage() for r in caplog.records if "alluxio:eu-west-1 failed" in r.getMessage()]
    assert len(warnings) == 1 and "counted in the report's tiers table" in warnings[0], warnings
    assert chain.stats.snapshot().to_dict()["tiers"]["alluxio:eu-west-1"]["errors"] == len(data)
    alluxio.close()  # type: ignore[attr-defined]


# --- 1. after --resume the report covers the whole run, and its parts add up -----------------------


@pytest.fixture(scope="module")
def corpus_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_loaders import split

    return split(tmp_path_factory.mktemp("corpus"), samples=3000)


TRAIN = ("--region", "eu-west-1", "--nproc", "2", "--batch-size", "16", "--num-workers", "1", "--backend", "gloo")


@pytest.mark.slow
def test_report_after_resume_covers_the_whole_run(corpus_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "runR"
    # 0.3 s of stated compute a step: each segment outlasts the 5 s between progress lines on a quiet machine.
    first = run("train", "--plan", corpus_plan, *TRAIN, "--steps", "40", "--checkpoint-every", "20", "--step-time", "0.3", "--out", out)
    assert first.returncode == 0, first.stderr[-3000:]
    first_wall = sum(json.loads((out / f"rank{r}.json").read_text())["wall_s"] for r in range(2))
    second = run(
        "train", "--plan", corpus_plan, *TRAIN, "--steps", "60", "--checkpoint-every", "20", "--step-time", "0.3", "--resume", "--out", out
    )
    assert second.returncode == 0, second.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["steps"], report["step_first"], report["step_last"], report["segments"]) == (60, 1, 60, 2)
    logged = [json.loads(line) for r in range(2) for line in (out / f"steps-rank{r}.jsonl").read_text().splitlines()]
    assert len(logged) == 2 * 60 and report["samples"] == sum(x["samples"] for x in logged)
    b = report["breakdown"]
    parts = b["data_wait"]["seconds"] + b["compute"]["seconds"] + b["checkpoint"]["seconds"] + b["other"]["seconds"]
    assert parts == pytest.approx(b["wall"]["seconds"], abs=1e-3)
    assert b["other"]["seconds"] >= 0
    assert report["io_wait_share"] == pytest.approx(b["data_wait"]["seconds"] / b["wall"]["seconds"], abs=1e-5)
    assert report["io_wait_share"] < 0.9  # it said 100.0% when the wall time was the last segment's alone
    assert b["wall"]["seconds"] > first_wall  # both segments: the first run's wall time and the resume's
    hits = sum(t["hits"] for t in report["tiers"].values())
    assert hits >= sum(len(json.loads((out / f"rank{r}.json").read_text())["earlier_segments"]) for r in range(2)) > 0
    assert "60 steps (1..60) in 2 segments (resumed or restarted; all of them counted)" in second.stdout
    # 11. the same folder again without --resume is refused, and nothing in it changes
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = run("train", "--plan", corpus_plan, *TRAIN, "--steps", "60", "--out", out)
    _one_line(again, 2, f"{out}: holds a training run (", "pass --resume to continue it, --overwrite to start it over")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # 4. progress while training: without a terminal, a line every few seconds (the resume's own steps only)
    for r, total, low in ((first, 40, 1), (second, 60, 41)):
        lines = [
            m.groups() for m in re.finditer(rf"^step (\d+)/{total}  loss \S+  ([\d,]+) samples/s  data wait ([\d.]+)%$", r.stdout, re.M)
        ]
        assert lines, r.stdout
        assert all(low <= int(step) <= total and int(rate.replace(",", "")) > 0 for step, rate, _ in lines), lines


# --- 3. errors before launch, and a failed rank's own line once, with its code ---------------------


@pytest.fixture(scope="module")
def tfrecord_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_loaders import split

    return split(tmp_path_factory.mktemp("tfcorpus"), fmt="tfrecord", samples=600)


def _one_line(r: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    assert lines[0].startswith("geoshard: error: ") and "Traceback" not in r.stdout + r.stderr, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def test_train_checks_plan_region_options_and_layout_before_torchrun(corpus_plan: Path, tfrecord_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "runx"
    no_region = {"AWS_REGION": "", "AWS_DEFAULT_REGION": ""}
    cases = [
        (("--plan", corpus_plan, "--region", "eu-west-2"), "unknown region 'eu-west-2'; plan has us-east-1, eu-west-1, ap-southeast-1"),
        (("--plan", corpus_plan), "no region: pass --region REGION or set GEOSHARD_REGION"),
        (("--plan", corpus_plan, "--region", "eu-west-1", "--num-workers", "-1"), "--num-workers must be at least 0, got -1"),
        (("--plan", corpus_plan, "--region", "eu-west-1", "--metrics-port", "80000"), "--metrics-port must be a TCP port"),
        (("--plan", tfrecord_plan, "--region", "eu-west-1"), "its shards are tfrecord; the built-in model reads WebDataset samples"),
    ]
    for args, words in cases:
        r = run("train", *args, "--steps", "3", "--out", out, env=no_region)
        line = _one_line(r, 2, words)
        assert "pass region=" not in line and not out.exists(), line  # nothing launched, no run folder


@pytest.mark.slow
def test_a_failed_rank_is_one_line_once_with_its_exit_code(corpus_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "runF"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest.json").write_text("{not json")
    r = run("train", "--plan", corpus_plan, *TRAIN, "--steps", "3", "--resume", "--out", out)
    line = _one_line(r, 1, "rank ", "latest.json is malformed", "fix or remove it")
    assert "ChildFailedError" not in r.stdout and "torchrun" not in line
    assert "ChildFailedError" in (out / "logs" / "stderr.log").read_text()  # the whole story is kept, in the run folder

    # a rank's configuration error exits 2: resuming (on more ranks, which elastic resume allows)
    # with another batch size than the checkpoint's loader positions were saved with
    one = tmp_path / "run1"
    r = run("train", "--plan", corpus_plan, *TRAIN[:2], "--nproc", "1", *TRAIN[4:], "--steps", "2", "--out", one)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run("train", "--plan", corpus_plan, *TRAIN[:5], "8", *TRAIN[6:], "--steps", "4", "--resume", "--out", one)
    line = _one_line(r, 2, "geoshard: error: rank ")
    assert "loader state does not fit this loader: batch_size is 16 there, 8 here" in line, line


def _on_a_terminal(*args: object, cwd: Path) -> str:
    """``geoshard ARGS`` with stdout and stderr on a pseudo-terminal: everything it drew."""
    import pty

    main_fd, child_fd = pty.openpty()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GEOSHARD_")} | {"TERM": "xterm", "COLUMNS": "160"}
    proc = subprocess.Popen([GEOSHARD, *(str(a) for a in args)], stdout=child_fd, stderr=child_fd, cwd=cwd, env=environ)
    os.close(child_fd)
    chunks = []
    while True:
        try:
            data = os.read(main_fd, 1 << 16)
        except OSError:  # EIO: the child side closed
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0, b"".join(chunks)[-3000:]
    os.close(main_fd)
    return b"".join(chunks).decode(errors="replace")


def test_split_progress_has_a_total_and_counts_during_a_task(tmp_path: Path) -> None:
    from geoshard.plan import load_plan
    from geoshard.split import SplitSettings, run_split
    from geoshard.split.sources import S3Access

    make_corpus(tmp_path / "corpus", samples=16000, sample_bytes=1000, shard_samples=8000)
    plan = write_plan(tmp_path / "plan.toml", shard_bytes="4MB")
    events: list[dict[str, Any]] = []
    run_split([str(tmp_path / "corpus")], load_plan(plan), SplitSettings(out=tmp_path / "a", workers=1, s3=S3Access()), events.append)
    size = sum(p.stat().st_size for p in (tmp_path / "corpus").iterdir())
    assert events[0] == {"total_bytes": size}
    first_done = next(i for i, e in enumerate(events) if "shards" in e)
    assert any(e.get("samples", 0) > 0 for e in events[1:first_done]), events  # counted while the first task runs
    assert sum(e.get("bytes", 0) for e in events) == size
    drawn = _on_a_terminal("split", tmp_path / "corpus", "--plan", plan, "--out", tmp_path / "b", "--workers", "1", cwd=tmp_path)
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)
    assert re.search(r"split ━+ +\d+% [1-9][\d,]* samples", frames), frames[-2000:]  # a bar with a total, counting


# --- 2. your own data and your own loop: data-only mode, and the step log from your loop --------------


@pytest.fixture(scope="module")
def jpg_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ordinary WebDataset (``.jpg`` and ``.txt``), split for eu-west-1 into a local folder."""
    from splitkit import tar_bytes

    tmp = tmp_path_factory.mktemp("jpgtxt")
    (tmp / "corpus").mkdir()
    for t in range(3):
        members = []
        for i in range(200):
            key = f"img{t:02d}{i:04d}".encode()
            members += [(key + b".jpg", os.urandom(2000)), (key + b".txt", b"a caption")]
        (tmp / "corpus" / f"part-{t}.tar").write_bytes(tar_bytes(members))
    plan = tmp / "plan.toml"
    plan.write_text(f'[shards]\nbytes = "256KB"\n[regions.eu-west-1]\nweight = 1\nlocal = "{tmp / "split" / "eu-west-1"}"\n')
    r = run("split", tmp / "corpus", "--plan", plan, "--out", tmp / "split", "--workers", "1")
    assert r.returncode == 0, r.stderr
    return plan


@pytest.mark.slow
def test_data_only_mode_reports_the_io_wait_of_your_own_data(jpg_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = run("train", "--plan", jpg_plan, *TRAIN, "--steps", "10", "--out", out)
    _one_line(r, 2, "region eu-west-1: its samples have jpg, txt; the built-in model needs img and cls", "--model none --step-time 80ms")
    r = run("train", "--plan", jpg_plan, *TRAIN, "--steps", "10", "--model", "none", "--step-time", "80ms", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["steps"], report["samples"]) == (10, 2 * 10 * 16)
    assert all(x["compute_s"] >= 10 * 0.08 for x in report["ranks"])  # the stated compute, each step
    assert report["loss_first"] is None
    assert re.search(r"^IO wait: [\d.]+% of training time, budget 5\.0%: (within|over) budget$", r.stdout, re.M), r.stdout
    assert "2 rank(s) in eu-west-1, 10 steps (1..10), 320 samples" in r.stdout


_OWN_LOOP = """
import sys, time
from geoshard.loaders import make_loader
from geoshard.trainer.steplog import StepLog

plan, run_dir = sys.argv[1], sys.argv[2]
loader = make_loader(plan, region="eu-west-1", batch_size=16, num_workers=1, seed=0)
with StepLog(run_dir, loader) as steps:
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in steps:
            time.sleep(0.005)  # the user's forward, backward and optimizer step
            steps.note(loss=1.0 / (steps.step + 1))
print(steps.step, steps.samples)
"""


def test_step_log_from_your_own_loop_is_what_geoshard_report_reads(jpg_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    p = subprocess.run([sys.executable, "-P", "-c", _OWN_LOOP, jpg_plan, out], capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    steps, samples = map(int, p.stdout.split())
    assert steps == 2 * -(-600 // 16) and samples == 2 * 600  # two epochs of the region's 600 samples
    r = run("report", out, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["steps"], report["samples"], report["complete"]) == (steps, samples, True)
    b = report["breakdown"]
    parts = b["data_wait"]["seconds"] + b["compute"]["seconds"] + b["checkpoint"]["seconds"] + b["other"]["seconds"]
    assert parts == pytest.approx(b["wall"]["seconds"], abs=1e-3) and b["compute"]["seconds"] >= steps * 0.005
    assert report["io_wait_share"] == pytest.approx(b["data_wait"]["seconds"] / b["wall"]["seconds"], abs=1e-5)
    assert report["tiers"]["local:eu-west-1"]["hits"] > 0  # the loader's own counters came along


def test_samples_left_out_are_per_epoch_not_summed_over_ranks(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run")
    for rank in range(2):  # each rank's loader reports its region's figure: 1 sample per epoch over both ranks
        p = run_dir / f"rank{rank}.json"
        doc = json.loads(p.read_text())
        doc["loader"]["dropped_samples"] = 1
        p.write_text(json.dumps(doc))
    r = run("report", run_dir)
    assert r.returncode == 0, r.stderr
    assert "1 sample left out per epoch (a different block each epoch)" in r.stdout and "samples dropped" not in r.stdout
    assert json.loads((run_dir / "report.json").read_text())["dropped_samples"] == 1


# --- 10. egress is opt-in, and budgeted ------------------------------------------------------------


def test_cross_region_reads_are_opt_in_and_stop_at_the_budget(aws: SeaweedS3, tmp_path: Path) -> None:
    import hashlib

    from geoshard.loaders.chain import EgressBudgetExceeded, build_chain
    from geoshard.manifest import ShardEntry
    from geoshard.plan import parse_plan

    tag = f"egress-{os.getpid()}"
    own, far = aws.make_bucket(f"{tag}-eu")[5:], aws.make_bucket(f"{tag}-us")[5:]
    shards = {f"00000-{i:04d}-x.tar": os.urandom(30_000) for i in range(3)}
    with contextlib.closing(aws.client()) as c:
        for p, b in shards.items():
            c.put_object(Bucket=far, Key=f"train/{p}", Body=b)  # only the other region holds them
    regions = (
        f'[regions.eu-west-1]\nweight = 1\nbucket = "s3://{own}/train"\nendpoint = "{aws.endpoint}"\n'
        f'[regions.us-east-1]\nweight = 1\nbucket = "s3://{far}/train"\nendpoint = "{aws.endpoint}"\n'
    )
    off = build_chain(parse_plan(regions), "eu-west-1")
    assert [t.name for t in off.tiers] == ["s3:eu-west-1"]  # no [egress]: never another region's bucket
    plan = parse_plan("[egress]\ncross_region = true\nbudget = 70000\n" + regions)
    chain = build_chain(plan, "eu-west-1")
    assert [t.name for t in chain.tiers] == ["s3:eu-west-1", "s3:us-east-1"]
    entries = [ShardEntry(p, 1, len(b), hashlib.sha256(b).hexdigest()) for p, b in shards.items()]
    for e in entries[:2]:
        assert bytes(chain.fetch(e)) == shards[e.path]
    with pytest.raises(EgressBudgetExceeded) as err:
        chain.fetch(entries[2])
    msg = str(err.value)
    assert "from us-east-1's bucket into eu-west-1" in msg and "90,000 bytes, over the budget of 70,000 bytes per rank" in msg
    assert chain.stats.snapshot().to_dict()["egress_bytes"] == {"us-east-1->eu-west-1": 60_000}


def test_report_shows_egress_against_the_budget(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run")  # each rank read 2 MB from us-east-1's bucket
    for rank in range(2):
        p = run_dir / f"rank{rank}.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), "egress_budget": 8_000_000}))
    r = run("report", run_dir)
    assert r.returncode == 0, r.stderr
    assert "budget 8.0 MB per rank (egress.budget): the most one rank read is 2.0 MB, 25%" in r.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["egress_budget_bytes"], report["egress_bytes_max_rank"]) == (8_000_000, 2_000_000)


# --- 11. metrics for a Prometheus elsewhere, and the Grafana dashboard's queries against a real one ----


def _prometheus_query(port: int, path: str, **params: str) -> Any:
    import urllib.parse
    import urllib.request

    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "success", doc
    return doc["data"]


def _dashboard_queries() -> list[str]:
    doc = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    found: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if isinstance(x.get("expr"), str):
                found.append(x["expr"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    return found


@pytest.mark.slow
def test_grafana_dashboard_queries_against_prometheus_scraping_a_training_run(corpus_plan: Path, tmp_path: Path) -> None:
    import shutil
    import time
    import urllib.error

    from geoshard.local.ports import free_ports

    binary = shutil.which("prometheus") or pytest.fail("prometheus is not installed; make test installs it (apt-get install prometheus)")
    metrics, web = free_ports(2)
    config = tmp_path / "prometheus.yml"  # docs/prometheus.yml, pointed at this run's two ranks
    text = (ROOT / "docs" / "prometheus.yml").read_text().split("scrape_configs:")[0].replace("15s", "1s")
    config.write_text(
        text
        + "scrape_configs:\n  - job_name: geoshard\n    static_configs:\n"
        + f'      - targets: ["127.0.0.1:{metrics}", "127.0.0.1:{metrics + 1}"]\n'
    )
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"]
    with open(tmp_path / "prometheus.log", "w") as log, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT) as prom:
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    _prometheus_query(web, "/api/v1/status/buildinfo")
                    break
                except (urllib.error.URLError, ConnectionError):
                    assert time.monotonic() < deadline and prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                    time.sleep(0.5)
            args = ("--model", "none", "--step-time", "60ms", "--steps", "150", "--metrics-port", metrics, "--metrics-host", "127.0.0.1")
            r = run("train", "--plan", corpus_plan, *TRAIN, *args, "--out", tmp_path / "run")
            assert r.returncode == 0, r.stderr[-3000:]
            # the last moment Prometheus saw the ranks: evaluate every panel there
            last = _prometheus_query(web, "/api/v1/query", query="max(max_over_time(timestamp(geoshard_io_wait_share)[10m:1s]))")["result"]
            assert last, "Prometheus never scraped the ranks"
            at = last[0]["value"][1]
            regions = _prometheus_query(web, "/api/v1/label/region/values", **{"match[]": "geoshard_step_seconds_count"})
            ranks = _prometheus_query(web, "/api/v1/label/rank/values", **{"match[]": 'geoshard_step_seconds_count{region=~"eu-west-1"}'})
            assert (regions, ranks) == (["eu-west-1"], ["0", "1"])
            for expr in _dashboard_queries():
                q = expr.replace("$region", "eu-west-1").replace("$rank", ".*").replace("$__rate_interval", "5s").replace("$__range", "5m")
                result = _prometheus_query(web, "/api/v1/query", query=q, time=at)["result"]
                if "gpu_utilization" in expr or "egress" in expr:
                    assert all(float(x["value"][1]) == 0 for x in result), (expr, result)  # no GPU here, no cross-region reads
                    continue
                assert result, expr
                values = [float(x["value"][1]) for x in result]
                assert all(v >= 0 and v == v for v in values), (expr, values)
                if "histogram_quantile" in expr:
                    assert all(0.05 <= v <= 30 for v in values), (expr, values)  # a step is the 60 ms stated, plus the data wait
                if expr.startswith("geoshard_io_wait_share"):
                    assert len(values) == 2 and all(v <= 1 for v in values), values
        finally:
            prom.terminate()
            prom.wait(timeout=30)


@pytest.mark.slow
def test_train_draws_a_progress_bar_on_a_terminal(corpus_plan: Path, tmp_path: Path) -> None:
    args = ("--model", "none", "--step-time", "100ms", "--steps", "40")
    drawn = _on_a_terminal("train", "--plan", corpus_plan, *TRAIN, *args, "--out", tmp_path / "run", cwd=tmp_path)
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)
    bars = re.findall(r"train [━╸╺ ]+ step (\d+)/40  loss -  ([\d,]+) samples/s  data wait ([\d.]+)%", frames)
    assert bars and int(bars[-1][0]) == 40, frames[-3000:]  # the bar ends at the last step
    assert any(0 < int(step) < 40 for step, _, _ in bars), bars  # and moved while training
    assert all(int(rate.replace(",", "")) < 10_000 for _, rate, _ in bars), bars  # 2 ranks x 16 samples per 100 ms
    assert "IO wait: " in frames  # then the report
