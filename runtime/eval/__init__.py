"""kvc eval: accuracy against KV budget (docs/accuracy.md)."""
