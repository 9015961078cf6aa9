"""Adapters: one package per outside system (file formats, NVML, kubelet, API server, HTTP)."""
