"""KV memory: page pool, prefix cache and the KV tensors."""
