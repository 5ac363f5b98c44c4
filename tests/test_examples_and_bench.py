"""The training example and the benchmark suites, in their small CPU configurations."""

import argparse
import csv
import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

import bitsparse
from bitsparse.bench import hooks
from bitsparse.bench.__main__ import main as bench
from bitsparse.bench.codec import CASES, time_ms
from bitsparse.bench.pipeline import one_f_one_b
from bitsparse.bench.training import CUBLAS_DETERMINISTIC_WORKSPACE, MODES, deterministic_kernels

ROOT = Path(__file__).resolve().parent.parent


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_train_gpt_tiny_trains_with_exact_gradients(tmp_path, capsys):
    example = load_example("train_gpt")
    summary = example.main(["--steps", "4", "--plot", str(tmp_path / "training.png")])
    out = capsys.readouterr().out
    # The first step's check raises SystemExit when gradients differ; here it must pass.
    assert "gradients: identical with and without BitSparse (bit for bit)" in out
    assert summary["steps"] == 4 and summary["final_loss"] < summary["first_loss"]
    assert 0 < summary["final_zero_fraction"] < 1 and summary["compression_ratio"] > 1
    assert out.count("saved tensors compressed") == 4  # the stats line of every step
    assert is_png(tmp_path / "training.png")


def test_quickstart_runs(capsys):
    load_example("quickstart").main()
    out = capsys.readouterr().out
    assert "round trip:         bit-exact" in out
    assert "bit-identical to the plain run" in out


EAGER_MODES = [mode for mode in MODES if not mode.startswith("compiled")]


@pytest.mark.parametrize("suite, size_key", [("mlp", "rows"), ("gpt", "T")])
def test_training_suites_quick(tmp_path, suite, size_key):
    bench([suite, "--quick", "--repeats", "1", "--warmup", "1", "--modes", *EAGER_MODES, "--out", str(tmp_path)])
    rows = read_csv(tmp_path / f"{suite}.csv")
    assert is_png(tmp_path / f"{suite}.png")
    assert {r["mode"] for r in rows} == set(EAGER_MODES)
    assert {r["zeros"] for r in rows} == {"init", "90%"}
    assert len({r[size_key] for r in rows}) == 2
    assert all(r["grads_equal_dense"] == "True" for r in rows)
    compressed = [r for r in rows if r["mode"].startswith("bitsparse")]
    sparse = [float(r["compression_ratio"]) for r in compressed if r["zeros"] == "90%"]
    assert min(sparse) > 3


def test_compiled_modes_run_compiled_at_every_size(tmp_path):
    # Past its recompile limit dynamo runs a function eagerly, which the bench turns into an
    # error. Each size compiles 4 graphs (two modes, with and without deterministic kernels),
    # so with a limit of 4 two sizes pass only if each starts afresh.
    modes = ["compiled-dense", "compiled-bitsparse"]
    with torch._dynamo.config.patch(recompile_limit=4):
        bench(["gpt", "--quick", "--zeros", "0.9", "--repeats", "1", "--warmup", "1", "--modes", *modes,
               "--out", str(tmp_path)])  # fmt: skip
    rows = read_csv(tmp_path / "gpt.csv")
    assert {r["mode"] for r in rows} == set(modes) and len({r["T"] for r in rows}) == 2
    assert all(r["grads_equal_dense"] == "True" for r in rows)
    assert min(float(r["compression_ratio"]) for r in rows if r["mode"] == "compiled-bitsparse") > 3


def test_steps_suite_quick(tmp_path, capsys):
    bench(["steps", "--quick", "--steps", "3", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "steps.csv")
    assert [(r["model"], r["step"]) for r in rows] == [("gpt", "1"), ("gpt", "2"), ("gpt", "3")]
    assert "gpt: peak allocated per step" in capsys.readouterr().out


def test_pipeline_suite_quick(tmp_path):
    bench(["pipeline", "--quick", "--zeros", "0.9", "--in-flight", "1", "3", "--repeats", "1", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "pipeline.csv")
    assert [r["in_flight"] for r in rows] == ["1", "3"]
    # Both MLPs' ReLU outputs stored, none kept, and every iteration's gradients exact.
    assert all(
        r["grads_equal_dense"] == "True" and (r["last_step_compressed"], r["fallbacks"]) == ("2", "0") for r in rows
    )


@pytest.mark.parametrize("microbatches, in_flight", [(8, 1), (8, 3), (4, 4)])
def test_one_f_one_b_runs_each_microbatch_once_with_at_most_in_flight_waiting(microbatches, in_flight):
    schedule = one_f_one_b(microbatches, in_flight)
    assert sorted(schedule) == [("B", i) for i in range(microbatches)] + [("F", i) for i in range(microbatches)]
    waiting, most_waiting = [], 0
    for op, i in schedule:
        if op == "F":
            waiting.append(i)
        else:
            assert waiting[0] == i  # backwards run in the forwards' order
            waiting.pop(0)
        most_waiting = max(most_waiting, len(waiting))
    assert most_waiting == in_flight
    with pytest.raises(ValueError, match="in_flight"):
        one_f_one_b(microbatches, microbatches + 1)


def test_hooks_suite_quick(capsys):
    rows = hooks.run(argparse.Namespace(tensors=6, numel=4096, repeats=2, warmup=1, profile=None))
    assert [(r["chain"], r["mode"]) for r in rows] == [
        (chain, mode) for chain in hooks.CHAINS for mode in hooks.MODES[1:]
    ]
    # The last step was the skipped chain's under compressing(): its six tanh outputs screened out.
    last = bitsparse.stats()
    assert last.tensors_compressed == 0 and last.tensors_skipped == {"not_relu_family": 6}
    assert "stored  bitsparse" in capsys.readouterr().out


def test_vision_suite_quick(tmp_path):
    pytest.importorskip("torchvision")
    bench(["vision", "--quick", "--steps", "2", "--repeats", "1", "--warmup", "1"])


def test_codec_suite_quick(tmp_path):
    bench(["codec", "--quick", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "codec.csv")
    assert len(rows) == len(CASES) and is_png(tmp_path / "codec.png")
    assert all(float(r["encode_gbs"]) > 0 and float(r["decode_gbs"]) > 0 for r in rows)


def test_codec_timing_of_host_work_uses_the_host_clock():
    # Even where CUDA is available: events would time an idle GPU.
    assert time_ms(lambda: time.sleep(0.002), "cpu", reps=3, warmup=0) >= 2


@pytest.mark.parametrize("workspace", [None, ":16:8"])
def test_deterministic_kernels_only_inside_the_block(monkeypatch, workspace):
    # Timed steps run outside: the variable costs host time on every matrix product.
    if workspace is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", workspace)
    enabled = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(KeyError):
        with deterministic_kernels():
            assert torch.are_deterministic_algorithms_enabled()
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_DETERMINISTIC_WORKSPACE
            raise KeyError("restored on errors too")
    assert torch.are_deterministic_algorithms_enabled() == enabled
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == workspace
