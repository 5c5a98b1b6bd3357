"""Human-readable views of a run's results."""
