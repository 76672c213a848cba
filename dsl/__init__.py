"""kvc.dsl: the .kvm method language (grammar, AST, checker). Arrives with issue 3."""
