"""CUDA C++ sources of the CuPy backend, shipped as package data (`varlen.kernels_cuda`)."""
import os

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
