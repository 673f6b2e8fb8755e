#!/usr/bin/env bash
# DeepSpeedExamples' training/cifar/cifar10_deepspeed.py under zerospeed, with only the import renamed.
#   examples/deepspeed_examples/run_cifar.sh DEEPSPEEDEXAMPLES_DIR [script args...]
# What this machine forces: CPU instead of CUDA (the script's fp16 default runs on CPU too), and the offline
# torchvision stand-in (synthetic CIFAR-10; no download, no torchvision wheel for CPU torch).
set -euo pipefail
SRC="$1/training/cifar/cifar10_deepspeed.py"; shift
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="$(mktemp -d)"
sed -e 's/^import deepspeed\(\r\?\)$/import zerospeed as deepspeed\1/' -e 's/^from deepspeed\./from zerospeed./' "$SRC" > "$WORK/cifar10_zerospeed.py"
diff "$SRC" "$WORK/cifar10_zerospeed.py" || true  # the whole change
cd "$WORK"
PYTHONPATH="$HERE/offline_cifar${PYTHONPATH:+:$PYTHONPATH}" zerospeed launch --nproc-per-node 2 cifar10_zerospeed.py "$@"
