"""GPU benchmark and profiling tools: ``gpuslice profile`` and ``gpuslice bench sharing``."""
