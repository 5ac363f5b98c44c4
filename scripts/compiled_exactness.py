"""Whole models compiled with and without BitSparse: gradients compared bit for bit.

For each model: compile it whole (``torch.compile``; with ``--eager``, not at all), take two
steps without BitSparse (the reference, and a check that the model is deterministic), then
three steps under ``bitsparse.compressing()``, all under deterministic kernels and each step
from the same seed (dropout draws the same masks), and print the parameters whose gradients
differ from the reference, with what BitSparse stored. Models: torchvision's ResNet-50 (bf16
autocast, channels-last), a Hugging Face ``OPTForCausalLM`` with ReLU (bf16, eager attention,
no dropout), a ``T5ForConditionalGeneration`` (bf16, ReLU MLPs, dropout 0.1 after each ReLU
and elsewhere, as T5's configurations have it) and a ``LlamaForCausalLM`` whose MLPs gate with
a ReLU, ``down(relu(gate(x)) * up(x))``, as ProSparse's (bf16). Needs torchvision and
transformers.
Usage: python scripts/compiled_exactness.py [--models resnet50 opt t5 llama] [--opt-sizes HIDDEN FFN]
       [--mode default|max-autotune-no-cudagraphs] [--eager]
"""

import argparse
import contextlib

import torch

import bitsparse
from bitsparse.bench.training import deterministic_kernels


def resnet50(device: str, args: argparse.Namespace):
    import torchvision

    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    images = torch.randn(args.batch, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(1000, (args.batch,), device=device)

    def loss(compiled):
        with torch.autocast(device, dtype=torch.bfloat16):
            return torch.nn.functional.cross_entropy(compiled(images), labels)

    return model, loss


def opt(device: str, args: argparse.Namespace):
    from transformers import OPTConfig, OPTForCausalLM

    hidden, ffn = args.opt_sizes
    config = OPTConfig(
        num_hidden_layers=3,
        hidden_size=hidden,
        ffn_dim=ffn,
        num_attention_heads=8,
        activation_function="relu",
        vocab_size=8000,
        attn_implementation="eager",  # PyTorch's fused attention backward is not deterministic
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = OPTForCausalLM(config).to(device, torch.bfloat16)
    tokens = torch.randint(config.vocab_size, (2, 1024), device=device)
    return model, lambda compiled: compiled(input_ids=tokens, labels=tokens).loss


def t5(device: str, args: argparse.Namespace):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=8000,
        d_model=512,
        d_ff=2048,
        num_layers=3,
        num_heads=8,
        feed_forward_proj="relu",
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    model = T5ForConditionalGeneration(config).to(device, torch.bfloat16)
    inputs = torch.randint(config.vocab_size, (4, 512), device=device)
    labels = torch.randint(config.vocab_size, (4, 512), device=device)
    return model, lambda compiled: compiled(input_ids=inputs, labels=labels).loss


def llama(device: str, args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        hidden_act="relu",
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).to(device, torch.bfloat16)
    tokens = torch.randint(config.vocab_size, (2, 1024), device=device)
    return model, lambda compiled: compiled(input_ids=tokens, labels=tokens).loss


MODELS = {"resnet50": resnet50, "opt": opt, "t5": t5, "llama": llama}


def gradients(model, loss, compiled, context) -> list:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with context:
        value = loss(compiled)
    value.backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def differing(names, expected, actual) -> list[str]:
    return [
        name
        for name, e, a in zip(names, expected, actual)
        if (e is None) != (a is None) or (e is not None and not torch.equal(e, a))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--opt-sizes", nargs=2, type=int, default=(1024, 4096), metavar=("HIDDEN", "FFN"))
    parser.add_argument("--batch", type=int, default=32, help="ResNet-50's batch")
    parser.add_argument("--mode", default="default", help="torch.compile's mode")
    parser.add_argument("--eager", action="store_true", help="run the models as they are, not compiled")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with deterministic_kernels():
        for name in args.models:
            torch._dynamo.reset()
            bitsparse.reset()
            torch.manual_seed(0)
            model, loss = MODELS[name](device, args)
            compiled = model if args.eager else torch.compile(model, mode=args.mode)
            names = [n for n, _ in model.named_parameters()]
            reference = gradients(model, loss, compiled, contextlib.nullcontext())
            unstable = differing(names, reference, gradients(model, loss, compiled, contextlib.nullcontext()))
            differ = set()
            for _ in range(3):
                differ.update(differing(names, reference, gradients(model, loss, compiled, bitsparse.compressing())))
            stats = bitsparse.stats()
            print(
                f"{name}{' (eager)' if args.eager else ''}: {len(names)} parameters; "
                f"without BitSparse, {len(unstable)} differ from run to run; "
                f"with it, {len(differ - set(unstable))} others differ {sorted(differ - set(unstable))[:5]}; "
                f"stored {stats.tensors_compressed} tensors, {stats.dense_bytes / 2**20:.0f} MiB in "
                f"{stats.stored_bytes / 2**20:.0f} MiB, recomputed {stats.tensors_recomputed}, "
                f"fallbacks {stats.fallbacks or 'none'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
