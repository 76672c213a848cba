"""`kvc calibrate`: learns a method's input tensors on the real model (runtime/calibrate/cli.py).

gates.py trains DuoAttention's per-KV-head gates; docs/design.md, "Calibrating DuoAttention's gates".
"""
