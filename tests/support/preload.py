"""What the fork server of `tests/support/spawn.py` imports once, so that a rank process forked
from it starts at once instead of importing torch, Megatron-core and transformers itself (about
12 s of CPU a process, more than most scenarios take).

Megatron-core wraps its fused functions in `torch.compile` as it imports them; every rank process
of these tests, like colocate's own actors, sets TORCHDYNAMO_DISABLE=1 first (a cold compile of the
router costs about 9 s), so they are imported here with it set too. It is unset again: a forked
process gets the environment the server started with, as a spawned one got the test process's."""

import contextlib
import os

os.environ["TORCHDYNAMO_DISABLE"] = "1"
try:
    import torch  # noqa: F401

    with contextlib.suppress(ImportError):
        import megatron.core.models.gpt  # noqa: F401
    with contextlib.suppress(ImportError):
        import transformers  # noqa: F401
finally:
    del os.environ["TORCHDYNAMO_DISABLE"]
