"""Run-time helpers that generated method code calls (kernels_generated/<method>/): the torch
lowering's primitives and the shared Triton scoring kernels (docs/compiler.md)."""
