"""Running geoshard on one machine: a local S3 server (SeaweedFS), synthetic corpora, the demo.

Not part of the pipeline a production job runs; tests, benchmarks and ``geoshard demo`` use it.
"""
