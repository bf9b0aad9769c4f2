"""What the fork server of `tests/support/spawn.py` imports once, so that a rank process forked
from it starts at once instead of importing torch, Megatron-core and transformers itself (about
12 s of CPU a process, more than most scenarios take).

Megatron-core wraps its fused functions in `torch.compile` as it imports them. They are imported
here with TORCHDYNAMO_DISABLE=1, so a forked process runs them eagerly, as colocate's own actors do
(the job sets it for them: a cold compile of the router costs about 9 s) and as most rank processes
of these tests set it for themselves. The variable is put back as it was: a forked process gets the
environment the server started with."""

import contextlib
import os

_before = os.environ.get("TORCHDYNAMO_DISABLE")
os.environ["TORCHDYNAMO_DISABLE"] = "1"
try:
    import torch  # noqa: F401

    with contextlib.suppress(ImportError):
        import megatron.core.models.gpt  # noqa: F401
    with contextlib.suppress(ImportError):
        import transformers  # noqa: F401
finally:
    if _before is None:
        del os.environ["TORCHDYNAMO_DISABLE"]
    else:
        os.environ["TORCHDYNAMO_DISABLE"] = _before
