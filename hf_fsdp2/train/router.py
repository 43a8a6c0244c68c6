"""The MoE router's load-balancing loss from the global counts of a micro-batch, not each rank's.

transformers' ``load_balancing_loss_func`` (Switch Transformer's loss) is ``E x sum_e f_e x P_e`` over the router
logits of every MoE layer of one forward: ``f_e`` the fraction of (token, choice) pairs routed to expert ``e`` (the
top-k of the softmax), ``P_e`` the mean router probability of ``e``, both over the forward's tokens (padding left out
by the attention mask). A product of two means is not the mean of the ranks' products: computed on each rank's
tokens and averaged, it would depend on how a micro-batch is spread over ranks (``dp_shard``, ``cp``, ``ep``).

Here ``f`` and ``P`` are summed over every rank's tokens of the micro-batch (one all-reduce of ``2E + 1`` numbers per
micro-batch, every rank) before the product: the loss is that of the micro-batch's global tokens, the same value on
every rank, whatever the layout. Its gradient flows through ``P`` only (``f`` counts choices), and ``P``'s global
sum is the sum of the ranks' local sums, so each rank backpropagates its own part,
``E x sum_e f_e x P_e(local sum) / N``: the ranks' gradients sum to the global loss's. The step adds it per
micro-batch (:class:`~hf_fsdp2.train.step.RouterLoss`), so the step's router loss is the mean over its micro-batches
of each micro-batch's global loss: gradient accumulation splits a step into micro-batches as it does for the
tokens, a micro-batch's routing counts are those of all ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hf_fsdp2 import collectives


def global_router_loss(
    router_logits: tuple[torch.Tensor, ...], top_k: int, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """The load-balancing loss of the micro-batch's tokens on every rank (collective: every rank, once per forward).

    Args:
        router_logits: one ``[tokens, experts]`` tensor per MoE layer (the forward's ``router_logits``).
        top_k: experts per token (``num_experts_per_tok``).
        attention_mask: ``[batch, seq]`` (1: a token, 0: padding), or None (every row a token: padding-free).

    Returns:
        A scalar whose value is the global loss (the same on every rank) and whose gradient is this rank's part.
    """
    experts = router_logits[0].size(-1)
    device = router_logits[0].device
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = (
        attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
        if attention_mask is not None
        else None
    )
    for logits in router_logits:
        p = F.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        if mask is None:
            counts = counts + torch.bincount(chosen, minlength=experts).float()
            probs = probs + p.sum(dim=0)
            rows = rows + p.size(0)
        else:
            counts = counts.scatter_add(0, chosen, mask.repeat_interleave(top_k))
            probs = probs + (p * mask[:, None]).sum(dim=0)
            rows = rows + mask.sum()
    total = collectives.all_reduce_sum(torch.cat([counts, probs.detach(), rows.reshape(1)]).double())
    global_counts, global_probs, global_rows = total[:experts], total[experts:-1], total[-1].clamp(min=1)
    fraction = (global_counts / global_rows).float()
    local = experts * (fraction * probs).sum() / global_rows.float()
    value = (experts * (fraction.double() * global_probs).sum() / global_rows).float()
    return local + (value - local).detach()


def router_loss(out: Any, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The global load-balancing loss of a forward run with ``output_router_logits`` (None when it returned no router
    logits: a family whose model adds no router loss). ``inputs``: the forward's keyword arguments (its attention
    mask, when 2-D, leaves padding out)."""
    logits = getattr(out, "router_logits", None)
    if not logits:
        return None
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    top_k = getattr(text, "num_experts_per_tok", None)
    if top_k is None:
        raise ValueError(
            f"{type(model).__name__} returned router logits but its config has no num_experts_per_tok: the "
            "load-balancing loss needs the experts each token is routed to; set output_router_logits=false"
        )
    mask = inputs.get("attention_mask")
    return global_router_loss(
        tuple(logits), int(top_k), mask if mask is not None and mask.dim() == 2 else None
    )


class RouterLoss:
    """A step's MoE router loss: each micro-batch's loss over its global tokens
    (:func:`global_router_loss`: the same value on every rank, each rank's gradient its own
    part), added to the micro-batch's backward objective as a mean over the step's micro-batches: ``x ranks``, as
    FSDP2 averages the ranks' parts where they must sum. This rank's sum of the values is kept for the log (``sum``:
    None when the loss plan has no router loss)."""

    def __init__(self, coef: float, micro_batches: int, device: torch.device, ranks: int = 1) -> None:
        self.scale = coef * ranks / micro_batches
        self.sum = torch.zeros((), dtype=torch.float32, device=device) if coef else None

    def added(self, total: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """``total`` plus this micro-batch's scaled router loss ``aux`` (counted in :attr:`sum`), or ``total``."""
        if aux is None or self.sum is None:
            return total
        self.sum += aux.detach().float()
        return total + aux * self.scale
