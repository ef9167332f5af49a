"""Your own data, end to end (issue 22, item 6): routing mistakes in a user's plan are one line
that says what to change. A ``field`` the samples lack lists their fields (the JSON member's keys
as ``json.<key>``) and names the nearest; ``routing.key`` on a WebDataset corpus, which would be
ignored, is refused. Each test runs the real ``geoshard split`` in a subprocess and checks its
whole output, exit code, and that nothing was published."""

from __future__ import annotations

from pathlib import Path

import pytest
from guaranteekit import Run, geoshard, published
from splitkit import make_corpus, write_plan

_MAP = '[routing.map]\n"us-east-1" = "us-east-1"\n"eu-west-1" = "eu-west-1"\n"ap-southeast-1" = "ap-southeast-1"'


def _split(tmp: Path, plan: Path, fmt: str = "wds") -> tuple[Run, Path]:
    corpus = make_corpus(tmp / "corpus", fmt=fmt, samples=40, shard_samples=40)  # one source: its first sample fails first
    r = geoshard("split", *corpus, "--plan", plan, "--out", tmp / "out", cwd=tmp)
    return r, corpus[0]


@pytest.mark.parametrize(
    ("field", "fix"),
    [
        ("origin", 'set routing.field = "json.origin" (the nearest)'),
        ("country", "name one of them in routing.field"),  # no near name: the fields only
    ],
)
def test_a_field_the_samples_lack_lists_their_fields_and_names_the_nearest(tmp_path: Path, field: str, fix: str) -> None:
    plan = write_plan(tmp_path / "plan.toml", policy="field", extra=f'field = "{field}"\n{_MAP}')
    r, source = _split(tmp_path, plan)
    assert r.rc == 1 and r.out == "", r
    assert r.err.splitlines() == [
        f"geoshard: error: {source}: sample 's00000000' has no field '{field}' (its fields: cls, img, json, json.label, json.origin); "
        f"{fix}, or set routing.default_region for samples without it"
    ]
    assert published(tmp_path / "out") == []


def test_a_tfrecord_feature_the_records_lack_lists_their_features(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.toml", policy="field", extra=f'field = "orign"\nkey = "key"\n{_MAP}')
    r, source = _split(tmp_path, plan, fmt="tfrecord")
    assert r.rc == 1 and r.out == "", r
    assert r.err.splitlines() == [
        f"geoshard: error: {source}: sample record 0 has no field 'orign' (its fields: image, key, label, origin); "
        'set routing.field = "origin" (the nearest), or set routing.default_region for samples without it'
    ]


def test_routing_key_on_a_webdataset_corpus_is_refused(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.toml", extra='key = "img_id"')
    r, _ = _split(tmp_path, plan)
    assert r.rc == 2 and r.out == "", r
    assert r.err.splitlines() == [
        f"geoshard: error: {plan}: routing.key: 'img_id' applies to TFRecord corpora only (the feature that names a record); "
        "WebDataset samples are keyed by their __key__: remove routing.key"
    ]
    assert not (tmp_path / "out" / "manifest.json").exists()
