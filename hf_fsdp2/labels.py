"""The label that carries no loss: below the data that writes it and the losses that skip it."""

from __future__ import annotations

# transformers' and torch's cross-entropy convention: a label of -100 is ignored (prompt, padding, the
# first position of each packed document).
IGNORE_INDEX = -100
