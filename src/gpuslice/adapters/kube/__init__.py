"""Kubernetes: the assignment annotation's wire format (the API-server client comes later)."""
