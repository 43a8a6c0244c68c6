"""What every method's step stands on: ``loss`` (token-normalised cross entropy, chunked or plain, decided once per
run), ``chunked_ce`` (the chunked head), ``reference`` (per-sequence completion log-probs and the reference models),
``nonfinite`` (the non-finite guard), ``optim`` (AdamW parameter groups, schedules) and ``step`` (accumulation, clip,
optimizer step: SFT's step, and the contract every method's step keeps)."""
