"""Run-time helpers that generated method code calls (kernels_generated/<method>/): the torch
lowering's primitives and the shared Triton scoring kernels (docs/compiler.md); and the merge of two
attention parts by their log-sum-exps that the SDPA prefill path runs (merge_triton.py)."""
