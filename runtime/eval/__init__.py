"""kvc eval: accuracy against KV budget, per method, on synthetic long-context tasks (docs/accuracy.md).

Pipeline: tasks.py generates the cases from a seed (filler.py writes their varied haystack text,
prompts.py lays out their framing at exact token lengths);
runner.py serves them through kvc's engine, one engine per method and budget over one loaded model
(chained turns for the multi-turn task); kvpress_reference.py runs the same cases through NVIDIA
kvpress's presses (`--reference kvpress`); stats.py gives each cell its 95% interval; report.py
writes the JSON, the markdown table and the plot; cli.py is `kvc eval`.
"""
