"""The framework integrations: Hugging Face's Trainer (``BitSparseTrainer``, the mixin and the
callback) and Lightning's (``BitSparseCallback``), run for real on the CPU with tiny models.

Each training test runs the same training with and without BitSparse and requires every
weight to be equal afterwards (``torch.equal``), and checks in the logs that tensors really
were compressed. ``import bitsparse`` itself must import neither framework.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hooks import alive, clean_session, hooks_installed  # noqa: F401 (clean_session: autouse fixture)

import bitsparse
from bitsparse.integrations.common import checked_options, log_fields

FIELDS = set(log_fields(bitsparse.Stats()))
MIN_NUMEL = 1024
"""Small enough that the tiny models' ReLU outputs are compressed (the default is 65536)."""


def test_importing_bitsparse_imports_no_framework():
    code = (
        "import sys, bitsparse, bitsparse.integrations, bitsparse.integrations.common\n"
        "frameworks = ('transformers', 'accelerate', 'lightning', 'pytorch_lightning')\n"
        "loaded = sorted(m for m in frameworks if m in sys.modules)\n"
        "assert not loaded, loaded\n"
        "print('OK')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stdout + result.stderr


def test_options_are_checked_when_given():
    assert checked_options(None) == {} and checked_options({"min_numel": 8}) == {"min_numel": 8}
    with pytest.raises(TypeError, match=r"unknown BitSparse option\(s\) \['min_numell'\]"):
        checked_options({"min_numell": 8})
    with pytest.raises(ValueError, match="min_numel must be an int >= 0"):
        checked_options({"min_numel": -1})
    with pytest.raises(TypeError, match="sign_pack must be True or False"):
        checked_options({"sign_pack": "yes"})
    with pytest.raises(TypeError, match="must be a mapping"):
        checked_options([("min_numel", 8)])


def test_log_fields_of_a_step():
    s = bitsparse.Stats(tensors_compressed=3, dense_bytes=4 << 20, stored_bytes=1 << 20, zero_fraction=0.75)
    s.fallbacks = {"arena_full": 2, "other_stream": 1}
    assert log_fields(s) == {
        "bitsparse/compression_ratio": 4.0,
        "bitsparse/dense_mib": 4.0,
        "bitsparse/stored_mib": 1.0,
        "bitsparse/tensors_compressed": 3,
        "bitsparse/fallbacks": 3,
        "bitsparse/zero_fraction": 0.75,
    }


# --------------------------------------------------------------------------------------------
# Hugging Face transformers


def hf_integration():
    """``bitsparse.integrations.transformers``; skips the test without transformers or accelerate."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return importlib.import_module("bitsparse.integrations.transformers")


BATCH, LENGTH, FFN, LAYERS = 4, 32, 256, 2


def tiny_opt():
    """A randomly initialised two-layer OPT with ReLU MLPs (dropout on: the runs must agree on it)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=LAYERS,
        ffn_dim=FFN,
        num_attention_heads=2,
        max_position_embeddings=LENGTH,
        word_embed_proj_dim=64,
        activation_function="relu",
    )
    return transformers.OPTForCausalLM(config)


class RandomBytes(torch.utils.data.Dataset):
    """Fixed random byte sequences, each its own labels (the model shifts them)."""

    def __init__(self, count: int, seed: int = 0):
        self.tokens = torch.randint(0, 256, (count, LENGTH), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def hf_train(tmp_path, trainer_class=None, steps=3, accumulation=1, checkpointing=False, **trainer_kwargs):
    """Train the tiny OPT for ``steps`` optimizer steps with ``trainer_class`` (default: the plain
    Trainer), logging every step and evaluating every other; the model and the trainer."""
    hf_integration()
    transformers = importlib.import_module("transformers")
    # transformers 5 renamed gradient_checkpointing (a deprecated alias now) to activation_checkpointing.
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    checkpointing_name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=accumulation,
        **{checkpointing_name: checkpointing},
        learning_rate=1e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    model = tiny_opt()
    trainer = (trainer_class or transformers.Trainer)(
        model=model, args=args, train_dataset=RandomBytes(64), eval_dataset=RandomBytes(8, seed=1), **trainer_kwargs
    )
    trainer.train()
    return model, trainer


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pairs = list(zip(a.named_parameters(), b.named_parameters(), strict=True))
    assert pairs
    for (name, p), (_, q) in pairs:
        assert torch.equal(p, q), f"{name} differs"


def training_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def relu_output_mib() -> float:
    """What the tiny OPT's ReLU outputs of one micro-batch take dense, in MiB."""
    return LAYERS * BATCH * LENGTH * FFN * 4 / (1 << 20)


@pytest.mark.parametrize("accumulation", [1, 2], ids=["no_accumulation", "accumulate_2"])
def test_bitsparse_trainer_trains_exactly_and_logs_its_stats(tmp_path, accumulation):
    BitSparseTrainer = hf_integration().BitSparseTrainer

    plain, _ = hf_train(tmp_path, accumulation=accumulation)
    model, trainer = hf_train(
        tmp_path, BitSparseTrainer, accumulation=accumulation, bitsparse_options={"min_numel": MIN_NUMEL}
    )
    assert_same_weights(model, plain)

    logs = training_logs(trainer)
    assert [entry["step"] for entry in logs] == [1, 2, 3]
    assert all(FIELDS <= entry.keys() for entry in logs)
    # The first micro-batch only measures (its two ReLU outputs fall back); with accumulation
    # the first log follows the second micro-batch, which stores them.
    first = logs[0]
    if accumulation == 1:
        assert (first["bitsparse/tensors_compressed"], first["bitsparse/fallbacks"]) == (0, LAYERS)
    for entry in logs[accumulation == 1 :]:
        assert entry["bitsparse/tensors_compressed"] == LAYERS and entry["bitsparse/fallbacks"] == 0
        assert entry["bitsparse/dense_mib"] == relu_output_mib()
        assert entry["bitsparse/compression_ratio"] > 1.5 and 0.3 < entry["bitsparse/zero_fraction"] < 0.7
    # Evaluation logs carry no BitSparse fields, and evaluation neither installs hooks nor
    # begins a BitSparse step: the steps are the training micro-batches, one each.
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 3]  # every other step, and the last
    assert not any(FIELDS & entry.keys() for entry in evaluations)
    assert bitsparse.stats().step == 3 * accumulation
    trainer.evaluate()
    assert bitsparse.stats().step == 3 * accumulation
    assert not hooks_installed() and alive() == 0


def test_bitsparse_trainer_with_gradient_checkpointing(tmp_path):
    BitSparseTrainer = hf_integration().BitSparseTrainer

    plain, _ = hf_train(tmp_path, checkpointing=True)
    model, trainer = hf_train(
        tmp_path, BitSparseTrainer, checkpointing=True, bitsparse_options={"min_numel": MIN_NUMEL}
    )
    assert model.model.decoder.gradient_checkpointing
    assert_same_weights(model, plain)
    # Inside each checkpointed decoder layer checkpointing's own hooks win: its ReLU outputs
    # never reach BitSparse, which sees only what is saved outside the layers.
    for entry in training_logs(trainer):
        assert entry["bitsparse/tensors_compressed"] == 0 and entry["bitsparse/fallbacks"] == 0


def test_bitsparse_trainer_checks_its_options_before_building(tmp_path):
    BitSparseTrainer = hf_integration().BitSparseTrainer

    with pytest.raises(TypeError, match="unknown BitSparse option"):
        BitSparseTrainer(model=None, bitsparse_options={"min_numell": 8})
    with pytest.raises(ValueError, match="capacity must be"):
        BitSparseTrainer(model=None, bitsparse_options={"capacity": -1})


def test_mixin_on_a_trainer_subclass_of_ones_own(tmp_path):
    transformers = pytest.importorskip("transformers")
    BitSparseTrainerMixin = hf_integration().BitSparseTrainerMixin

    class CountingTrainer(transformers.Trainer):
        """A user's Trainer subclass: it counts its loss computations."""

        computed = 0

        def compute_loss(self, *args, **kwargs):
            CountingTrainer.computed += 1
            return super().compute_loss(*args, **kwargs)

    class Compressed(BitSparseTrainerMixin, CountingTrainer):
        pass

    plain, _ = hf_train(tmp_path, steps=2)
    model, trainer = hf_train(tmp_path, Compressed, steps=2, bitsparse_options={"min_numel": MIN_NUMEL})
    assert_same_weights(model, plain)
    assert CountingTrainer.computed == 2 + 1  # two training micro-batches, one evaluation batch
    assert training_logs(trainer)[-1]["bitsparse/tensors_compressed"] == LAYERS


def test_callback_logs_the_stats_of_a_plain_trainer_under_enable(tmp_path):
    BitSparseCallback = hf_integration().BitSparseCallback

    plain, _ = hf_train(tmp_path)
    bitsparse.enable(min_numel=MIN_NUMEL)
    try:
        model, trainer = hf_train(tmp_path, callbacks=[BitSparseCallback()])
    finally:
        bitsparse.disable()
    assert_same_weights(model, plain)
    logs = training_logs(trainer)
    assert all(FIELDS <= entry.keys() for entry in logs)  # in the log history, as the Trainer recorded it
    assert logs[-1]["bitsparse/tensors_compressed"] == LAYERS
    assert not any(FIELDS & entry.keys() for entry in trainer.state.log_history if "loss" not in entry)


def test_finetune_example_trains_identically_with_and_without_bitsparse(tmp_path, capsys):
    hf_integration()
    path = Path(__file__).resolve().parent.parent / "examples" / "finetune_hf.py"
    spec = importlib.util.spec_from_file_location("finetune_hf", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(["--steps", "3", "--cpu", "--out", str(tmp_path)])  # exits non-zero if runs differ
    out = capsys.readouterr().out
    assert "identical with and without BitSparse: all 3 training losses, the eval loss and every weight" in out
    assert len(summary["losses"]) == 3
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and "0 tensors compressed" in steps[0]  # the first step only measures
    assert all("2 tensors compressed" in line and "fallbacks 0" in line for line in steps[1:])


# --------------------------------------------------------------------------------------------
# Lightning


def lightning_integration():
    """``bitsparse.integrations.lightning``; skips the test without lightning."""
    pytest.importorskip("lightning")
    return importlib.import_module("bitsparse.integrations.lightning")


def lightning_module(fail_at_batch: int | None = None):
    """A ReLU MLP classifier as a LightningModule; its training step raises at ``fail_at_batch``."""
    lightning = pytest.importorskip("lightning")

    class Classifier(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, 256),
                torch.nn.ReLU(),
                torch.nn.Linear(256, 256),
                torch.nn.ReLU(),
                torch.nn.Linear(256, 10),
            )

        def training_step(self, batch, batch_idx):
            if batch_idx == fail_at_batch:
                raise RuntimeError("training step failed")
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Classifier()


def lightning_fit(tmp_path, callbacks, module=None, steps=4, accumulation=1):
    """Fit for ``steps`` optimizer steps on the CPU with a CSV logger; the module and trainer."""
    lightning = pytest.importorskip("lightning")
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(256, 32, generator=generator), torch.randint(0, 10, (256,), generator=generator)
    )
    module = module or lightning_module()
    trainer = lightning.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=accumulation,
        val_check_interval=2,
        limit_val_batches=2,
        log_every_n_steps=1,
        logger=lightning.pytorch.loggers.CSVLogger(str(tmp_path), name="fit"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    trainer.fit(module, loader, loader)
    return module, trainer


@pytest.mark.parametrize("accumulation", [1, 2], ids=["no_accumulation", "accumulate_2"])
def test_lightning_callback_trains_exactly_and_logs_its_stats(tmp_path, accumulation):
    BitSparseCallback = lightning_integration().BitSparseCallback

    plain, _ = lightning_fit(tmp_path, [], accumulation=accumulation)
    module, trainer = lightning_fit(tmp_path, [BitSparseCallback(min_numel=MIN_NUMEL)], accumulation=accumulation)
    assert_same_weights(module, plain)
    assert not bitsparse.is_enabled() and not hooks_installed()
    assert bitsparse.stats().step == 4 * accumulation  # one per training batch; validation begins none

    with open(f"{trainer.logger.log_dir}/metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["train_loss"]]
    assert len(rows) == 4 and all(FIELDS <= row.keys() for row in rows)
    last = rows[-1]
    assert float(last["bitsparse/tensors_compressed"]) == 2 and float(last["bitsparse/fallbacks"]) == 0
    assert float(last["bitsparse/dense_mib"]) == 2 * 32 * 256 * 4 / (1 << 20)
    assert float(last["bitsparse/compression_ratio"]) > 1.5


def test_lightning_step_that_raises_leaves_bitsparse_working(tmp_path):
    BitSparseCallback = lightning_integration().BitSparseCallback

    with pytest.raises(RuntimeError, match="training step failed"):
        lightning_fit(tmp_path, [BitSparseCallback(min_numel=MIN_NUMEL)], module=lightning_module(fail_at_batch=2))
    assert not bitsparse.is_enabled() and not hooks_installed()
    # Training again works, and exactly.
    plain, _ = lightning_fit(tmp_path, [], steps=2)
    module, _ = lightning_fit(tmp_path, [BitSparseCallback(min_numel=MIN_NUMEL)], steps=2)
    assert_same_weights(module, plain)


def test_lightning_callback_refuses_to_replace_enable(tmp_path):
    BitSparseCallback = lightning_integration().BitSparseCallback

    with pytest.raises(TypeError, match="unknown BitSparse option"):
        BitSparseCallback(min_numell=8)
    bitsparse.enable(min_numel=MIN_NUMEL)
    try:
        with pytest.raises(RuntimeError, match="use the callback or enable"):
            lightning_fit(tmp_path, [BitSparseCallback()], steps=1)
        assert bitsparse.is_enabled()  # the user's enable() is left as it was
    finally:
        bitsparse.disable()
