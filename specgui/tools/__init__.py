"""Measuring and reporting commands: bench, gpucheck, the smoke, grids, papers' tables, the first minute, pictures,
results and their rendering into the docs, and the host-time and dispatch counters they use."""
