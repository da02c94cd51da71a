"""Performance model: memory fit and step latency."""
