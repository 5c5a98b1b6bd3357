"""Model sources, content fingerprints, loading and compatibility checks."""
