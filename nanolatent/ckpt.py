"""Checkpoints read, and one written atomically: a model loaded from a checkpoint (into its own type or another),
train.py's save folders found, a run refused unless asked to be replaced. train.py's writes into a run folder (its
saves, checksums, the best one's link, deletions): saves.py; the lock: lock.py."""

import os
import re

import torch

from nanolatent import models
from nanolatent.common import die, free_space, replacing

CHECKPOINTS = "checkpoints"  # train.py's saves: out_dir/checkpoints/iter_0000300/, one folder per step
RUN_FILES = ("ckpt.pt", "ckpt_meta.pt")  # what makes a folder a run (ckpt_meta.pt: train.py under FSDP), as does
# a whole folder of train.py's checkpoints (saved_steps)


def refuse_existing_run(out_dir, overwrite, resumable=False):
    """The guard of every script that writes a run into out_dir (train.py from scratch, scripts/rlvr.py, scripts/convert.py hf and
    gguf): a folder that holds a checkpoint is replaced only with --overwrite=True; otherwise one line and exit 2,
    before anything there is touched. resumable: the writer can continue the run (train.py --init_from=resume)."""
    held = [os.path.join(out_dir, name) for name in RUN_FILES if os.path.exists(os.path.join(out_dir, name))]
    held += list(saved_steps(out_dir).values())  # a run killed between its first save and its link
    if held and not overwrite:
        die(f"{out_dir} already holds a run ({held[0]}): "
            f"{'continue it with --init_from=resume, ' if resumable else ''}choose another --out_dir, or replace it "
            f"with --overwrite=True")


def refuse_nonempty_dir(dst, overwrite, what="--dst"):
    """The guard of a writer whose output is a whole folder of someone else's format (scripts/convert.py to_hf): a file, or
    a folder that holds anything, is written into only with --overwrite=True."""
    if os.path.exists(dst) and not os.path.isdir(dst):
        die(f"{what}={dst} is a file: give a folder to write into")
    held = sorted(os.listdir(dst)) if os.path.isdir(dst) else []
    if held and not overwrite:
        die(f"{what}={dst} is not empty ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): choose an empty or "
            f"new folder, or write into it anyway with --overwrite=True")


def save_checkpoint(checkpoint, path):
    """Write in one rename (common.replacing): a crash or a second Ctrl-C mid-write never leaves a truncated
    checkpoint behind. A write that fails stops with one line; the previous checkpoint is untouched."""
    try:
        with replacing(path) as tmp:
            torch.save(checkpoint, tmp)
    except (OSError, RuntimeError) as e:  # a full disk (torch's writer raises RuntimeError), a read-only folder
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[-1][:200]
        die(f"could not write {path}: {reason}{free_space(path)}; free some space or choose another out_dir "
            f"(the previous checkpoint there, if any, is unchanged)")


def saved_steps(out_dir):
    """{iter: folder} of train.py's whole checkpoints in out_dir. A folder is written as iter_N.tmp and gets its
    name iter_N by one rename once every file in it is complete, so a folder with that name is whole, whenever the
    writers were killed."""
    root = os.path.join(out_dir, CHECKPOINTS)
    names = os.listdir(root) if os.path.isdir(root) else []
    return {int(m.group(1)): os.path.join(root, name) for name in names if (m := re.fullmatch(r"iter_(\d+)", name))}


def finished(out_dir):
    """Whether train.py's run in out_dir reached its last step (always saved), not only a checkpoint on the way."""
    saved = saved_steps(out_dir)
    if not saved:
        return False
    checkpoint = torch.load(run_file(saved[max(saved)]), map_location="cpu", weights_only=True, mmap=True)
    return checkpoint["iter_num"] >= checkpoint["config"]["max_iters"]


def run_file(folder):
    """The file of train.py's save in folder that holds the run: ckpt.pt (a full save), or ckpt_meta.pt (FSDP's)."""
    return os.path.join(folder, "ckpt.pt" if os.path.exists(os.path.join(folder, "ckpt.pt")) else "ckpt_meta.pt")


def checkpoint_path(path):
    return os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path


def load_checkpoint(path, device="cpu"):
    """A checkpoint's dict. Tensors are memory-mapped, not read: asking a checkpoint its model type and config costs
    next to nothing, and a model built from it reads each tensor once."""
    path = checkpoint_path(str(path))
    if not os.path.exists(path):
        die(f"no checkpoint at {path}: train one first (python train.py ...) or point to an existing ckpt.pt")
    if os.path.getsize(path) == 0:
        die(f"checkpoint {path} is empty (a crash before its first write?): retrain, or use another out_dir")
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        die(f"checkpoint {path} is unreadable ({type(e).__name__}{': ' + reason if reason else ''}); "
            f"it may be truncated or not a nanolatent checkpoint: retrain, or resume from another out_dir")
    if not isinstance(checkpoint, dict) or not {"model_type", "model_config", "meta"} <= set(checkpoint):
        die(f"{path} is a torch file but not a nanolatent checkpoint (no model_type, model_config and meta): "
            f"point to a ckpt.pt that train.py, scripts/rlvr.py or scripts/convert.py wrote")
    return checkpoint


def load_model(path, device="cpu", model_type=None, checkpoint=None, **overrides):
    """Model from a checkpoint (read from path unless given), optionally into another model type (a det checkpoint
    into btrans, say). Config fields the target lacks are dropped; parameters new in the target (B-Trans offsets)
    keep their init."""
    checkpoint = checkpoint or load_checkpoint(path, device)
    source_type = checkpoint["model_type"]
    model_type = model_type or source_type
    fields = models.config_fields(model_type)
    model_values = {k: v for k, v in checkpoint["model_config"].items() if k in fields}
    model_values.update(overrides)
    model = models.build_model(model_type, model_values)
    try:
        missing, unexpected = model.load_state_dict(checkpoint["model"], strict=False)
    except RuntimeError as e:  # a tensor of another shape: the overrides or the data changed the architecture
        die(f"checkpoint {checkpoint_path(str(path))} does not fit the {model_type} model asked for: "
            f"{str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else e}")
    if unexpected or (missing and model_type == source_type):
        die(f"checkpoint {checkpoint_path(str(path))} ({source_type}) does not fit a {model_type} model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if missing:
        # One line with a count: a 30-layer model has 61 B-Trans offsets, which listed in full fill a screen.
        print(f"loaded a {source_type} checkpoint into {model_type}; {len(missing)} new parameters keep their init "
              f"({missing[0]}{f' ... {missing[-1]}' if len(missing) > 1 else ''})")
    return model.to(device), checkpoint


