"""kvc model code: Llama 3, Qwen3, Qwen3-MoE, and their loader.

base.py        the engine/model seam: CausalLM, ModelSpec, AttentionFn, checkpoint layouts
layers.py      RMSNorm, rotary embedding, gated MLP, attention (q/k/v -> engine -> o_proj)
rope.py        rope settings from a config (default, llama3) and their frequencies
llama.py       Llama 3 and Qwen3 dense decoders
experts.py     routed experts computed grouped by expert
qwen3_moe.py   Qwen3-MoE (router + experts in its sparse layers)
registry.py    architecture name -> class; empty models allocated on the target device
weights.py     safetensors shards -> model parameters, with completeness and shape checks
loader.py      load_model (a directory), build_random_model (a named shape), resolve_model
named_configs.py  published full-size shapes for random-weight benchmarks
byte_tokenizer.py a download-free byte-level BPE tokenizer (the default model's)
"""
