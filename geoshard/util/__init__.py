"""Small pieces every stage shares: sizes, retries, TOML files, atomic files, digests, paths."""
