"""Checkpoints and run folders: atomic saves, train.py's save folders and the best one's link, a run refused unless
asked to be replaced, and a model loaded from a checkpoint (into its own type or another). The lock: lock.py."""

import contextlib
import hashlib
import os
import re
import shutil

import torch

from nanolatent import models
from nanolatent.common import die, free_space


CHECKPOINTS = "checkpoints"  # train.py's saves: out_dir/checkpoints/iter_0000300/, one folder per step
SUMS = "SHA256SUMS"  # a save's every other file and its SHA-256, as sha256sum writes them (sha256sum -c checks them)
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


def refuse_unwritable_checkpoints(out_dir):
    """out_dir/checkpoints, where train.py saves, a file or a folder it cannot write into: one line before the run
    starts, not a traceback at its first save."""
    root = os.path.join(out_dir, CHECKPOINTS)
    if os.path.exists(root) and not os.path.isdir(root):
        die(f"{root} is a file, where train.py keeps its saves: move it away, or choose another --out_dir")
    if os.path.isdir(root) and not os.access(root, os.W_OK | os.X_OK):
        die(f"{root} is read-only: train.py saves there; make it writable, or choose another --out_dir")


def refuse_nonempty_dir(dst, overwrite, what="--dst"):
    """The guard of a writer whose output is a whole folder of someone else's format (scripts/convert.py to_hf): a file, or
    a folder that holds anything, is written into only with --overwrite=True."""
    if os.path.exists(dst) and not os.path.isdir(dst):
        die(f"{what}={dst} is a file: give a folder to write into")
    held = sorted(os.listdir(dst)) if os.path.isdir(dst) else []
    if held and not overwrite:
        die(f"{what}={dst} is not empty ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): choose an empty or "
            f"new folder, or write into it anyway with --overwrite=True")


def saved_shapes(model_type, model_values):
    """{name: shape} of every tensor a checkpoint of this config holds, from a model built on the meta device."""
    return {k: tuple(v.shape) for k, v in models.meta_model(model_type, model_values).state_dict().items()}


def resume_config(model_type, saved, overrides, out_dir):
    """A resumed run keeps its architecture: the model overrides given with init_from=resume apply when they leave
    every saved tensor's shape unchanged (kappa_bits, sigma, kl_beta, block_size, mapper, ...), and stop the run
    with one line when they would not (n_layer, n_embd, latent_bits, ...)."""
    changed = {k: v for k, v in overrides.items() if saved.get(k) != v}
    if not changed:
        return dict(saved)
    merged = {**saved, **changed}
    before, after = saved_shapes(model_type, saved), saved_shapes(model_type, merged)
    if before != after:
        key = next(k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k))
        die(f"resuming {out_dir} with {', '.join(f'{k}={v!r}' for k, v in changed.items())} would change the shape "
            f"of the saved {key} ({before.get(key)} -> {after.get(key)}); drop that override, or train from scratch "
            f"into another out_dir")
    print(f"resuming with the model overrides {', '.join(f'{k}={v!r}' for k, v in changed.items())} (was "
          f"{', '.join(f'{k}={saved.get(k)!r}' for k in changed)}): no saved tensor changes shape")
    return merged


def save_checkpoint(checkpoint, path):
    """Write to a temporary file of this process, then rename: a crash mid-write never leaves a truncated checkpoint
    behind, and two writers never share a temporary file. A write that fails removes its temporary file and stops
    with one line; the previous checkpoint is untouched."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk (torch's writer raises RuntimeError), a read-only folder
        with contextlib.suppress(OSError):
            os.remove(tmp)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[-1][:200]
        die(f"could not write {path}: {reason}{free_space(path)}; free some space or choose another out_dir "
            f"(the previous checkpoint there, if any, is unchanged)")
    except BaseException:  # interrupted (a second Ctrl-C): no half-written file is left behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def saved_steps(out_dir):
    """{iter: folder} of train.py's whole checkpoints in out_dir. A folder is written as iter_N.tmp and gets its
    name iter_N by one rename once every file in it is complete, so a folder with that name is whole, whenever the
    writers were killed."""
    root = os.path.join(out_dir, CHECKPOINTS)
    names = os.listdir(root) if os.path.isdir(root) else []
    return {int(m.group(1)): os.path.join(root, name) for name in names if (m := re.fullmatch(r"iter_(\d+)", name))}


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_sums(folder, sums):
    """folder/SHA256SUMS from {file name: its sha256}: written into the save's folder before the rename that commits
    it, so a save's files and their checksums come whole together."""
    with open(os.path.join(folder, SUMS), "w") as f:
        f.writelines(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))


def damaged(folder):
    """Why the files of folder differ from its SHA256SUMS (a byte changed, a file cut short or gone), or None when they
    all match, or when the save has no SHA256SUMS (written before saves had one)."""
    path = os.path.join(folder, SUMS)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        listed = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
    for digest, name in listed:
        if not os.path.exists(os.path.join(folder, name)):
            return f"its {name}, listed in {SUMS}, is missing"
        if sha256(os.path.join(folder, name)) != digest:
            return f"its {name} does not match its checksum in {SUMS} (changed or cut short since it was saved)"
    return None


def unreadable(folder):
    """Why train.py's save in folder cannot be resumed (its ckpt.pt, or ckpt_meta.pt and the shards' .metadata under
    FSDP, missing, empty or not a checkpoint: a disk that lost data, a copy cut short; any file that differs from
    its SHA256SUMS), or None when it can."""
    name = next((name for name in RUN_FILES if os.path.exists(os.path.join(folder, name))), None)
    if name is None:
        return f"it holds neither {' nor '.join(RUN_FILES)}"
    if name == "ckpt_meta.pt" and not os.path.exists(os.path.join(folder, ".metadata")):
        return "its shards have no .metadata"
    path = os.path.join(folder, name)
    if os.path.getsize(path) == 0:
        return f"its {name} is empty"
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        return f"its {name} is unreadable ({type(e).__name__}: truncated, or not a torch file)"
    if not isinstance(checkpoint, dict) or "iter_num" not in checkpoint:
        return f"its {name} is a torch file but not a nanolatent checkpoint of train.py"
    return damaged(folder)


def resumable_steps(out_dir):
    """saved_steps, less the newest folders that cannot be resumed (unreadable) where an older one can: each of those
    is renamed iter_N.unreadable (iter_N.unreadable2, ... when a save of that step was set aside before), kept for a
    look, not deleted, and named in one line; a resume then takes the newest whole save. Where none is whole, all
    stay, and one line says what is wrong with the newest."""
    steps = saved_steps(out_dir)
    bad = {}
    for it in sorted(steps, reverse=True):
        reason = unreadable(steps[it])
        if reason is None:
            break
        bad[it] = reason
    if bad and len(bad) == len(steps):
        newest = max(steps)
        die(f"no save in {os.path.join(out_dir, CHECKPOINTS)} can be resumed; the newest, {run_file(steps[newest])}: "
            f"{bad[newest]}; restore it from a copy, or train afresh with --init_from=scratch --overwrite=True")
    for it, reason in bad.items():
        aside, n = f"{steps[it]}.unreadable", 1
        while os.path.exists(aside):
            n += 1
            aside = f"{steps[it]}.unreadable{n}"
        os.replace(steps.pop(it), aside)
        print(f"skipping the save of iter {it}: {reason}; moved to {os.path.join(CHECKPOINTS, os.path.basename(aside))}"
              f", an older save resumes")
    return steps


def adopt_single_file(out_dir):
    """A run saved as a plain out_dir/ckpt.pt (the layout before checkpoints/) becomes a save like train.py's:
    checkpoints/iter_N/ckpt.pt, hard-linked (copied where the filesystem has no hard links), then ckpt.pt a link to
    it. Each step is atomic, so a kill anywhere leaves the plain file or the whole folder. Returns the folder, or
    None when out_dir holds no such file."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path) or os.path.islink(path) or saved_steps(out_dir):
        return None
    it = load_checkpoint(path)["iter_num"]
    folder = os.path.join(out_dir, CHECKPOINTS, f"iter_{it:07d}")
    os.makedirs(f"{folder}.tmp")  # lock_out_dir removed any that an adoption killed halfway left
    try:
        os.link(path, os.path.join(f"{folder}.tmp", "ckpt.pt"))
    except OSError:
        shutil.copyfile(path, os.path.join(f"{folder}.tmp", "ckpt.pt"))
    os.replace(f"{folder}.tmp", folder)
    point(out_dir, "ckpt.pt", os.path.join(folder, "ckpt.pt"))
    print(f"{path} was a single file (the layout before {CHECKPOINTS}/): now {folder}/ckpt.pt, which ckpt.pt links to")
    return folder


def finished(out_dir):
    """Whether train.py's run in out_dir reached its last step (always saved), not only a checkpoint on the way."""
    saved = saved_steps(out_dir)
    if not saved:
        return False
    checkpoint = torch.load(run_file(saved[max(saved)]), map_location="cpu", weights_only=True, mmap=True)
    return checkpoint["iter_num"] >= checkpoint["config"]["max_iters"]


def point(out_dir, name, target):
    """Make out_dir/name a symlink to target (relative, so the run folder can move) in one rename: a reader opening
    out_dir/ckpt.pt sees the previous checkpoint or the new one, never neither. The other name's link, left by the
    run in the other parallel mode (ckpt.pt under DDP, ckpt_meta.pt under FSDP), then goes: one best save."""
    link = os.path.join(out_dir, name)
    tmp = f"{link}.tmp{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    os.symlink(os.path.relpath(target, out_dir), tmp)
    os.replace(tmp, link)
    for other in RUN_FILES:
        if other != name and os.path.islink(os.path.join(out_dir, other)):
            os.remove(os.path.join(out_dir, other))


def run_file(folder):
    """The file of train.py's save in folder that holds the run: ckpt.pt (a full save), or ckpt_meta.pt (FSDP's)."""
    return os.path.join(folder, "ckpt.pt" if os.path.exists(os.path.join(folder, "ckpt.pt")) else "ckpt_meta.pt")


def prune(out_dir, keep, pointer=None):
    """Delete train.py's checkpoint folders but the `keep` newest and the one out_dir/pointer points to (the best);
    keep=0 and no pointer delete them all (a run replaced with --overwrite=True). Each is first renamed out of the
    iter_N names, so a deletion killed halfway never leaves a partial folder that a resume would take for a whole
    one (lock_out_dir removes it later)."""
    # the best save may still be linked by the other parallel mode's name (a run resumed in the other mode)
    kept = {os.path.dirname(os.path.realpath(os.path.join(out_dir, name))) for name in RUN_FILES} if pointer else ()
    steps = saved_steps(out_dir)
    for it in sorted(steps)[:max(len(steps) - keep, 0)]:  # fewer folders than keep: none deleted
        if os.path.realpath(steps[it]) not in kept:
            os.replace(steps[it], f"{steps[it]}.old")
            shutil.rmtree(f"{steps[it]}.old")


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


