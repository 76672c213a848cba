"""kvc.compiler: lowers checked .kvm methods to Triton kernels and hook code. Arrives with issue 4."""
