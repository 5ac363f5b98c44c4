"""Train a small Hugging Face OPT with the Trainer and BitSparse, and check the loss is unchanged.

The model is an ``OPTForCausalLM`` with ReLU MLPs (``OPTConfig(activation_function="relu")``),
randomly initialised, so nothing is downloaded; the text is the ``.py`` files of the running
interpreter's standard library, read as bytes (a vocabulary of 256), as in ``train_gpt.py``.
BitSparse takes one line: ``BitSparseTrainer`` instead of ``Trainer``. The same training runs
twice, with the plain Trainer and with ``BitSparseTrainer``; the script prints BitSparse's
statistics at every step and exits non-zero unless every step's loss and every final weight
are identical.

    pip install -e ".[transformers]"
    python examples/finetune_hf.py            # tiny on the CPU (under 2 minutes), larger on CUDA
    python examples/finetune_hf.py --steps 10 --cpu
"""

from __future__ import annotations

import argparse
import logging
import sys
import sysconfig
import time
from pathlib import Path

import torch

try:
    import transformers
    from transformers import OPTConfig, OPTForCausalLM, Trainer, TrainerCallback, TrainingArguments
except ImportError:
    raise SystemExit('this example needs transformers and accelerate: pip install -e ".[transformers]"') from None

from bitsparse.bench.training import deterministic_kernels
from bitsparse.integrations.transformers import BitSparseTrainer

CONFIGS = {
    # name: (model, sequence length, batch size, steps, learning rate)
    "tiny": ({"hidden_size": 128, "num_hidden_layers": 2, "ffn_dim": 512, "num_attention_heads": 4}, 128, 8, 30, 2e-3),
    "small": (
        {"hidden_size": 512, "num_hidden_layers": 6, "ffn_dim": 2048, "num_attention_heads": 8},
        512,
        16,
        100,
        1e-3,
    ),
}


def standard_library_bytes(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's ``.py`` files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= limit:
            break
    if size == 0:
        raise SystemExit(f"no Python sources found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class ByteWindows(torch.utils.data.Dataset):
    """``count`` windows of ``length`` bytes at fixed random offsets; each is its own labels
    (the model shifts them for next-byte prediction)."""

    def __init__(self, data: torch.Tensor, length: int, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.data, self.length = data, length
        self.starts = torch.randint(len(data) - length, (count,), generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.data[self.starts[i] : self.starts[i] + self.length]
        return {"input_ids": window, "labels": window}


class PrintSteps(TrainerCallback):
    """Prints each training log on one line: the loss and BitSparse's fields, if any."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        line = f"step {state.global_step:>{len(str(self.steps))}}/{self.steps}  loss {logs['loss']:.4f}"
        if "bitsparse/compression_ratio" in logs:
            line += (
                f"  | bitsparse: {logs['bitsparse/tensors_compressed']} tensors compressed, "
                f"{logs['bitsparse/dense_mib']:.2f} MiB -> {logs['bitsparse/stored_mib']:.2f} MiB "
                f"({logs['bitsparse/compression_ratio']:.2f}x, {100 * logs['bitsparse/zero_fraction']:.1f}% zeros), "
                f"fallbacks {logs['bitsparse/fallbacks']}"
            )
        print(line, flush=True)


def train(trainer_class, config: str, steps: int, data: torch.Tensor, out: Path, cpu: bool, verbose: bool):
    """Train a fresh model (same seed every time); its model, training losses, eval loss and time."""
    model_kwargs, length, batch, _, lr = CONFIGS[config]
    torch.manual_seed(0)
    # Eager attention: its backward is deterministic on CUDA too, so the two runs can be compared.
    model_config = OPTConfig(
        vocab_size=256,
        max_position_embeddings=length,
        word_embed_proj_dim=model_kwargs["hidden_size"],
        activation_function="relu",
        attn_implementation="eager",
        **model_kwargs,
    )
    model = OPTForCausalLM(model_config)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=lr,
        warmup_steps=steps // 10,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=cpu,
        dataloader_pin_memory=torch.cuda.is_available() and not cpu,
        seed=0,
    )
    train_data = ByteWindows(data, length, steps * batch, seed=0)
    eval_data = ByteWindows(data, length, 2 * batch, seed=1)
    # The one line BitSparse takes: BitSparseTrainer where the Trainer was.
    trainer = trainer_class(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data)
    trainer.remove_callback(transformers.PrinterCallback)  # PrintSteps prints the logs instead
    if verbose:
        trainer.add_callback(PrintSteps(steps))
    start = time.perf_counter()
    with deterministic_kernels():  # no effect on the CPU; on CUDA, makes the runs comparable
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    elapsed = time.perf_counter() - start
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return model, losses, eval_loss, elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=CONFIGS, help="default: tiny on the CPU, small on CUDA")
    parser.add_argument("--steps", type=int, help="training steps (default: the config's)")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even when CUDA is available")
    parser.add_argument("--out", default="out/finetune_hf", help="the Trainer's output directory (nothing is saved)")
    args = parser.parse_args(argv)

    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    on_cuda = torch.cuda.is_available() and not args.cpu
    config = args.config or ("small" if on_cuda else "tiny")
    steps = args.steps or CONFIGS[config][3]
    data = standard_library_bytes(limit=8 << 20)
    print(
        f"OPT ({config}, ReLU MLPs, random init) on {'cuda' if on_cuda else 'cpu'}, "
        f"{len(data) / 1e6:.1f} MB of standard-library source, {steps} steps",
        flush=True,
    )

    print("with BitSparse (BitSparseTrainer; its first step only measures what it would store):", flush=True)
    model, losses, eval_loss, elapsed = train(BitSparseTrainer, config, steps, data, Path(args.out), args.cpu, True)
    print(f"  {elapsed:.1f} s, eval loss {eval_loss:.4f}")
    print("without BitSparse (Trainer):", flush=True)
    plain_model, plain_losses, plain_eval, plain_elapsed = train(
        Trainer, config, steps, data, Path(args.out), args.cpu, False
    )
    print(f"  {plain_elapsed:.1f} s, eval loss {plain_eval:.4f}")

    weights_equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters(), strict=True))
    if losses != plain_losses or eval_loss != plain_eval or not weights_equal:
        first = next((i for i, (a, b) in enumerate(zip(losses, plain_losses)) if a != b), None)
        raise SystemExit(
            f"the runs with and without BitSparse differ (first differing step: {None if first is None else first + 1}, "
            f"eval loss {eval_loss} vs {plain_eval}, weights equal: {weights_equal}): please report this"
        )
    print(
        f"identical with and without BitSparse: all {len(losses)} training losses, the eval loss and every "
        f"weight, bit for bit (loss {losses[0]:.4f} -> {losses[-1]:.4f})"
    )
    return {"losses": losses, "eval_loss": eval_loss, "seconds": elapsed, "plain_seconds": plain_elapsed}


if __name__ == "__main__":
    main(sys.argv[1:])
