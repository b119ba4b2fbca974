"""Infrastructure: the artifact store, lineage manifests, locks, fingerprints and the runtime environment."""
