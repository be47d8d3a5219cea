"""Plumbing between processes: gRPC servers and channels (rpc, transport), TLS certificates,
the Redis worker registry, tracing and logs (telemetry), settings, and process lifecycle."""
