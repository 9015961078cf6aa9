"""Profile and SLO file formats: ParvaGPU's CSVs and gpuslice's own profile CSV."""
