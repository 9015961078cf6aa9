"""HTTP adapters: the router's reverse proxy, inference-protocol parsing, config and plan files,
Prometheus metrics, the Kubernetes EndpointSlice reader, and a fake model replica for tests and
benchmarks."""
