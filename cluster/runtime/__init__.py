"""What each charserve process sets up: settings, Redis connections, logs, the collector
policy, the clock, the bundled model and Prometheus helpers."""
