"""A stand-in for the flash-attn package behind transformers' own flash-attention path, on CPU.

transformers runs ``attn_implementation="flash_attention_2"`` through ``integrations/flash_attention.py`` and
``modeling_flash_attention_utils._flash_attention_forward``, which decides from what it is given whether to call
flash-attn's varlen kernel (documents apart by ``cu_seqlens``: explicit ``cu_seq_lens_q/k``, a padding mask, or
packed ``position_ids`` in a one-row batch) or its plain kernel (causal over each row), and loads those kernel
functions by the config's implementation name (``lazy_import_flash_attention``). :class:`StandInFlash` replaces
that loader only, so transformers' decision runs as shipped; its kernels record what they receive and compute what
flash-attn computes for it (softmax attention, causal within each ``cu_seqlens`` segment or each row, the sliding
window, soft-cap and attention sinks when given) in the inputs' dtype, so a float64 model compares with sdpa (eager
for gpt-oss) to rounding.

Its kernels take ``s_aux`` (attention sinks, one logit per head) as the kernel transformers loads for gpt-oss does
(kernels-community's vllm-flash-attn3: transformers passes ``s_aux`` only to a kernel whose signature names it, and
drops it for one that does not). ``installed(also=...)`` answers for such a hub kernel name too, registered as
transformers registers a hub flash kernel (its flash attention function, the flash_attention_2 masks).

A model built with sdpa runs this path once its config says so: ``model.config._attn_implementation =
"flash_attention_2"`` (loading with it would look for the flash-attn package).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import transformers.modeling_flash_attention_utils as flash_utils

# The names transformers loads flash-attn by; any other name makes it look for a hub kernel of that name.
FLASH_NAMES = ("flash_attention_2", "flash_attention_3")


@dataclass(frozen=True, kw_only=True)
class KernelCall:
    """One call of a stand-in kernel.

    Attributes:
        kind: ``varlen`` (documents from ``cu_seqlens``) or ``rows`` (causal over each row of a batch).
        cu_seqlens: the query boundaries a varlen call got (None for ``rows``).
        max_seqlen: the longest query sequence a varlen call was told (None for ``rows``).
        shape: the query's shape (``[tokens, heads, dim]`` or ``[rows, length, heads, dim]``).
        window: the ``window_size`` it got (None: no window, flash-attn's ``(-1, -1)``).
        sinks: the attention sinks (``s_aux``, one logit per head) it got, as a tuple (None: none).
    """

    kind: str
    cu_seqlens: tuple[int, ...] | None
    max_seqlen: int | None
    shape: tuple[int, ...]
    window: tuple[int, int] | None = None
    sinks: tuple[float, ...] | None = None


def _window(window_size: Any) -> tuple[int, int] | None:
    left, right = (int(w) for w in window_size)
    return None if (left, right) == (-1, -1) else (left, right)


def _sinks(s_aux: torch.Tensor | None) -> tuple[float, ...] | None:
    return None if s_aux is None else tuple(float(x) for x in s_aux.reshape(-1).tolist())


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    causal: bool,
    window: Any,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence: ``q`` ``[n, heads, dim]``, ``k``/``v`` ``[n, kv_heads, dim]`` -> ``[n, heads, dim]``.
    ``sinks`` (``[heads]``): one more logit per head in every query's softmax, its probability dropped (no value)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q.shape[0], device=q.device)
    allowed = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool, device=q.device)
    if causal:
        allowed &= i[None, :] <= i[:, None]
    left = window[0] if window is not None else -1
    if left >= 0:  # flash-attn's window is inclusive: (w - 1, w - 1) keeps q - k <= w - 1
        allowed &= (i[:, None] - i[None, :]) <= left
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


class StandInFlash:
    """The stand-in kernels and what they received (:attr:`calls`, :attr:`names`: the implementation names asked
    for). Install with :meth:`installed` (a context manager)."""

    def __init__(self) -> None:
        self.calls: list[KernelCall] = []
        self.names: list[str | None] = []
        self._also: tuple[str, ...] = ()

    def varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: Any = None,
        max_seqlen_k: Any = None,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: Any = (-1, -1),
        softcap: float = 0.0,
        deterministic: bool = False,
        s_aux: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """flash-attn's ``flash_attn_varlen_func``: ``q`` ``[tokens, heads, dim]``, one sequence per segment."""
        assert dropout_p == 0.0, "the stand-in has no dropout"
        bounds = [int(b) for b in cu_seqlens_q.tolist()]
        assert bounds == [int(b) for b in cu_seqlens_k.tolist()], "self-attention: the same boundaries"
        assert bounds[0] == 0 and bounds[-1] == q.shape[0], (
            f"cu_seqlens {bounds} do not cover {q.shape[0]} tokens"
        )
        longest = int(max_seqlen_q) if max_seqlen_q is not None else None
        self.calls.append(
            KernelCall(
                kind="varlen",
                cu_seqlens=tuple(bounds),
                max_seqlen=longest,
                shape=tuple(q.shape),
                window=_window(window_size),
                sinks=_sinks(s_aux),
            )
        )
        parts = [
            _attend(q[a:b], k[a:b], v[a:b], softmax_scale, causal, window_size, softcap, s_aux)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat(parts)

    def rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: Any = (-1, -1),
        softcap: float = 0.0,
        deterministic: bool = False,
        s_aux: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """flash-attn's ``flash_attn_func``: ``q`` ``[rows, length, heads, dim]``, each row one sequence."""
        assert dropout_p == 0.0, "the stand-in has no dropout"
        self.calls.append(
            KernelCall(
                kind="rows",
                cu_seqlens=None,
                max_seqlen=None,
                shape=tuple(q.shape),
                window=_window(window_size),
                sinks=_sinks(s_aux),
            )
        )
        return torch.stack(
            [
                _attend(q[r], k[r], v[r], softmax_scale, causal, window_size, softcap, s_aux)
                for r in range(q.shape[0])
            ]
        )

    def _load(self, implementation: str | None, *args: Any, **kwargs: Any) -> tuple[tuple, tuple]:
        self.names.append(implementation)
        if implementation not in (*FLASH_NAMES, *self._also):
            raise ValueError(
                f"transformers was asked for the flash kernels of {implementation!r}: it would look for a hub kernel "
                "of that name instead of flash-attn"
            )
        process = flash_utils._lazy_define_process_function(self.varlen)
        return (self.rows, self.varlen, None, flash_utils._pad_input, flash_utils._unpad_input), (
            process,
            dict,
        )

    @contextlib.contextmanager
    def installed(self, also: tuple[str, ...] = ()) -> Iterator[StandInFlash]:
        """transformers' flash path loads the stand-in kernels inside the block, under the flash-attn names and the
        hub kernel names ``also`` (registered inside the block only, as transformers registers a hub kernel). A model
        loaded inside the block with a hub kernel name (or a flash name its class replaces by one) loads it too."""
        import transformers.modeling_utils as modeling_utils
        from transformers.integrations.flash_attention import flash_attention_forward
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attention = {name: flash_attention_forward for name in also}
        masks = {name: ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"] for name in also}
        self._also = also
        try:
            with (
                mock.patch.object(flash_utils, "lazy_import_flash_attention", self._load),
                mock.patch.object(modeling_utils, "lazy_import_flash_attention", self._load),
                mock.patch.dict(ALL_ATTENTION_FUNCTIONS._global_mapping, attention),
                mock.patch.dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, masks),
            ):
                yield self
        finally:
            self._also = ()

    def kinds(self) -> set[str]:
        """The kinds of call received."""
        return {call.kind for call in self.calls}
