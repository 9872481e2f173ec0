"""Reading a checkpoint's pickles without running code from them.

A pickle can name any callable to run while it loads; a checkpoint's shards are pickles
(torch.save's files: DeepSpeed's ZeRO-3 shards, the ranks' RNG states and STAPO thresholds).
`restricted_load` opens them with torch's weights-only unpickler, which admits tensors, plain
containers and the few DeepSpeed classes that its ZeRO-3 checkpoint holds, and nothing else.
The driver's checkpoint store opens every pickle so before a resume (groupflow/loop/checkpoint.py),
and the ranks load through it (learner/checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path

from groupflow.core.errors import CheckpointError


def _deepspeed_globals() -> list:
    """The classes, besides tensors and plain containers, that DeepSpeed's ZeRO-3 checkpoint
    holds (runtime/zero/stage3.py `_rigid_state_dict`): the stage and the loss scaler."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


def restricted_load(path: Path, map_location=None, mmap: bool = False):
    """torch.load of a checkpoint's pickle that runs no code: torch's weights-only unpickler,
    opened to DeepSpeed's few classes. A file it refuses is CheckpointError naming it."""
    import pickle
    import zipfile

    import torch

    try:
        with torch.serialization.safe_globals(_deepspeed_globals()):
            # only torch.save's zip format can be mapped; a legacy one is read
            mmap = mmap and zipfile.is_zipfile(path)
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile) as err:
        lines = str(err).strip().splitlines() or [type(err).__name__]
        # torch names the offending global on a later line of a long message
        reason = next((ln for ln in lines if "unsupported" in ln.lower()), lines[0]).strip()
        raise CheckpointError(f"{path}: refused, not plain tensors and data ({reason})") from None
