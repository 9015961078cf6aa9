"""The pure core of gpuslice: data model, fit, placement policies, MIG geometry, fragmentation.

Nothing here does I/O or reads a clock; randomness comes in as a seeded generator.
"""
