"""Indexing a fetched shard: the column-wise fast path for compact uniform tars gives exactly what
geoshard's member-by-member reader gives, and every tar it declines still reads (or fails) as before."""

from __future__ import annotations

import io
import mmap
import tarfile
from pathlib import Path
from typing import Any

import pytest

from geoshard.errors import DataError
from geoshard.formats import wds
from geoshard.loaders.shard import Shard


def compact(samples: list[list[tuple[bytes, bytes]]]) -> bytes:
    f = io.BytesIO()
    w = wds.TarWriter(f)
    for members in samples:
        w.write_sample(members)
    w.close()
    return f.getvalue()


def reference(buf: bytes) -> list[dict[str, Any]]:
    return [{"__key__": k.decode(), **wds.sample_fields(m)} for k, m in wds.iter_samples(io.BytesIO(buf), "ref")]


def read(shard: Shard) -> list[Any]:
    return [shard.sample(i) for i in range(len(shard))]


def uniform(keys: list[bytes], sizes: tuple[int, ...] = (700, 1, 40)) -> bytes:
    exts = (b"jpg", b"cls", b"json")
    return compact([[(k + b"." + e, bytes([i % 251]) * (n + i % 7)) for e, n in zip(exts, sizes, strict=True)] for i, k in enumerate(keys)])


@pytest.mark.parametrize(
    "keys",
    [
        [b"s%08d" % i for i in range(300)],  # fixed-width keys
        [b"k%d" % i for i in range(300)],  # keys of several lengths
        [b"dir.v1/sub/k%d" % i for i in range(50)],  # slashes, and dots before the basename
        [b"x" * 90 + b"%03d" % i for i in range(20)],  # names longer than the first guess of the name width
        [b"only"],
    ],
)
def test_uniform_tars_take_the_column_path_and_match_the_reference(keys: list[bytes]) -> None:
    buf = uniform(keys)
    shard = Shard("s.tar", buf, "wds")
    assert shard._columns is not None
    got = read(shard)
    assert got == reference(buf) and len(got) == len(keys)
    assert all(type(v) is bytes for s in got for k, v in s.items() if k != "__key__")


def test_member_names_with_several_dots_split_at_the_first_dot_of_the_basename() -> None:
    first = [(b"a/b.c/key.seg.png", b"1"), (b"a/b.c/key.json", b"{}")]
    buf = compact([first, [(b"a/b.c/key2.seg.png", b"2"), (b"a/b.c/key2.json", b"[]")]])
    shard = Shard("s.tar", buf, "wds")
    assert shard._columns is not None
    want = [{"__key__": "a/b.c/key", "seg.png": b"1", "json": b"{}"}, {"__key__": "a/b.c/key2", "seg.png": b"2", "json": b"[]"}]
    assert read(shard) == reference(buf) == want


def test_python_tarfile_ustar_shards_take_the_column_path(tmp_path: Path) -> None:
    f = io.BytesIO()
    with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(30):
            for ext, data in ((b"txt", b"hello %d" % i), (b"cls", b"%d" % (i % 3))):
                info = tarfile.TarInfo(f"k{i:03d}.{ext.decode()}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    buf = f.getvalue()
    shard = Shard("s.tar", buf, "wds")
    assert shard._columns is not None and read(shard) == reference(buf)


@pytest.mark.parametrize(
    "samples",
    [
        [[(b"a.jpg", b"1"), (b"a.cls", b"2")], [(b"b.jpg", b"3")], [(b"c.jpg", b"4"), (b"c.cls", b"5")]],  # a missing field
        [[(b"a.jpg", b"1"), (b"a.cls", b"2")], [(b"b.cls", b"3"), (b"b.jpg", b"4")]],  # another field order
        [[(b"a.jpg", b"1"), (b"a.cls", b"2")], [(b"b.jpg", b"3"), (b"b.txt", b"4")]],  # other fields
        [[(b"a.jpg", b"1")], [(b"a.jpg", b"2")]],  # one key twice in a row: one sample, its field repeated
        [[("ключ.jpg".encode(), b"1")], [("ключ2.jpg".encode(), b"2")]],  # UTF-8 keys
        [[(b"n" * 120 + b".jpg", b"1")], [(b"m" * 120 + b".jpg", b"2")]],  # long names (PAX headers)
    ],
)
def test_other_tars_take_the_general_path_with_the_same_result_or_error(samples: list[list[tuple[bytes, bytes]]]) -> None:
    buf = compact(samples)
    try:
        want: Any = reference(buf)
    except DataError as e:
        with pytest.raises(DataError, match=str(e).split(":", 1)[1].strip()[:30]):
            Shard("ref", buf, "wds")
        return
    shard = Shard("s.tar", buf, "wds")
    assert shard._columns is None and read(shard) == want


@pytest.mark.parametrize("cut", [300, 700, 1024, 1100, 1536, 2048, 2100])
def test_a_cut_shard_reads_as_the_reference_reader_reads_it(cut: int) -> None:
    # A tar may end without its end-of-archive blocks (tarfile accepts that); a member cut short is an error.
    buf = uniform([b"s%04d" % i for i in range(4)])[:-cut]
    try:
        want = reference(buf)
    except DataError:
        with pytest.raises(DataError, match="truncated"):
            Shard("s.tar", buf, "wds")
        return
    assert read(Shard("s.tar", buf, "wds")) == want


def test_a_data_block_that_looks_like_a_header_does_not_fool_the_index() -> None:
    fake = bytearray(1024)
    fake[257:265] = b"ustar\x0000"
    fake[124:136] = b"00000000001\0"
    buf = compact([[(b"a.bin", bytes(fake)), (b"a.cls", b"1")], [(b"b.bin", bytes(1024)), (b"b.cls", b"2")]])
    shard = Shard("s.tar", buf, "wds")
    assert read(shard) == reference(buf)


def test_an_mmap_buffer_gives_bytes_fields(tmp_path: Path) -> None:
    path = tmp_path / "s.tar"
    path.write_bytes(uniform([b"s%04d" % i for i in range(10)]))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        shard = Shard("s.tar", m, "wds")
        got = read(shard)
        del shard
    assert got == reference(path.read_bytes()) and all(type(s["jpg"]) is bytes for s in got)
