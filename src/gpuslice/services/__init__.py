"""Composition roots: wire adapters to the pure core (the router, ...)."""
