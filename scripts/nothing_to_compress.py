"""What BitSparse costs a model with nothing to compress, in eager mode, on CUDA.

A Hugging Face ``LlamaForCausalLM`` (8 layers, hidden size 1024, MLP 4096, 8 heads, SDPA
attention, bf16, batch 4 x 2048 tokens) with its own SiLU MLPs, which save no ReLU-family
tensor, and its twin whose MLPs gate with a ReLU (ProSparse's ReGLU; gate weights drawn from
N(0, 0.02), about 50% zeros). For each, 24 steps without and under ``compressing()`` in turn
(the first 4 of each discarded), and the medians of the step time and of the host time the
forward takes to queue. Needs transformers.
Usage: python scripts/nothing_to_compress.py
"""

import contextlib
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import bitsparse

STEPS, WARMUP = 24, 4


def llama(activation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8000,
        hidden_act=activation,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).cuda().to(torch.bfloat16)
    if activation == "relu":
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.data.normal_(0, 0.02)
    return model


def main() -> None:
    tokens = torch.randint(0, 8000, (4, 2048), device="cuda")
    for activation in ("silu", "relu"):
        model = llama(activation)

        def step(context) -> tuple[float, float]:
            """The step's time and the forward's host time, in seconds."""
            torch.cuda.synchronize()
            start = time.perf_counter()
            with context:
                loss = model(input_ids=tokens, labels=tokens).loss
            host = time.perf_counter() - start
            loss.backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return time.perf_counter() - start, host

        modes = {"dense": contextlib.nullcontext, "bitsparse": bitsparse.compressing}
        times = {mode: [] for mode in modes}
        for i in range(STEPS):
            for mode, make in modes.items():
                timed = step(make())
                if i >= WARMUP:
                    times[mode].append(timed)
        dense = statistics.median(t for t, _ in times["dense"])
        for mode in modes:
            median = statistics.median(t for t, _ in times[mode])
            host = statistics.median(h for _, h in times[mode])
            print(
                f"{activation:5s} {mode:10s} step {median * 1e3:7.2f} ms ({(median / dense - 1) * 100:+.1f}%), "
                f"forward host {host * 1e3:6.2f} ms"
            )
        print(activation, bitsparse.stats())


if __name__ == "__main__":
    main()
