"""Tensor parallelism over `torch.distributed` (docs/design.md, "Tensor parallelism").

`group.py`: the ranks' process group (NCCL on GPUs, gloo on the CPU) and the few collectives the
engine uses; `shard.py`: a loaded model cut to one rank's attention heads, MLP columns and expert
columns, its partial outputs all-reduced; `workers.py`: the follower processes that replay the
leader engine's commands so that every rank takes the same scheduling decisions.
"""
