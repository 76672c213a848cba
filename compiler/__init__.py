"""kvc.compiler: lowers checked .kvm methods to Triton kernels, a torch lowering and hook code.

Pipeline (one module per verb): `ir.build` (CheckedMethod -> MethodIR) -> `legality.check` ->
`budgets.derive` (sympy) -> `fusion.plan` -> `lower_torch.emit` + `codegen` (jinja2 templates in
`templates/`) -> `kernels_generated/<method>/`. `cli` is `kvc compile`. See docs/compiler.md.
"""
