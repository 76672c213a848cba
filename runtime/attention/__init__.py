"""Paged attention: metadata, the torch (CPU) path and the Triton kernels."""
