"""What each charserve process sets up: settings, Redis, logs, the collector policy, the bundled model, Prometheus helpers."""
