"""Shard formats: TFRecord framing, tf.train.Example, WebDataset tar grouping, streaming memory."""

from __future__ import annotations

import gzip
import io
import random
import tarfile
import tracemalloc
from pathlib import Path

import google_crc32c
import pytest
from splitkit import tar_bytes

from geoshard.errors import DataError
from geoshard.formats import FORMATS, SHARD_SUFFIX, detect_format, example, format_of_name, format_spec, tfrecord, wds
from geoshard.formats._window import Window
from geoshard.formats.wds import reader


def _records(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(0, 3000)) for _ in range(n)]


# --- TFRecord ---------------------------------------------------------------------------------


def test_registry_names_each_format_and_refuses_an_unknown_one() -> None:
    """Every module asks the registry: names, suffixes, detection, and one clear error for a format it does not know."""
    assert FORMATS == ("wds", "tfrecord") and dict(SHARD_SUFFIX) == {"wds": ".tar", "tfrecord": ".tfrecord"}
    assert [format_spec(f).name for f in FORMATS] == list(FORMATS)
    assert (
        format_of_name("s3://b/x/train-0.TFRecords.gz") == "tfrecord"
        and format_of_name("a.tar") == "wds"
        and format_of_name("a.zip") is None
    )
    buf = io.BytesIO()
    wds.TarWriter(buf).write_sample([(b"k.txt", b"x")])
    assert detect_format(buf.getvalue()[:512]) == "wds" and detect_format(tfrecord.frame(b"x")) is None
    with pytest.raises(DataError, match=r"shard\.bin: unknown shard format 'parquet'; geoshard reads wds or tfrecord"):
        format_spec("parquet", "shard.bin")


def test_tfrecord_round_trip_and_framing() -> None:
    recs = _records(300)
    buf = io.BytesIO()
    w = tfrecord.TFRecordWriter(buf)
    for r in recs:
        w.write(r)
    data = buf.getvalue()
    assert len(data) == sum(len(r) + 16 for r in recs)
    framed = list(tfrecord.iter_framed(io.BytesIO(data), "t"))
    assert [bytes(r) for r, _ in framed] == recs
    assert b"".join(f for _, f in framed) == data  # framed bytes are the input's, copyable verbatim


def test_tfrecord_masked_crc_known_value() -> None:
    # Value from TensorFlow's crc32c masking of the 8-byte little-endian length 0.
    # CRC-32C's standard check value, then TFRecord's mask: rotate right by 15, add 0xa282ead8.
    crc = 0xE3069283
    assert google_crc32c.value(b"123456789") == crc
    assert tfrecord.masked_crc(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert tfrecord.masked_crc(b"") == 0xA282EAD8  # crc32c("") is 0, so only the mask delta remains


def test_tfrecord_bad_length_crc_names_record_and_offset() -> None:
    recs = _records(5)
    data = bytearray(b"".join(tfrecord.frame(r) for r in recs))
    off = sum(len(r) + 16 for r in recs[:3])
    data[off + 8] ^= 0xFF  # corrupt record 3's length CRC
    with pytest.raises(DataError, match=rf"f\.tfrecord: bad length CRC in record 3 at byte {off}"):
        list(tfrecord.iter_records(io.BytesIO(bytes(data)), "f.tfrecord"))


def test_tfrecord_bad_data_crc_names_record() -> None:
    recs = [b"x" * 100] * 4
    data = bytearray(b"".join(tfrecord.frame(r) for r in recs))
    data[116 * 2 + 12 + 50] ^= 1
    with pytest.raises(DataError, match=r"bad data CRC in record 2 at byte 232"):
        list(tfrecord.iter_records(io.BytesIO(bytes(data)), "f"))


@pytest.mark.parametrize("cut", [5, 12 + 40, 12 + 100 + 2])
def test_tfrecord_truncated_names_offset(cut: int) -> None:
    data = tfrecord.frame(b"a" * 50) + tfrecord.frame(b"b" * 100)
    with pytest.raises(DataError, match=r"f: truncated TFRecord at byte 66"):
        list(tfrecord.iter_records(io.BytesIO(data[: 66 + cut]), "f"))


def test_not_a_tfrecord() -> None:
    with pytest.raises(DataError, match="bad length CRC in record 0 at byte 0; not a TFRecord"):
        list(tfrecord.iter_records(io.BytesIO(b"hello world, this is text\n" * 4), "notes.tfrecord"))


# --- tf.train.Example -------------------------------------------------------------------------


def test_example_round_trip_and_single_feature() -> None:
    rec = example.encode_example({"key": b"k1", "label": [3, -7, 2**40], "score": [0.5, -2.0], "origin": "eu-west-1", "empty": []})
    parsed = example.parse_example(rec)
    assert parsed == {"empty": [], "key": [b"k1"], "label": [3, -7, 2**40], "origin": [b"eu-west-1"], "score": [0.5, -2.0]}
    assert example.get_feature(rec, "origin") == [b"eu-west-1"]
    assert example.get_feature(rec, "absent") is None


def test_example_rejects_garbage() -> None:
    with pytest.raises(example.ExampleError):
        example.parse_example(b"\x0a\xff\xff\xff\xff\x0f")


# --- WebDataset tar ---------------------------------------------------------------------------


def _samples(n: int, seed: int = 1) -> list[tuple[bytes, list[tuple[bytes, bytes]]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        key = f"dir/s{i:05d}".encode()
        out.append(
            (
                key,
                [
                    (key + b".jpg", rng.randbytes(rng.randrange(0, 2000))),
                    (key + b".cls", str(i % 7).encode()),
                    (key + b".meta.json", b"{}"),
                ],
            )
        )
    return out


def _geoshard_tar(samples: list[tuple[bytes, list[tuple[bytes, bytes]]]]) -> bytes:
    buf = io.BytesIO()
    w = wds.TarWriter(buf)
    for _, members in samples:
        w.write_sample(members)
    w.close()
    return buf.getvalue()


def _stdlib_tar(samples: list[tuple[bytes, list[tuple[bytes, bytes]]]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for _, members in samples:
            for name, data in members:
                info = tarfile.TarInfo(name.decode())
                info.size = len(data)
                info.mtime = 1.5  # a float mtime makes tarfile emit a PAX header, as webdataset's writer does
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _read(data: bytes) -> list[tuple[bytes, list[tuple[bytes, bytes]]]]:
    return list(wds.iter_samples(io.BytesIO(data), "t.tar"))


def test_geoshard_tar_is_read_by_tarfile_byte_identical() -> None:
    samples = _samples(50)
    data = _geoshard_tar(samples)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        got = [(m.name.encode(), tf.extractfile(m).read()) for m in tf.getmembers()]  # type: ignore[union-attr]
    assert got == [m for _, ms in samples for m in ms]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_grouping_matches_across_tar_dialects(fmt: int) -> None:
    samples = _samples(200)
    assert _read(_stdlib_tar(samples, fmt)) == samples
    assert _read(_geoshard_tar(samples)) == samples


def test_fast_and_slow_paths_agree_and_output_is_compact() -> None:
    samples = _samples(3000)
    data = _geoshard_tar(samples)
    fast = list(wds.iter_raw_samples(io.BytesIO(data), "t"))
    slow = list(reader._slow_samples(Window(io.BytesIO(data)), "t"))
    assert fast == slow and len(fast) == 3000
    pax = _stdlib_tar(samples, tarfile.PAX_FORMAT)
    assert list(wds.iter_raw_samples(io.BytesIO(pax), "t")) != []
    # Re-encoded from PAX input, samples carry one header block per member: same bytes as geoshard writes.
    assert [k for k, _ in wds.iter_raw_samples(io.BytesIO(pax), "t")] == [k for k, _ in fast]
    assert sum(len(r) for _, r in wds.iter_raw_samples(io.BytesIO(pax), "t")) == sum(len(r) for _, r in fast)


def test_long_names_use_prefix_or_pax_and_read_back() -> None:
    deep = ("d" * 60 + "/") * 2 + "k" * 30
    huge = "x" * 180
    samples = [(deep.encode(), [(deep.encode() + b".txt", b"deep")]), (huge.encode(), [(huge.encode() + b".txt", b"huge")])]
    data = _geoshard_tar(samples)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert [m.name for m in tf.getmembers()] == [deep + ".txt", huge + ".txt"]
    assert _read(data) == samples


def test_fake_header_inside_data_is_not_a_member() -> None:
    # A member whose data is itself a tar: its inner headers carry the ustar magic at the right offset.
    inner = _geoshard_tar(_samples(3))
    samples = [(b"a", [(b"a.tar", inner), (b"a.cls", b"1")]), (b"b", [(b"b.cls", b"2")])] * 200
    samples = [(f"s{i}".encode(), [(f"s{i}".encode() + m[0][1:], m[1]) for m in ms]) for i, (_, ms) in enumerate(samples)]
    assert _read(_geoshard_tar(samples)) == samples


def test_metadata_members_are_skipped_like_webdataset() -> None:
    samples = _samples(3)
    buf = io.BytesIO()
    w = wds.TarWriter(buf)
    w.write_member(b"__index__", b"ignored")
    for _, ms in samples:
        w.write_sample(ms)
    w.close()
    assert _read(buf.getvalue()) == samples


def test_member_without_sample_is_an_error() -> None:
    data = tar_bytes([(b"a.jpg", b"1"), (b"README", b"text")])
    with pytest.raises(DataError, match=r"t\.tar: tar member 'README' at byte 1024 belongs to no sample"):
        _read(data)


def test_repeated_field_is_a_duplicate_key() -> None:
    data = tar_bytes([(b"a.jpg", b"1"), (b"a.cls", b"2"), (b"a.jpg", b"3")] + [(f"k{i}.x".encode(), b"") for i in range(100)])
    with pytest.raises(DataError, match=r"duplicate sample key 'a': field 'jpg' appears twice"):
        _read(data)


@pytest.mark.parametrize("key", [b"bad\nkey", b"tab\tkey", b"del\x7fkey"])
def test_control_character_in_key_is_an_error(key: bytes) -> None:
    data = tar_bytes([(b"ok.x", b"1"), (key + b".jpg", b"1")])
    with pytest.raises(DataError, match="contains a control character"):
        _read(data)


def test_not_a_tar_and_empty_and_truncated() -> None:
    with pytest.raises(DataError, match=r"t\.tar: bad tar header checksum at byte 0; not a tar archive"):
        _read(b"this is plain text, not a tar archive at all " * 40)
    with pytest.raises(DataError, match="empty file"):
        _read(b"")
    data = tar_bytes([(b"a.bin", b"1" * 2000), (b"b.bin", b"2" * 2000)])
    with pytest.raises(DataError, match=r"truncated tar at byte 2560: member declares 2000 bytes"):
        _read(data[:4000])
    with pytest.raises(DataError, match=r"truncated tar at byte 2560: partial header"):
        _read(data[:2600])


# --- streaming --------------------------------------------------------------------------------


class _Repeating:
    """A stream of ``total`` bytes made of one block repeated: large input without large memory."""

    def __init__(self, block: bytes, total: int, trailer: bytes = b"") -> None:
        self.block, self.left, self.trailer, self.pos = block, total, trailer, 0

    def read(self, n: int = -1, /) -> bytes:
        if self.left <= 0:
            out, self.trailer = self.trailer[: max(n, 0)], self.trailer[max(n, 0) :]
            return out
        reps = max(1, min(n, self.left) // len(self.block))
        self.left -= reps * len(self.block)
        return self.block * reps


class _GeneratedTar:
    """A tar stream of ``n`` distinct 1 KB samples, produced as it is read."""

    def __init__(self, n: int) -> None:
        self.n, self.i, self.pending = n, 0, b""

    def read(self, size: int = -1, /) -> bytes:
        parts = [self.pending]
        have = len(self.pending)
        while have < size and self.i < self.n:
            parts.append(wds.member_header(b"k%09d.bin" % self.i, 1024) + b"z" * 1024)
            have += 1536
            self.i += 1
            if self.i == self.n:
                parts.append(bytes(1024))  # end-of-archive blocks
        data = b"".join(parts)
        self.pending = data[size:]
        return data[:size]


def test_readers_stream_in_bounded_memory() -> None:
    rec = tfrecord.frame(b"r" * 1000)
    tracemalloc.start()
    try:
        n = sum(1 for _ in tfrecord.iter_records(_Repeating(rec, 80_000 * len(rec)), "big"))
        _, peak_tf = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        m = sum(1 for _ in wds.iter_raw_samples(_GeneratedTar(60_000), "big"))
        _, peak_tar = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (n, m) == (80_000, 60_000)
    assert peak_tf < 16 * 2**20, peak_tf  # 81 MB streamed
    assert peak_tar < 32 * 2**20, peak_tar  # 92 MB streamed through 4 MB windows


def test_gzip_tfrecord_source(tmp_path: Path) -> None:
    recs = _records(50)
    p = tmp_path / "a.tfrecord.gz"
    with gzip.open(p, "wb") as f:
        for r in recs:
            f.write(tfrecord.frame(r))
    with gzip.open(p, "rb") as f:
        assert list(tfrecord.iter_records(f, str(p))) == recs
