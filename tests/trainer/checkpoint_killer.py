"""Saves a checkpoint, then re-saves the same version and SIGKILLs itself inside that save.

Usage: ``python checkpoint_killer.py ROOT MODEL_DIR CALL``

The second :func:`trainer.checkpoint.save_checkpoint` of version 1 (other offsets)
kills this process with SIGKILL (a real kill, not an exception) at its first call
of ``CALL``: ``rename`` (publishing the new directory), ``replace`` (moving
``LATEST``) or ``rmtree`` (pruning). The test then checks what is on disk.
"""
import os
import shutil
import signal
import sys

import torch

from topics.bus import TopicPartition
from trainer.checkpoint import save_checkpoint
from trainer.model import load_causal_lm


def main(root: str, model_dir: str, call: str) -> None:
    model = load_causal_lm(model_dir, "float32")
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(root, version=1, model=model, optimizer=optimizer, offsets={TopicPartition("t", 0): 5}, keep=1)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    owner = {"rename": os, "replace": os, "rmtree": shutil}[call]
    setattr(owner, call, die)
    save_checkpoint(root, version=1, model=model, optimizer=optimizer, offsets={TopicPartition("t", 0): 9}, keep=1)
    sys.exit("not killed")


if __name__ == "__main__":
    main(*sys.argv[1:])
