"""train.py's writes into its run folder, in one process or under DDP or FSDP: the save a run starts from, each step
saved whole or not at all with its checksums, the best one's link, the older saves deleted, a save loaded under any
parallel mode, and what a save killed after its commit left undone."""

import contextlib
import hashlib
import os
import shutil

import torch
import torch.distributed as dist

from nanolatent import ckpt, lock, models, optim, records
from nanolatent.common import die, replacing

SUMS = "SHA256SUMS"  # a save's every other file and its SHA-256, as sha256sum writes them (sha256sum -c checks them)


class Saves:
    """Every save is a folder out_dir/checkpoints/iter_N/; out_dir/ckpt.pt (ckpt_meta.pt under FSDP, the tensors
    beside it) links to the best one's file: what sample.py, evaluate.py and --eval_only read. A resume reads the
    newest folder. saved_iter: the step of the newest save, written by this run or resumed from; selected_iter: the
    best one's."""

    def __init__(self, out_dir, fsdp, ddp, rank, keep):
        self.out_dir, self.fsdp, self.ddp, self.master, self.keep = out_dir, fsdp, ddp, rank == 0, keep
        self.pointer = "ckpt_meta.pt" if fsdp else "ckpt.pt"
        self.file = os.path.join(out_dir, self.pointer)
        self.saved_iter = self.selected_iter = None

    def start(self, init_from, overwrite, eval_only):
        """The save folder the run starts from, or None for a fresh run: rank 0 decides, every process reads it. A
        writer locks out_dir first: one writer at a time, and a trained run is never replaced without being asked
        to. --eval_only writes nothing, so it takes no lock: it reads a run that is training, or one on a read-only
        disk."""
        out_dir, folder = self.out_dir, None
        if init_from == "auto" and overwrite and not eval_only:  # each restart (torchrun, a requeue) would replace it
            die("init_from=auto resumes the run in out_dir and overwrite=True replaces it: to start afresh, give "
                "--init_from=scratch --overwrite=True (once, not in the command that restarts)")
        if self.master and eval_only:  # --eval_only evaluates the checkpoint, never a fresh model
            lock.refuse_file_out_dir(out_dir)  # a writer gets the same line from lock_out_dir
            if not os.path.exists(self.file):
                die(f"eval_only reads {self.file}, which does not exist: train first, or point --out_dir at a run")
            folder = os.path.dirname(os.path.realpath(self.file))
        elif self.master:
            refuse_unwritable_checkpoints(out_dir)  # before the lock, which clears what killed saves left there
            lock.lock_out_dir(out_dir, "train.py")
            if init_from != "scratch":
                adopt_single_file(out_dir)
            saved = resumable_steps(out_dir) if init_from != "scratch" else ckpt.saved_steps(out_dir)
            if init_from == "resume" and not saved:
                die(f"init_from=resume continues the run in {out_dir}, which holds no checkpoint "
                    f"({ckpt.CHECKPOINTS}/iter_N): train first, or give --init_from=auto to start when it has none")
            if init_from != "scratch" and saved:
                folder = saved[max(saved)]
            else:
                ckpt.refuse_existing_run(out_dir, overwrite, resumable=True)
                records.refuse_earlier_records(os.path.join(out_dir, "metrics.jsonl"), overwrite)
                prune(out_dir, keep=0)  # --overwrite=True: the old run's saves must not be resumed later
        if self.ddp:  # every process reads rank 0's choice, so out_dir must be on storage that every node sees
            folder = [folder]
            dist.broadcast_object_list(folder, src=0)
            folder = folder[0]
            if folder is not None and not os.path.isdir(folder):
                die(f"process {dist.get_rank()} does not see {folder}, which rank 0 resumes from: out_dir must be on "
                    f"storage that every node sees (a shared filesystem), for DDP and FSDP")
        return folder

    def resumed_settings(self, checkpoint, model_type, model_config, config, given, meta, eval_only):
        """(model_config, freeze_embeddings, optimizer) of the run `checkpoint` resumes: its architecture with the
        overrides that leave every saved tensor's shape unchanged (resume_config), and the optimizer and frozen
        embeddings its saved optimizer state was made with (a run saved before --optimizer existed trained with
        AdamW); `given` (the keys the user set) another of those two is one line, as is a run of another model type
        or vocabulary, one past max_iters, and what train.py refuses of a fresh run's optimizer."""
        out_dir, saved, dataset, max_iters = self.out_dir, checkpoint["config"], config["dataset"], config["max_iters"]
        if checkpoint["model_type"] != model_type:
            die(f"{out_dir} holds a {checkpoint['model_type']} run; resume it with "
                f"--model_type={checkpoint['model_type']}")
        if checkpoint["meta"]["vocab_size"] != meta["vocab_size"]:
            die(f"{out_dir} was trained on a vocabulary of {checkpoint['meta']['vocab_size']}, dataset {dataset!r} "
                f"has {meta['vocab_size']}: resume with the run's --dataset={saved['dataset']}")
        if checkpoint["iter_num"] > max_iters and not eval_only:
            die(f"{out_dir} is at iter {checkpoint['iter_num']}, past --max_iters={max_iters}: give a larger "
                f"--max_iters to train on, or --eval_only=True to evaluate it")
        model_config = resume_config(model_type, checkpoint["model_config"], model_config, out_dir)
        optimizer = saved.get("optimizer", "adamw")
        for key, value in (("optimizer", optimizer), ("freeze_embeddings", saved["freeze_embeddings"])):
            if key in given and config[key] != value and not eval_only:  # the saved state is of that optimizer
                die(f"--{key}={config[key]}: {out_dir} trained with {key}={value}, whose optimizer state its save "
                    f"holds; resume with --{key}={value} (or without --{key}), or train afresh into another out_dir")
        if optimizer == "muon" and not config["learning_rate"]:  # train.py's check of a fresh run, on the one resumed
            die(f"{out_dir} trained with optimizer=muon, which schedules muon_lr as a multiple of learning_rate: "
                f"resume with learning_rate > 0")
        return model_config, saved["freeze_embeddings"], optimizer

    def save(self, model, optimizer, info, selected):
        """Save step info["iter_num"] as out_dir/checkpoints/iter_N/. The folder is written as iter_N.tmp/ and renamed
        once whole: the rename is the commit, so a kill at any instant (any process, SIGKILL included) leaves a resume
        the newest whole checkpoint. Rank 0 writes ckpt.pt (weights, AdamW state, the run: info); under FSDP every
        process writes its shards of the weights and AdamW state (torch.distributed.checkpoint) and rank 0
        ckpt_meta.pt (the rest of ckpt.pt); then SHA256SUMS, every file's checksum, which a resume checks.
        selected: out_dir/ckpt.pt then links to it. Last, all but the `keep` newest folders and the linked one are
        deleted. A step saved already (resumed from the save of a stop, just
        before its evaluation) is only linked."""
        iter_num = info["iter_num"]
        folder = os.path.join(self.out_dir, ckpt.CHECKPOINTS, f"iter_{iter_num:07d}")
        if selected:
            self.selected_iter = iter_num
        written = self.saved_iter != iter_num
        if written:
            tmp, sums = f"{folder}.tmp", {}
            if self.master:
                try:
                    os.makedirs(tmp, exist_ok=True)
                except OSError as e:  # its folder made read-only, or replaced by a file, while the run trained
                    die(f"could not write {tmp}: {e.strerror or e}; make {os.path.dirname(tmp)} writable and resume "
                        f"with --init_from=auto (the previous checkpoint there, if any, is unchanged)")
            if self.fsdp:
                import torch.distributed.checkpoint as dcp  # FSDP runs alone import it (1 s on a CPU)
                from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
                dist.barrier()  # the folder exists before any process writes into it
                # Before the first update AdamW has no state, and get_state_dict would make one by taking a step with
                # zero gradients (its step count would then differ from the uninterrupted run's): the weights alone.
                state = {"model": get_model_state_dict(model)} if not optimizer.state else \
                    dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
                dcp.save(state, checkpoint_id=tmp)
                sums = self.shard_sums(tmp)
            if self.master:  # dcp.save returns once every process has written its files and rank 0 the .metadata
                tensors = {} if self.fsdp else {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                ckpt.save_checkpoint({**tensors, **info, "selected_iter": self.selected_iter},
                                     os.path.join(tmp, self.pointer))
                sums[self.pointer] = sha256(os.path.join(tmp, self.pointer))
                write_sums(tmp, sums)  # what a resume checks (unreadable) before it trains from the save
                os.replace(tmp, folder)
            self.saved_iter = iter_num
        if self.master:
            if selected:
                point(self.out_dir, self.pointer, os.path.join(folder, self.pointer))
            prune(self.out_dir, self.keep, self.pointer)
            if written:
                print(f"saved checkpoint {folder}" + (f" ({self.file} links to it)" if selected else ""))

    def shard_sums(self, folder):
        """{name: sha256} of the files dcp.save wrote into folder: each process hashes a share of them (rank 0's
        listing), so the shards are read once and in parallel; every process gets them all."""
        names = [sorted(os.listdir(folder)) if self.master else None]
        dist.broadcast_object_list(names, src=0)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        shares = [None] * world_size
        dist.all_gather_object(shares, {name: sha256(os.path.join(folder, name))
                                        for name in names[0][rank::world_size]})
        return {name: digest for share in shares for name, digest in share.items()}

    def load(self, model, optimizer, checkpoint, folder, eval_only):
        """Load the weights and AdamW state of `checkpoint`, the run file of `folder`: a full save's (ckpt.pt), or
        the shards of an FSDP save (torch.distributed.checkpoint), whatever world size wrote them (DCP reshards). A
        save of the other parallel mode is converted, and says so: FSDP's shards load as full tensors under DDP (DCP
        gathers them), and under FSDP each process takes its shards of a full save's tensors (set_state_dict with
        full_state_dict=True). Then, unless eval_only, what a save killed after its commit left undone: the best
        save's link and the deletions. Returns (iter_num, best_val_loss)."""
        sharded = "model" not in checkpoint  # ckpt_meta.pt: the tensors are the folder's shards
        # this run's hyper-parameters (muon_lr's lr_scale, weight_decay, betas), which load_state_dict would replace
        # by the save's: a resume trains with the settings it was given and saves again
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        if self.master and sharded != self.fsdp:
            print(f"resuming {'an FSDP (sharded)' if sharded else 'a full (DDP or one-process)'} save under "
                  f"{'FSDP' if self.fsdp else 'DDP' if self.ddp else 'one process'}: "
                  + ("torch.distributed.checkpoint gathers its shards into full tensors" if sharded else
                     "each process keeps its shards of its full tensors (set_state_dict, full_state_dict=True)"))
        if not sharded:
            checkpoint["optimizer"] = optim.one_state(checkpoint["optimizer"], optimizer)
        if sharded or self.fsdp:  # these alone import DCP (1 s on a CPU)
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_state_dict, set_model_state_dict, set_state_dict)
        if not sharded and not self.fsdp:
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
        elif not sharded:
            set_state_dict(model, optimizer, model_state_dict=checkpoint["model"],
                           optim_state_dict=names_for_ids(model, optimizer, checkpoint["optimizer"]),
                           options=StateDictOptions(full_state_dict=True))
        elif not any(key.startswith("optimizer.")  # saved before the first update (save)
                     for key in dcp.FileSystemReader(folder).read_metadata().state_dict_metadata):
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=folder)
            set_model_state_dict(model, state["model"])
        else:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            dcp.load(state, checkpoint_id=folder)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        for group, given in zip(optimizer.param_groups, settings):
            group.update(given)
        iter_num, self.selected_iter = checkpoint["iter_num"], checkpoint["selected_iter"]
        self.saved_iter = iter_num
        if self.master and not eval_only:
            saved = ckpt.saved_steps(self.out_dir)
            if self.selected_iter not in saved:  # the best save's folder deleted by hand: the one resumed stands in
                print(f"the best save (iter {self.selected_iter}) is gone: {self.out_dir}'s link goes to iter "
                      f"{iter_num}'s, resumed")
                self.selected_iter = iter_num
            target = ckpt.run_file(saved[self.selected_iter])  # linked by its own name: ckpt.pt, or ckpt_meta.pt
            link = os.path.join(self.out_dir, os.path.basename(target))
            if os.path.realpath(link) != os.path.realpath(target):
                point(self.out_dir, os.path.basename(target), target)
            prune(self.out_dir, self.keep, self.pointer)
        return iter_num, checkpoint["best_val_loss"]


def names_for_ids(model, optimizer, optimizer_state):
    """optimizer.state_dict() keyed by the parameters' names instead of their indices in the groups, as set_state_dict
    takes it: configure_optimizers lists the same parameters in the same order, sharded or not."""
    names = {p: name for name, p in model.named_parameters()}
    ids = [i for group in optimizer_state["param_groups"] for i in group["params"]]
    name_of = dict(zip(ids, (names[p] for group in optimizer.param_groups for p in group["params"])))
    return {"state": {name_of[i]: value for i, value in optimizer_state["state"].items()},
            "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]}
                             for group in optimizer_state["param_groups"]]}


def refuse_unwritable_checkpoints(out_dir):
    """out_dir/checkpoints, where train.py saves, a file or a folder it cannot write into: one line before the run
    starts, not a traceback at its first save."""
    root = os.path.join(out_dir, ckpt.CHECKPOINTS)
    if os.path.exists(root) and not os.path.isdir(root):
        die(f"{root} is a file, where train.py keeps its saves: move it away, or choose another --out_dir")
    if os.path.isdir(root) and not os.access(root, os.W_OK | os.X_OK):
        die(f"{root} is read-only: train.py saves there; make it writable, or choose another --out_dir")


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
    name = next((name for name in ckpt.RUN_FILES if os.path.exists(os.path.join(folder, name))), None)
    if name is None:
        return f"it holds neither {' nor '.join(ckpt.RUN_FILES)}"
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
    """ckpt.saved_steps, less the newest folders that cannot be resumed (unreadable) where an older one can: each of those
    is renamed iter_N.unreadable (iter_N.unreadable2, ... when a save of that step was set aside before), kept for a
    look, not deleted, and named in one line; a resume then takes the newest whole save. Where none is whole, all
    stay, and one line says what is wrong with the newest."""
    steps = ckpt.saved_steps(out_dir)
    bad = {}
    for it in sorted(steps, reverse=True):
        reason = unreadable(steps[it])
        if reason is None:
            break
        bad[it] = reason
    if bad and len(bad) == len(steps):
        newest = max(steps)
        die(f"no save in {os.path.join(out_dir, ckpt.CHECKPOINTS)} can be resumed; the newest, {ckpt.run_file(steps[newest])}: "
            f"{bad[newest]}; restore it from a copy, or train afresh with --init_from=scratch --overwrite=True")
    for it, reason in bad.items():
        aside, n = f"{steps[it]}.unreadable", 1
        while os.path.exists(aside):
            n += 1
            aside = f"{steps[it]}.unreadable{n}"
        os.replace(steps.pop(it), aside)
        print(f"skipping the save of iter {it}: {reason}; moved to {os.path.join(ckpt.CHECKPOINTS, os.path.basename(aside))}"
              f", an older save resumes")
    return steps


def adopt_single_file(out_dir):
    """A run saved as a plain out_dir/ckpt.pt (the layout before checkpoints/) becomes a save like train.py's:
    checkpoints/iter_N/ckpt.pt, hard-linked (copied where the filesystem has no hard links), then ckpt.pt a link to
    it. Each step is atomic, so a kill anywhere leaves the plain file or the whole folder. Returns the folder, or
    None when out_dir holds no such file."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path) or os.path.islink(path) or ckpt.saved_steps(out_dir):
        return None
    it = ckpt.load_checkpoint(path)["iter_num"]
    folder = os.path.join(out_dir, ckpt.CHECKPOINTS, f"iter_{it:07d}")
    os.makedirs(f"{folder}.tmp")  # lock_out_dir removed any that an adoption killed halfway left
    try:
        os.link(path, os.path.join(f"{folder}.tmp", "ckpt.pt"))
    except OSError:
        shutil.copyfile(path, os.path.join(f"{folder}.tmp", "ckpt.pt"))
    os.replace(f"{folder}.tmp", folder)
    point(out_dir, "ckpt.pt", os.path.join(folder, "ckpt.pt"))
    print(f"{path} was a single file (the layout before {ckpt.CHECKPOINTS}/): now {folder}/ckpt.pt, which ckpt.pt links to")
    return folder


def point(out_dir, name, target):
    """Make out_dir/name a symlink to target (relative, so the run folder can move) in one rename: a reader opening
    out_dir/ckpt.pt sees the previous checkpoint or the new one, never neither. The other name's link, left by the
    run in the other parallel mode (ckpt.pt under DDP, ckpt_meta.pt under FSDP), then goes: one best save."""
    link = os.path.join(out_dir, name)
    with replacing(link) as tmp:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)  # a link of an earlier process with this pid
        os.symlink(os.path.relpath(target, out_dir), tmp)
    for other in ckpt.RUN_FILES:
        if other != name and os.path.islink(os.path.join(out_dir, other)):
            os.remove(os.path.join(out_dir, other))


def prune(out_dir, keep, pointer=None):
    """Delete train.py's checkpoint folders but the `keep` newest and the one out_dir/pointer points to (the best);
    keep=0 and no pointer delete them all (a run replaced with --overwrite=True). Each is first renamed out of the
    iter_N names, so a deletion killed halfway never leaves a partial folder that a resume would take for a whole
    one (lock_out_dir removes it later)."""
    # the best save may still be linked by the other parallel mode's name (a run resumed in the other mode)
    kept = {os.path.dirname(os.path.realpath(os.path.join(out_dir, name))) for name in ckpt.RUN_FILES} if pointer else ()
    steps = ckpt.saved_steps(out_dir)
    for it in sorted(steps)[:max(len(steps) - keep, 0)]:  # fewer folders than keep: none deleted
        if os.path.realpath(steps[it]) not in kept:
            os.replace(steps[it], f"{steps[it]}.old")
            shutil.rmtree(f"{steps[it]}.old")
