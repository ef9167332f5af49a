"""TFRecord shards: the framing (reader and writer) and ``tf.train.Example`` without TensorFlow."""

from __future__ import annotations

from geoshard.formats.tfrecord.framing import EXTENSIONS, TFRecordWriter, frame, iter_framed, iter_records, masked_crc

__all__ = ["EXTENSIONS", "TFRecordWriter", "frame", "iter_framed", "iter_records", "masked_crc"]
