"""Trace and result file formats: the Alibaba openb CSVs and the FGD authors' result files."""
