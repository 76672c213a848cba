"""Tests of kvc eval (runtime/eval/): its synthetic tasks, their prompts and scoring."""
