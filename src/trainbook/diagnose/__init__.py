"""Diagnosis: turn what went wrong into where and why (a collective's timeout, and the hang,
NaN, OOM and throughput detectors that build on the phase tracker)."""
