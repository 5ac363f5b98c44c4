#!/usr/bin/env bash
# One device run: install, GPU tests, benchmarks. Usage: bash scripts/h200.sh [bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1
python -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -iv warning
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
