"""TensorFlow side of the TFRecord interop tests; runs in the TF venv (GEOSHARD_TF_PYTHON).

``write SPEC OUT``: write TFRecord files of ``tf.train.Example`` records with
``tf.io.TFRecordWriter`` as SPEC (JSON) describes, and record what was written in OUT (JSON).

``read SPEC OUT``: read every shard SPEC lists with ``tf.data.TFRecordDataset``, parse each
record with ``tf.train.Example.FromString`` and ``tf.io.parse_example``, and record the
serialized bytes and the parsed features in OUT (JSON).

Both also import tensorflow_io and run one of its ops, to prove it loads alongside TensorFlow.
Bytes travel as base64. Any disagreement inside TensorFlow exits non-zero with a message.
"""

from __future__ import annotations

import base64
import json
import os
import random
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import tensorflow as tf
import tensorflow_io as tfio

TFIO_VERSION = "0.37.1"
KEY_PATTERN = r"[a-z]+-[0-9]{5}(-ключ)?"
# Edge values for int64 features: varint encodings of 1, 9 and 10 bytes.
LABELS = (0, 1, -1, 127, 128, 2**31, -(2**31), 2**63 - 1, -(2**63))


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def unb64(s: str) -> bytes:
    return base64.b64decode(s.encode("ascii"))


def check_tfio() -> dict[str, str]:
    if tfio.__version__ != TFIO_VERSION:
        sys.exit(f"tensorflow_io {tfio.__version__} loaded, expected {TFIO_VERSION}")
    # An op from libtensorflow_io.so: loading it proves the plugin matches this TensorFlow build.
    got = tfio.experimental.text.re2_full_match(tf.constant(["abc-00001", "nope"]), KEY_PATTERN).output.numpy().tolist()
    if got != [True, False]:
        sys.exit(f"tensorflow_io re2_full_match gave {got}, expected [True, False]")
    return {"tf_version": tf.__version__, "tfio_version": tfio.__version__}


def make_example(key: bytes, image: bytes, label: int, origin: bytes) -> tf.train.Example:
    return tf.train.Example(
        features=tf.train.Features(
            feature={
                "key": tf.train.Feature(bytes_list=tf.train.BytesList(value=[key])),
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                "origin": tf.train.Feature(bytes_list=tf.train.BytesList(value=[origin])),
            }
        )
    )


def features_of(ex: tf.train.Example) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for name, feat in ex.features.feature.items():
        kind = feat.WhichOneof("kind")
        if kind == "bytes_list":
            values: list[object] = [b64(v) for v in feat.bytes_list.value]
        elif kind == "int64_list":
            values = list(feat.int64_list.value)
        elif kind == "float_list":
            values = list(feat.float_list.value)
        else:
            values = []
        out[name] = {"kind": kind, "values": values}
    return out


def write(spec: dict, out: dict) -> None:
    rng = random.Random(spec["seed"])
    origins = [o.encode() for o in spec["origins"]]
    files = []
    n = 0
    for f in spec["files"]:
        options = tf.io.TFRecordOptions(compression_type="GZIP") if f["gzip"] else None
        records = []
        with tf.io.TFRecordWriter(f["path"], options=options) as w:
            for _ in range(f["records"]):
                key = f"{spec['prefix']}-{n:05d}" + ("-ключ" if n % 17 == 0 else "")
                if n % 23 == 11:
                    size = rng.randrange(200_000, 400_000)  # records across the readers' 1 MiB windows
                elif n % 10 == 0:
                    size = rng.choice((0, 1, 511, 512, 513))
                else:
                    size = rng.randrange(1, 2000)
                image = rng.randbytes(size)
                label = LABELS[n % len(LABELS)] if n % 3 == 0 else rng.randrange(-(2**40), 2**40)
                origin = rng.choice(origins)
                data = make_example(key.encode(), image, label, origin).SerializeToString()
                w.write(data)
                records.append(b64(data))
                n += 1
        # Read back through TensorFlow: the file is what TF itself accepts, GZIP included.
        back = [r.numpy() for r in tf.data.TFRecordDataset(f["path"], compression_type="GZIP" if f["gzip"] else "")]
        if [b64(r) for r in back] != records:
            sys.exit(f"{f['path']}: TFRecordDataset does not read back what TFRecordWriter wrote")
        files.append({"path": f["path"], "records": records})
    out["files"] = files


def read(spec: dict, out: dict) -> None:
    shards = []
    spec_features = {
        "key": tf.io.FixedLenFeature([], tf.string),
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
        "origin": tf.io.FixedLenFeature([], tf.string),
    }
    for shard in spec["shards"]:
        raw = [r.numpy() for r in tf.data.TFRecordDataset(shard["path"])]
        records = []
        for data in raw:
            ex = tf.train.Example.FromString(data)
            records.append({"data": b64(data), "features": features_of(ex)})
        if raw:
            # The graph-op parser must agree with the protobuf parser on every record.
            parsed = tf.io.parse_example(tf.constant(raw), spec_features)
            for i, rec in enumerate(records):
                for name in spec_features:
                    v = parsed[name][i].numpy()
                    want = rec["features"][name]["values"][0]
                    got = b64(v) if isinstance(v, bytes) else int(v)
                    if got != want:
                        sys.exit(f"{shard['path']}: record {i}: tf.io.parse_example {name}={got!r}, FromString {want!r}")
            keys = [rec_key.decode("utf-8") for rec_key in parsed["key"].numpy().tolist()]
            matched = tfio.experimental.text.re2_full_match(tf.constant(keys), KEY_PATTERN).output.numpy()
            if not matched.all():
                sys.exit(f"{shard['path']}: keys not matching {KEY_PATTERN}: {[k for k, m in zip(keys, matched, strict=True) if not m]}")
        shards.append({"region": shard["region"], "path": shard["path"], "records": records})
    out["shards"] = shards


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in ("write", "read"):
        sys.exit("usage: tf_tfrecord.py write|read SPEC.json OUT.json")
    with open(sys.argv[2], encoding="utf-8") as f:
        spec = json.load(f)
    out: dict = check_tfio()
    (write if sys.argv[1] == "write" else read)(spec, out)
    with open(sys.argv[3], "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
