"""Rank code shared by the in-process context-parallel tests and the mpiexec workers."""
