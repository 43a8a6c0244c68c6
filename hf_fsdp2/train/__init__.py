"""The training step every recipe, bench and test calls: ``loss`` (token-normalised cross entropy, chunked or
plain, decided once per run), ``optim`` (AdamW parameter groups, schedules) and ``step`` (accumulation, clip,
optimizer step)."""
