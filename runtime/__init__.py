"""kvc.runtime: the shared engine (KV memory, scheduler, model runner, models, attention, CLI)."""
