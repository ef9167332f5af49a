"""Issue 20 for DiLoCo: every value in the outer store is signed with the job's secret and checked
against the model before use; a poisoning attempt from outside the job is refused and counted; a
region's own non-finite pseudo-gradient is left out of its round and named; a region that finished
is never counted missing; a region whose pseudo-gradient a round averaged is a member of it even
when it looks after the round was published (issue 23, part 6); the secret appears nowhere."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import resource
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_diloco import REGIONS, SECRET, _port, finish, rounds_at, start
from torch import nn

from geoshard.errors import ConfigError
from geoshard.trainer.diloco import DiLoCo, OuterSync, RoundRecord, connect_store, host_store, state_auth
from geoshard.trainer.diloco.auth import Signer, read_secret
from geoshard.trainer.diloco.kv import KV
from geoshard.trainer.diloco.report import outer_section

US, EU = REGIONS


def _filled(value: float, n: int = 3) -> nn.Module:
    m = nn.Linear(n, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def _nan_state(numel: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"round": 5, "step": 500, "params": torch.full((numel,), float("nan")), "momentum": None}, buf)
    return buf.getvalue()


def _plant(port: int, numel: int) -> None:
    """What an outsider who reaches the store's port does: a NaN outer state of the right length as
    the newest round, and NaN fp16 pseudo-gradients for rounds to come, none of it signed."""
    store = connect_store("127.0.0.1", port)
    store.set("diloco/state/5/0", _nan_state(numel))
    store.set("diloco/state/5", "1")
    store.set("diloco/latest", "5")
    nan16 = torch.full((numel,), float("nan"), dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    for r in (1, 2, 3):
        for g in REGIONS:
            store.set(f"diloco/r/{r}/grad/{g}/0", nan16)
            store.set(f"diloco/r/{r}/grad/{g}", "1")


def _cmdlines_hold(needles: list[bytes], pids: list[int]) -> list[int]:
    found = []
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if any(n in raw for n in needles):
            found.append(pid)
    return found


def test_a_poisoning_attempt_from_outside_the_job_is_refused_counted_and_named(tmp_path: Path) -> None:
    """Two region processes (real TCPStore, the default key prefix). Before they join, an outsider
    sets ``diloco/latest`` and a NaN state of the model's length, and NaN fp16 pseudo-gradients for
    rounds 1-3. Every step's loss stays finite, the regions agree, the refusals are in the rounds
    records and one warning per kind names the key; the secret is in no process's argv or
    environment and in no output."""
    server = host_store()
    numel = 16 * 32 + 32 + 32 * 4 + 4  # the job's model (tests/jobs/diloco_region.py)
    _plant(server.port, numel)
    procs = [start("trust", g, 0, 1, _port(), server.port, tmp_path) for g in REGIONS]
    leaks: list[int] = []
    needles = [SECRET, SECRET.hex().encode()]
    for _ in range(20):  # while they run
        leaks += _cmdlines_hold(needles, [p.pid for p in procs])
        time.sleep(0.1)
    finish(procs, tmp_path)
    assert leaks == []
    results = {g: json.loads((tmp_path / f"trust-{g}.json").read_text()) for g in REGIONS}
    for g, res in results.items():
        assert all(math.isfinite(x) for x in res["losses"]), (g, res["losses"])
        assert [r["round"] for r in res["records"]] == list(range(1, 9))
        assert all(r["regions"] == list(REGIONS) and "left_out" not in r for r in res["records"])
    assert results[US]["digest"] == results[EU]["digest"]
    # us-east-1 refused the planted latest at least (and the planted pseudo-gradients it saw before the regions' own overwrote them).
    assert results[US]["join_refused"] >= 1
    refused = sum(r.get("refused", 0) for res in results.values() for r in res["records"]) + results[EU]["join_refused"]
    print(f"refusals after the join: {refused}")
    logs = "\n".join(f.read_text() for f in tmp_path.glob("*.log"))
    assert "Traceback" not in logs
    assert logs.count("refused diloco/") <= 2 * 2  # once per kind, per region
    assert "(unauthenticated: no signature)" in logs
    outputs = [f.read_bytes() for f in tmp_path.iterdir() if f.is_file() and f.name != "outer-secret"]
    assert not any(n in out for out in outputs for n in needles)


def test_a_regions_own_non_finite_pseudo_gradient_is_left_out_named_and_the_others_averaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eu-west-1's parameters turn NaN after step 12: round 3 (step 15) leaves its pseudo-gradient
    out on both leaders, averages us-east-1's alone, and eu-west-1 takes that result and trains on
    with finite losses; one warning line names the region and the reason; the report lists it."""
    from geoshard.trainer.diloco.record import append, rounds_path

    server = host_store()
    monkeypatch.setenv("NAN_AT", "12")  # the region processes inherit it
    finish([start("trust", g, 0, 1, _port(), server.port, tmp_path) for g in REGIONS], tmp_path)
    results = {g: json.loads((tmp_path / f"trust-{g}.json").read_text()) for g in REGIONS}
    for g, res in results.items():
        third = res["records"][2]
        assert third["round"] == 3 and list(third["left_out"]) == [EU], (g, third)
        assert third["left_out"][EU].startswith("non-finite: ")
        assert all("left_out" not in r for i, r in enumerate(res["records"]) if i != 2)
        assert all(math.isfinite(x) for x in res["losses"][15:]), (g, res["losses"])
    assert results[US]["digest"] == results[EU]["digest"]
    logs = "\n".join(f.read_text() for f in tmp_path.glob("*.log"))
    assert logs.count(f"leaves out {EU}'s pseudo-gradient (non-finite:") == 2  # one line per leader, once
    assert "Traceback" not in logs
    for g, res in results.items():
        for r in res["records"]:
            append(rounds_path(tmp_path, g), RoundRecord.from_dict({**r, "region": g, "event": "round"}))
    section = outer_section(tmp_path)
    assert section is not None and [(x["round"], x["region"]) for x in section["left_out"]] == [(3, EU)]


def _leader(model: nn.Module, region: str, port: int, sync: OuterSync, store: Any = None) -> DiLoCo:
    d = DiLoCo(model, sync, region, REGIONS, secret=SECRET)
    d.join(store if store is not None else connect_store("127.0.0.1", port))
    return d


def test_malformed_values_signed_by_a_member_each_give_one_refusal_never_a_traceback_or_the_claimed_allocation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Values signed with the job's secret (a member gone wrong) but wrong for the model: a garbage
    ``diloco/latest``, a head claiming 10^7 parts, and a 10-element state. A region joining refuses
    each (one warning), keeps its own parameters, and never allocates what the head claims."""
    caplog.set_level(logging.WARNING)
    server = host_store()
    sync = OuterSync(outer_steps=5, round_timeout_s=5, join_timeout_s=5)
    _leader(_filled(1.0), US, server.port, sync)
    kv = KV(connect_store("127.0.0.1", server.port), "diloco", Signer(SECRET))
    state0 = [kv.store.get(k) for k in ("diloco/state/0", "diloco/state/0/0")]  # the honest round 0, put back at the end

    kv.set("diloco/latest", "1e9; drop")
    late = DiLoCo(_filled(7.0), sync, EU, REGIONS, secret=SECRET)
    with pytest.raises(Exception, match="no outer state of round 0 or later appeared in the store within 5 s") as e:
        late.join(connect_store("127.0.0.1", server.port))
    assert "\n" not in str(e.value)
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [
        "DiLoCo: refused diloco/latest from the outer store (malformed: '1e9; drop' is not a round number (0 to 1000000000)); "
        "further malformed values are counted in the rounds file, not logged"
    ]
    kv.set("diloco/latest", "0")

    caplog.clear()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kv.set("diloco/state/0", f"10000000 {10**7 * (4 << 20)} {'0' * 64}")
    rec = (late := DiLoCo(_filled(7.0), sync, EU, REGIONS, secret=SECRET)).join(connect_store("127.0.0.1", server.port))
    assert rec.refused == 1 and all(p.eq(7.0).all() for p in late.model.parameters())  # its own parameters
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200_000  # KiB: nothing of the claimed 40 TB
    msgs = [r.getMessage() for r in caplog.records]
    assert any("refused diloco/state/0 from the outer store (malformed: 10000000 parts of" in m for m in msgs), msgs
    assert any(f"region {EU} refused the published outer state of round 0" in m and "keeps its own parameters" in m for m in msgs)

    caplog.clear()
    buf = io.BytesIO()
    torch.save({"round": 0, "step": 0, "params": torch.zeros(10), "momentum": None}, buf)
    kv.put("diloco/state/0", buf.getvalue())
    rec = (late := DiLoCo(_filled(7.0), sync, EU, REGIONS, secret=SECRET)).join(connect_store("127.0.0.1", server.port))
    assert rec.refused == 1 and all(p.eq(7.0).all() for p in late.model.parameters())
    msgs = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any("its parameters are torch.float32 (10,), the model's are torch.float32 (8,)" in m for m in msgs), msgs

    kv.store.set("diloco/state/0/0", state0[1])
    kv.store.set("diloco/state/0", state0[0])
    rec = (late := DiLoCo(_filled(7.0), sync, EU, REGIONS, secret=SECRET)).join(connect_store("127.0.0.1", server.port))
    assert rec.refused == 0 and all(p.eq(1.0).all() for p in late.model.parameters())  # the honest state again


def test_unsigned_values_are_refused_and_a_value_cannot_be_replayed_under_another_key() -> None:
    server = host_store()
    kv = KV(connect_store("127.0.0.1", server.port), "diloco", Signer(SECRET))
    kv.set("diloco/r/1/members", f"{US},{EU}")
    assert kv.get("diloco/r/1/members") == f"{US},{EU}".encode()
    kv.store.set("diloco/r/2/members", kv.store.get("diloco/r/1/members"))  # replayed under round 2's key
    kv.store.set("diloco/r/3/members", f"{US},{EU}")  # unsigned
    assert kv.get("diloco/r/2/members") is None and kv.get("diloco/r/3/members") is None
    assert kv.signer.refused == {"unauthenticated": 2}
    other = KV(kv.store, "diloco", Signer(secrets.token_bytes(32)))  # another job's secret
    assert other.get("diloco/r/1/members") is None


def test_state_sent_by_broadcast_is_checked_exactly_against_its_signed_digests() -> None:
    """Round 0's and a rejoin's state (``state_auth``): the pieces that arrived pass only when every
    bit is the sender's; a changed bit, a digest replayed under another key, one unsigned, a wrong
    count or none at all are each refused in one reason, never a traceback."""
    server = host_store()
    kv = KV(connect_store("127.0.0.1", server.port), "diloco", Signer(SECRET))
    sent = torch.randn(10_001)
    pieces = [sent[:5000], sent[5000:]]
    state_auth.publish(kv, "diloco/r/0/0/state/0", pieces)
    assert state_auth.check(kv, "diloco/r/0/0/state/0", [p.clone() for p in pieces], 1.0) == ""
    bit = sent.clone()
    bit.view(torch.int32)[7000] ^= 1  # the last bit of one value's mantissa
    why = state_auth.check(kv, "diloco/r/0/0/state/0", [bit[:5000], bit[5000:]], 1.0)
    assert why == "piece 1 of diloco/r/0/0/state/0: the bytes that arrived do not match the source's signed digest", why
    kv.store.set("diloco/r/0/0/state/1", kv.store.get("diloco/r/0/0/state/0"))  # replayed under shard 1's key
    assert state_auth.check(kv, "diloco/r/0/0/state/1", pieces, 1.0) == "diloco/r/0/0/state/1 is not signed by the job"
    kv.store.set("diloco/r/0/0/state/2", "0" * 64)  # unsigned
    assert state_auth.check(kv, "diloco/r/0/0/state/2", pieces, 1.0) == "diloco/r/0/0/state/2 is not signed by the job"
    assert state_auth.check(kv, "diloco/r/0/0/state/0", pieces[:1], 1.0) == "diloco/r/0/0/state/0 holds 2 digests for the 1 pieces sent"
    missing = state_auth.check(kv, "diloco/r/0/0/state/3", pieces, 0.2)
    assert missing == "the source's signed digests (diloco/r/0/0/state/3) did not arrive within 0.2 s"
    assert kv.signer.refused == {"unauthenticated": 3, "malformed": 1}


def test_a_region_that_finished_is_never_counted_missing_nor_waited_for() -> None:
    """us-east-1 starts round 2 expecting eu-west-1, which finishes its steps instead: us-east-1
    stops waiting within a second or two (not its 20 s timeout), and neither that round nor the
    next counts eu-west-1 missing."""
    server = host_store()
    sync = OuterSync(outer_steps=1, outer_lr=1.0, outer_momentum=0.0, round_timeout_s=20)
    dl = {g: _leader(_filled(1.0), g, server.port, sync) for g in REGIONS}
    recs = rounds_at(dl, 1)
    assert all(r is not None and r.regions == REGIONS for r in recs.values())
    out: dict[str, RoundRecord] = {}
    t = threading.Thread(target=lambda: out.__setitem__("r2", dl[US].sync_now(2)))
    t.start()
    time.sleep(0.5)  # us-east-1 read the roster (eu-west-1 expected) and waits
    dl[EU].leave()
    t.join(60)
    assert out["r2"].regions == (US,) and out["r2"].missing == () and out["r2"].sync_s < 5, out["r2"]
    r3 = dl[US].sync_now(3)
    assert r3.regions == (US,) and r3.missing == () and r3.sync_s < 5


class _LateRoster:
    """eu-west-1's store: its roster read after publishing waits until round ``r`` is published."""

    def __init__(self, store: Any, kv: KV, r: int) -> None:
        self.store, self.kv, self.r = store, kv, r

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        if keys[-1] == "diloco/latest" and len(keys) == len(REGIONS) + 1:
            deadline = time.monotonic() + 30
            while self.kv.get("diloco/latest") != str(self.r).encode() and time.monotonic() < deadline:
                time.sleep(0.01)
        return list(self.store.multi_get(keys))


def test_a_leader_that_reads_the_roster_after_its_round_was_published_is_a_member_not_an_adopter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 23, part 6: eu-west-1 publishes its pseudo-gradient for round 1, and its roster read
    arrives only after us-east-1 closed, averaged (both) and published the round. eu-west-1 is a
    member: it averages the same values, adopts nothing, loses no steps, and no 'missed' warning;
    both records and both models agree."""
    caplog.set_level(logging.WARNING)
    server = host_store()
    sync = OuterSync(outer_steps=1, outer_lr=1.0, outer_momentum=0.0, compression="none", round_timeout_s=20)
    models = {US: _filled(1.0), EU: _filled(1.0)}
    watcher = KV(connect_store("127.0.0.1", server.port), "diloco", Signer(SECRET))
    dl = {US: _leader(models[US], US, server.port, sync)}
    dl[EU] = _leader(models[EU], EU, server.port, sync, _LateRoster(connect_store("127.0.0.1", server.port), watcher, 1))
    for g, v in ((US, 0.5), (EU, 0.25)):
        with torch.no_grad():
            for p in models[g].parameters():
                p.fill_(v)
    recs = rounds_at(dl, 1)
    for g, rec in recs.items():
        assert rec is not None and (rec.round, rec.regions, rec.missing, rec.adopted) == (1, REGIONS, (), False), (g, rec)
        assert all(p.eq(0.375).all() for p in models[g].parameters()), g
    assert recs[EU] is not None and recs[EU].bytes_read == 8 * 4  # us-east-1's pseudo-gradient, not the state
    assert not [r for r in caplog.records if "missed" in r.getMessage()]


def test_a_secret_file_is_required_private_and_long_enough(tmp_path: Path) -> None:
    from geoshard.trainer.config import TrainConfig

    key = tmp_path / "key"
    key.write_bytes(SECRET)
    key.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"--outer-secret-file {key}: others can read it \(mode 644\); chmod 600 {key}"):
        read_secret(key)
    key.chmod(0o600)
    assert read_secret(key) == SECRET
    key.write_bytes(b"short")
    with pytest.raises(ConfigError, match="5 bytes; the secret must hold at least 16"):
        read_secret(key)
    with pytest.raises(ConfigError, match="--outer-store needs --outer-secret-file"):
        TrainConfig(plan=tmp_path / "p.toml", out=tmp_path, steps=10, sync="diloco", outer_store="127.0.0.1:1", outer_regions=f"{US}:1")


def test_the_trainer_refuses_an_outer_store_without_a_secret_in_one_line(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[regions.{US}]\nbucket = "s3://b/p"\n')
    argv = [sys.executable, "-m", "geoshard.trainer", "--plan", str(plan), "--region", US, "--steps", "5", "--out", str(tmp_path / "run")]
    argv += ["--sync", "diloco", "--outer-store", "127.0.0.1:1", "--outer-regions", f"{US}:1"]
    env = {k: v for k, v in os.environ.items() if k != "GEOSHARD_OUTER_SECRET_FILE"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("geoshard.trainer: error: --outer-store needs --outer-secret-file")


def _holders(needles: list[bytes]) -> list[int]:
    """Processes whose argv or environment holds any of ``needles``."""
    return _cmdlines_hold(needles, [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and int(e.name) != os.getpid()])


@pytest.mark.slow
def test_geoshard_train_hands_the_secret_out_of_band_and_it_appears_nowhere(tmp_path: Path) -> None:
    """``geoshard train --regions ... --sync diloco``: while it runs, RUN_DIR/.outer-secret holds 32
    random bytes (mode 600), and no process has them (raw or hex) in its argv or environment; the
    rounds are all signed (nothing refused); afterwards the file is gone and no output holds them."""
    from test_diloco_train import local_plan, train_argv

    plan = local_plan(tmp_path, {US: 1, EU: 1}, samples=1200)
    out = tmp_path / "run"
    argv = train_argv(plan, out, f"{US}:1,{EU}:1", "--steps", 30, "--outer-steps", 5, "--step-time", "0.1", "--hidden", 64)
    key = out / ".outer-secret"
    with (tmp_path / "run.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    leaks, secret, mode = [], b"", 0
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if not secret and key.exists():
                mode, secret = key.stat().st_mode & 0o777, key.read_bytes()
            if secret:
                leaks += _holders([secret, secret.hex().encode()])
            time.sleep(0.5)
        code = proc.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = (tmp_path / "run.log").read_text()
    assert code == 0, text[-3000:]
    assert len(secret) == 32 and mode == 0o600 and leaks == []
    assert not key.exists()
    report = json.loads((out / "report.json").read_text())
    assert report["outer"]["refused"] == {} and report["outer"]["left_out"] == []
    assert all(r["regions"] == [US, EU] for r in report["outer"]["rounds"])
    for f in [tmp_path / "run.log", *out.rglob("*")]:
        if f.is_file():
            data = f.read_bytes()
            assert secret not in data and secret.hex().encode() not in data, f
