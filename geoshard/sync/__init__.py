"""``geoshard sync``, ``pull``, ``refresh`` and ``probe``: regional buckets filled from manifests."""
