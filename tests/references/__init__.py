"""Hand-written reference eviction methods (oracle 2) and their parity with NVIDIA kvpress (oracle 3).

`eviction` holds one plain-torch function per method, written from the papers' algorithms and
configured to the defaults of the reference implementations; `model_forward` runs a tiny Hugging
Face model, compresses each layer's prompt cache with a reference method and decodes from the
compressed cache. Nothing here imports kvc's compiler or engine: kvc is tested against this code.
"""
