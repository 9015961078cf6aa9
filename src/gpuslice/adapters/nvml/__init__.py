"""NVML: the only package that talks to the GPU driver. Real (nvidia-ml-py), fake (YAML) and
null (no driver) implementations of one port."""
