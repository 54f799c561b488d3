"""Checkpoints and run folders: one writer per out_dir, atomic saves, a run refused unless asked to be replaced,
and a model loaded from a checkpoint (into its own type or another)."""

import atexit
import contextlib
import errno
import os
import re
import shutil
import socket
import threading
import time

import torch

from nanolatent import models
from nanolatent.common import die, free_space


_locks = {}  # out_dir's real path -> its open lock file: the locks live as long as the process
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # NFS without lockd, Lustre mounted noflock, some FUSE


def lock_out_dir(out_dir, who):
    """One writer per out_dir: an exclusive flock on out_dir/.lock, released by the OS when the process ends, however
    it ends (kill -9 included), so it is never left held. Where the filesystem has no flock, a lock file instead
    (HeldFile). A second writer stops at once, naming the first. A process that holds the lock already
    (convert.main called twice in one process) keeps it."""
    import fcntl
    refuse_file_out_dir(out_dir)
    if os.path.realpath(out_dir) in _locks:
        return
    try:
        os.makedirs(out_dir, exist_ok=True)
        f = open(os.path.join(out_dir, ".lock"), "a+")
    except OSError as e:
        die(f"cannot write to out_dir {out_dir}: {e.strerror or e}; choose a writable --out_dir")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.seek(0)
        f.truncate()
        f.write(f"{who} (pid {os.getpid()})")
        f.flush()
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        die(f"{out_dir} is in use by {holder}: wait for it to finish, or choose another --out_dir")
    except OSError as e:
        f.close()
        if e.errno not in NO_FLOCK:
            die(f"cannot lock out_dir {out_dir}: {e.strerror or e}; choose an --out_dir on another filesystem")
        f = HeldFile(out_dir, who)
    _locks[os.path.realpath(out_dir)] = f
    # Only the lock holder writes temporary files here, so any left now are from a writer killed mid-write
    # (kill -9 during a checkpoint save): nobody will rename them, and a checkpoint's is as large as the model.
    stale = [name for name in os.listdir(out_dir) if re.fullmatch(r".+\.tmp\d+", name)]
    for name in stale:
        os.remove(os.path.join(out_dir, name))
    folders = os.path.join(out_dir, CHECKPOINTS)  # train.py's saves and deletions killed halfway (prune)
    for name in os.listdir(folders) if os.path.isdir(folders) else []:
        if re.fullmatch(r"iter_\d+\.(tmp|old)", name):
            shutil.rmtree(os.path.join(folders, name))
            stale.append(os.path.join(CHECKPOINTS, name))
    if stale:
        print(f"removed {len(stale)} temporary file(s) left in {out_dir} by a writer that was killed: "
              f"{', '.join(sorted(stale))}")


class HeldFile:
    """The lock of an out_dir on a filesystem without flock: out_dir/.lock.held, created exclusively (O_EXCL) and
    naming its holder, pid and host. The holder touches it every HEARTBEAT seconds and removes it when it exits; a
    holder killed by kill -9 leaves it behind, and the next writer takes it over when its process is gone (same
    host) or it has not been touched for STALE seconds (another host: a job requeued on another node)."""

    HEARTBEAT, STALE = 30, 120

    def __init__(self, out_dir, who):
        self.path = os.path.join(out_dir, ".lock.held")
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                break
            except FileExistsError:
                holder, gone = self.holder()
                if not gone:
                    die(f"{out_dir} is in use by {holder} (the filesystem has no flock: {self.path} says so): wait "
                        f"for it to finish, choose another --out_dir, or delete {self.path} if that process is gone")
                print(f"took over the lock of {holder}: {gone}")
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
        with os.fdopen(fd, "w") as f:
            f.write(f"{who} (pid {os.getpid()} on {socket.gethostname()})")
        self.stopped = threading.Event()
        threading.Thread(target=self.beat, daemon=True).start()
        atexit.register(self.close)

    def holder(self):
        """(what the lock file says, why its holder is gone or None while it may be alive)."""
        try:
            with open(self.path) as f:
                holder = f.read().strip() or "another process"
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return "a writer that just finished", "its lock is gone"
        m = re.fullmatch(r".*\(pid (\d+) on (\S+)\)", holder)
        if m and m.group(2) == socket.gethostname():
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                return holder, "that process is no longer running"
            except PermissionError:  # alive, another user's
                pass
            return holder, None
        return holder, (f"its lock was last touched {age:.0f} s ago" if age > self.STALE else None)

    def beat(self):
        while not self.stopped.wait(self.HEARTBEAT):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def close(self):
        if not self.stopped.is_set():
            self.stopped.set()
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


def refuse_file_out_dir(out_dir):
    """out_dir names a run's folder; the path of its ckpt.pt (which sample.py and evaluate.py take) is one line
    naming the folder, not a message about out_dir/ckpt.pt/ckpt.pt."""
    if os.path.isfile(out_dir):
        die(f"--out_dir={out_dir} is a file{' (a checkpoint)' if out_dir.endswith('.pt') else ''}: out_dir is the "
            f"run's folder, --out_dir={os.path.dirname(out_dir) or '.'}")


def release_out_dir(out_dir):
    """Give back lock_out_dir's lock before the process ends: for a writer called as a function (convert.main in
    a notebook or a test), so the process can go on while another writes there."""
    lock = _locks.pop(os.path.realpath(out_dir), None)
    if lock is not None:
        lock.close()  # closing the file releases the flock; a HeldFile removes itself


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


def unreadable(folder):
    """Why train.py's save in folder cannot be resumed (its ckpt.pt, or ckpt_meta.pt and the shards' .metadata under
    FSDP, missing, empty or not a checkpoint: a disk that lost data, a copy cut short), or None when it can."""
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
        return f"its {name} is unreadable ({type(e).__name__})"
    if not isinstance(checkpoint, dict) or "iter_num" not in checkpoint:
        return f"its {name} is not a checkpoint of train.py"
    return None


def resumable_steps(out_dir):
    """saved_steps, less the newest folders that cannot be resumed (unreadable) where an older one can: each of those
    is renamed iter_N.unreadable, kept for a look, not deleted, and named in one line; a resume then takes the newest
    whole save. Where none is whole, all stay, and loading the newest says what is wrong with it."""
    steps = saved_steps(out_dir)
    damaged = {}
    for it in sorted(steps, reverse=True):
        reason = unreadable(steps[it])
        if reason is None:
            break
        damaged[it] = reason
    if len(damaged) == len(steps):
        return steps
    for it, reason in damaged.items():
        os.replace(steps[it], f"{steps.pop(it)}.unreadable")
        print(f"skipping the save of iter {it}: {reason}; moved to {os.path.join(CHECKPOINTS, f'iter_{it:07d}')}"
              f".unreadable, an older save resumes")
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


