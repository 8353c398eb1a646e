#!/usr/bin/env bash
# Download the wheels the lent H200 image lacks (Python 3.12 there, no registry) into .whl/,
# which is git-ignored and travels with a device call as `carry: [".whl"]`.
#   zstandard   -- the delta codec's `zstd` encoding
#   liger-kernel -- the peer in bench_icepop / bench_logits (pure Python; torch and triton
#                   are already on the image, so --no-deps)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl zstandard==0.25.0 liger-kernel==0.8.5
ls -l .whl
