"""``tf.train.Example``'s old import path: it lives in :mod:`geoshard.formats.tfrecord.example`."""

from __future__ import annotations

from geoshard.formats.tfrecord.example import ExampleError, encode_example, get_feature, parse_example, parse_example_arrays

__all__ = ["ExampleError", "encode_example", "get_feature", "parse_example", "parse_example_arrays"]
