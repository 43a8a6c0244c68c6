"""Qwen's 3-D rotary positions (mRoPE: temporal, height, width) for rows of several documents.

A padded batch gets its positions from the model, which computes them per row. A row of several documents (packing, a
padding-free batch) must restart them at every document, so the collator computes each document's with the
composite's own ``get_rope_index`` (on a copy of the model built on the meta device: it reads the config only) and
lays the row out as transformers takes a packed one: ``[4, 1, T]``, the text positions first (what its masks find the
documents by), then the three mRoPE rows.
"""

from __future__ import annotations

from typing import Any

import torch


class RopeIndex:
    """A document's mRoPE positions, from the composite class's ``get_rope_index``."""

    def __init__(self, config: Any) -> None:
        from hf_fsdp2.composite import model_class

        with torch.device("meta"):
            model = model_class(config)._from_config(config)
        self._inner = model.model

    def __call__(
        self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """``[3, T]`` positions of one document (``input_ids`` and ``mm_token_type_ids`` of shape ``[T]``; the grids of
        its images, or None)."""
        positions, _ = self._inner.get_rope_index(
            input_ids[None], mm_token_type_ids=mm_token_type_ids[None], image_grid_thw=image_grid_thw
        )
        return positions[:, 0]
