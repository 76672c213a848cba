"""kvc.kernels_generated: compiler output for the shipped methods (committed, deterministic)."""
