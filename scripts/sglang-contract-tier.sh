#!/usr/bin/env bash
# The contract tier that runs SGLang's own code (tests/contracts/test_sglang_own_code.py).
#
# sglang 0.5.23 pins torch 2.14.1 (a CUDA build of several GB) and transformers 5.19, so this tier
# has its own virtual environment, .venv-sglang/: the CPU torch 2.13.0 wheel, sglang --no-deps, and
# only the packages that `import sglang.srt.entrypoints.http_server` asks for. Every install runs
# under a constraint that keeps torch at 2.13.0: nothing may resolve another (a CUDA) torch.
#
#   scripts/sglang-contract-tier.sh            # make .venv-sglang if missing, then run the tier
#   scripts/sglang-contract-tier.sh --rebuild  # make it afresh
#   scripts/sglang-contract-tier.sh --if-cached  # run only if .venv-sglang exists (what CI does)
#   scripts/sglang-contract-tier.sh -- -k session   # extra pytest arguments after --
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_TIER_VENV:-.venv-sglang}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
# torch 2.13's torchvision, --no-deps (it requires a CUDA torch). sglang's configs import it; its
# compiled ops link the CUDA libraries and do not load, which tests/support/sglang_tier.py allows for.
TORCHVISION_VERSION=0.28.0

# What `import sglang.srt.entrypoints.http_server` imports on a CPU machine, found one
# ModuleNotFoundError at a time; triton is among them (sglang's kernels import it at module level).
HTTP_LAYER=(
  numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm
  ipython aiohttp uvicorn uvloop fastapi "transformers>=5.24,<6" dill apache-tvm-ffi triton gguf
  soundfile sentencepiece compressed-tensors openai partial-json-parser setproctitle einops
  jsonschema xgrammar python-multipart
)

if [[ "${1:-}" == "--rebuild" ]]; then rm -rf "$VENV"; shift; fi
if [[ "${1:-}" == "--if-cached" ]]; then
  shift
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "sglang contract tier skipped: no $VENV (make it with scripts/sglang-contract-tier.sh)" >&2
    exit 0
  fi
fi
[[ "${1:-}" == "--" ]] && shift

if [[ ! -x "$VENV/bin/python" ]]; then
  start=$(date +%s)
  python3 -m venv "$VENV"
  constraints="$(cd "$VENV" && pwd)/constraints.txt"
  echo "torch==$TORCH_VERSION" > "$constraints"
  export PIP_CONSTRAINT="$constraints" PIP_DISABLE_PIP_VERSION_CHECK=1
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
  "$VENV/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"
  "$VENV/bin/pip" install -q "${HTTP_LAYER[@]}"
  "$VENV/bin/pip" install -q -e '.[sglang]' pytest pytest-timeout
  "$VENV/bin/python" - <<'PY'
import torch
assert torch.version.cuda is None, f"a CUDA torch crept in: {torch.__version__}"
from tests.support import sglang_tier  # noqa: F401  imports sglang's HTTP app: the tier's precondition
PY
  echo "$VENV: made in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
fi
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q tests/contracts/test_sglang_own_code.py "$@"
