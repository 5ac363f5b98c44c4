#!/usr/bin/env bash
# First step of every run on the device machine: install the package and print the versions
# that docs/benchmarks.md records. Then, for example:
#   python -m pytest -q -m gpu tests/
#   python -m bitsparse.bench codec
#   python -m bitsparse.bench gpt --out "$OUT"
set -uo pipefail
export PYTHONUNBUFFERED=1
python -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -iv warning
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
