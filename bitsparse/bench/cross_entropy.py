"""The GPT benchmark's loss: a linear layer and cross entropy that hold one logits buffer.

Unfused, ``F.cross_entropy(head(x), targets)`` holds the logits, their log-softmax and its
gradient at once (three ``tokens x vocab`` buffers at the start of backward). Memory-conscious
training code fuses the loss instead, as Liger-Kernel does: the forward computes the logits'
gradient in place and keeps only that. The dense baseline of the published method's reference
implementation (0.4295 MiB/token at T=12000, measured on an H200 with torch 2.11 and triton 3.6
on 2026-11-30) holds one such buffer too.

On CUDA the softmax and gradient are one Triton kernel (a program per row, online softmax);
elsewhere, or without Triton, the same computation runs in PyTorch, chunk by chunk of rows.
"""

from __future__ import annotations

import torch

from bitsparse.codecs import triton_available

CHUNK_BYTES = 1 << 26
"""Float32 working memory of the PyTorch version."""
BLOCK = 4096
TRITON = triton_available()
"""Read once: a compiled graph traces ``_loss_and_gradient_in_place``, and Dynamo warns at
every cached function it traces through."""


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)`` (the mean over rows), float32."""
    return _LinearCrossEntropy.apply(hidden, weight, targets)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets):
        logits = hidden @ weight.t()
        losses = _loss_and_gradient_in_place(logits, targets)
        ctx.save_for_backward(hidden, weight, logits)
        return losses.sum() / logits.shape[0]

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, grad_logits = ctx.saved_tensors
        return (grad_logits @ weight) * grad_loss, (grad_logits.t() @ hidden) * grad_loss, None


def _loss_and_gradient_in_place(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's loss (float32); ``logits`` becomes the mean loss's gradient,
    ``(softmax - one_hot) / rows``."""
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if logits.is_cuda and TRITON:
        from bitsparse.bench import cross_entropy_triton

        cross_entropy_triton.loss_and_gradient_in_place(logits, targets, losses, BLOCK)
        return losses
    chunk_rows = max(1, CHUNK_BYTES // (4 * vocab))
    for start in range(0, rows, chunk_rows):
        chunk, target = logits[start : start + chunk_rows], targets[start : start + chunk_rows, None]
        target_logit = chunk.gather(1, target).float()
        p = chunk.float()
        peak = p.amax(1, keepdim=True)
        p.sub_(peak).exp_()
        norm = p.sum(1, keepdim=True)
        losses[start : start + chunk_rows] = (peak + norm.log() - target_logit).squeeze(1)
        p.div_(norm * rows).scatter_add_(1, target, torch.full_like(target_logit, -1.0 / rows))
        chunk.copy_(p)
    return losses
