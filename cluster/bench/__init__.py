"""Load generators and benchmarks; no serving module imports them."""
