"""The data phase's helpers: datatrove stages and their executors, source readers, curation blocks, token shards,
and where a stage's files are written (local or straight into a remote store)."""
