"""The Triton kernel of ``bitsparse.bench.cross_entropy``: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(logits_ptr, targets_ptr, losses_ptr, vocab, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # The mean's 1/rows, from the grid (a program per row) rather than an argument: under
    # torch.compile(dynamic=True) a symbolic float is no valid kernel argument, and Triton
    # turns an integer argument equal to 1 into a constant.
    inv_rows = tl.div_rn(1.0, tl.num_programs(0).to(tl.float32))
    logits = logits_ptr + row * row_stride
    # Online softmax: the running maximum and the sum of exponentials relative to it.
    peak = tl.full([], float("-inf"), tl.float32)
    norm = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_peak = tl.maximum(peak, tl.max(x))
        norm = norm * tl.exp(peak - new_peak) + tl.sum(tl.exp(x - new_peak))
        peak = new_peak
    log_norm = peak + tl.log(norm)
    target = tl.load(targets_ptr + row)
    tl.store(losses_ptr + row, log_norm - tl.load(logits + target).to(tl.float32))
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits + cols, mask=cols < vocab, other=0.0).to(tl.float32)
        grad = (tl.exp(x - log_norm) - tl.where(cols == target, 1.0, 0.0)) * inv_rows
        tl.store(logits + cols, grad.to(logits.dtype.element_ty), mask=cols < vocab)


def loss_and_gradient_in_place(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, block: int) -> None:
    rows, vocab = logits.shape
    _kernel[(rows,)](logits, targets, losses, vocab, logits.stride(0), BLOCK=block)
