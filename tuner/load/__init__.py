"""Load generator: workloads, arrivals, an async streaming client, and bench_serving-compatible metrics."""
