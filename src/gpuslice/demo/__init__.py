"""``gpuslice demo``: every gpuslice component, wired over its real protocols, on one machine.

Only the GPUs (fake NVML and replicas whose speed follows their slice), the kubelet, the
scheduler and the API server are simulated; see :mod:`gpuslice.demo.cluster`.
"""
