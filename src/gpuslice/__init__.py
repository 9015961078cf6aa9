"""gpuslice: GPU sharing for ML inference on Kubernetes."""

__version__ = "0.1.0"
