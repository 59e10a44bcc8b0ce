"""Tests that need a CUDA GPU (and, where marked, the flashinfer extra); each skips with a one-line reason
otherwise. See docs/gpu.md for what ran where."""
