"""Checkpoints and resuming (nanolatent/ckpt.py, saves.py), runs that keep their progress: --init_from=auto, saves
killed at each of their steps, a job SIGKILLed at random steps, and evaluations seeded from (seed, step, rank, batch);
on 1 process and 2 gloo processes (DDP, FSDP). What a resume may change, a save it cannot read (one line naming it),
and stopping: Ctrl-C, SIGTERM and a full disk leave a loadable checkpoint at the expected step and no temporary
file."""

import hashlib
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import (FORKRUN, KILL_IN_SAVE, ROOT, TINY, assert_one_line_error, records, run_script, snapshot,
                      start_script, train_det, train_in_process, wait_for_line, write)
from kill_in_save import job, kill_job

from nanolatent import ckpt, lock, optim, saves

MODES = {"single": ([], 0), "ddp": ([], 2), "fsdp": (["--fsdp=True"], 2)}  # train.py flags, processes
TIMINGS = ("tokens_per_s", "mfu")  # the only fields of a record that differ between identical runs


def command(mode, out_dir, *args, kill_in_save=False, torchrun=True):
    """train.py --init_from=auto on the tiny det model, 2 micro-batches per step: one process, or two under torchrun
    (or support/forkrun.py: its workers forked, not started); through support/kill_in_save.py to inject a kill."""
    flags, nproc = MODES[mode]
    starter = ["-m", "torch.distributed.run", "--standalone"] if torchrun else [FORKRUN]
    launcher = [*starter, f"--nproc_per_node={nproc}"] if nproc else []
    script = [KILL_IN_SAVE, "train.py"] if kill_in_save else ["train.py"]
    return [sys.executable, *launcher, *script, f"--out_dir={out_dir}", "--model_type=det", *TINY, *flags,
            "--gradient_accumulation_steps=2", "--init_from=auto", *args]


def launch(cmd, data_root, log_file):
    """The job, as `cmd > log_file 2>&1 &` starts it."""
    return start_script(*cmd[1:], data_dir=data_root, out=log_file, err=log_file)


def run_job(cmd, data_root, **env):
    """Run the job to its end; (exit code, output)."""
    proc = run_script(*cmd, data_dir=data_root, check=False, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def finish(cmd, data_root):
    code, out = run_job(cmd, data_root)
    assert code == 0, out[-3000:]
    return out


def untimed(out_dir):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records(out_dir)]


def newest_weights(out_dir, tmp_path):
    """The model of the newest checkpoint folder, gathered from its shards under FSDP."""
    saved = ckpt.saved_steps(out_dir)
    folder = saved[max(saved)]
    if os.path.exists(os.path.join(folder, "ckpt.pt")):
        return torch.load(os.path.join(folder, "ckpt.pt"), weights_only=True)["model"]
    gathered = tmp_path / f"gathered_{os.path.basename(out_dir)}.pt"
    dcp_to_torch_save(folder, gathered)
    return torch.load(gathered, weights_only=True)["model"]


def assert_same_run(out_dir, full, tmp_path):
    """The same records, the same final weights bit for bit, the same folders kept and the same link."""
    assert untimed(out_dir) == untimed(full)
    a, b = newest_weights(out_dir, tmp_path), newest_weights(full, tmp_path)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(os.listdir(out_dir / ckpt.CHECKPOINTS)) == sorted(os.listdir(full / ckpt.CHECKPOINTS))
    link = next(name for name in ckpt.RUN_FILES if os.path.islink(full / name))
    assert os.readlink(out_dir / link) == os.readlink(full / link)


# Saves at steps 0 and 1 (each the best so far, linked as ckpt.pt); the second prunes the first (keep 1).
SAVES = ["--max_iters=1", "--eval_interval=1", "--keep_checkpoints=1"]


def kill_and_resume(mode, out_dir, ops, n, data_root):
    """The job killed before its nth change to its checkpoints, then the same command run to its end in out_dir."""
    code, out = run_job(command(mode, out_dir, *SAVES, kill_in_save=True, torchrun=False), data_root,
                    NANOLATENT_KILL_AT=str(n), NANOLATENT_KILL_LOG=str(ops))
    assert code == -signal.SIGKILL, out[-3000:]
    done = ops.read_text().splitlines() if ops.exists() else []
    assert len(done) == n - 1
    committed = [int(m.group(1)) for op in done if (m := re.fullmatch(r"replace \S+\.tmp \S+/iter_(\d+)", op))]
    resumed = finish(command(mode, out_dir, *SAVES, torchrun=False), data_root)
    if committed:
        assert f"resuming from {out_dir}/{ckpt.CHECKPOINTS}/iter_{committed[-1]:07d} at iter {committed[-1]}" \
               in resumed
    else:
        assert "resuming" not in resumed


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_save_killed_at_each_of_its_steps_resumes_from_the_newest_whole_checkpoint(mode, data_root, tmp_path):
    """Kill the whole job before the 1st, 2nd, ... change train.py makes to its checkpoints, up to the last one that
    the run makes unkilled; each time the same command resumes from the newest folder committed before the kill (or
    starts, when none was) and ends as the uninterrupted run did. The kill points are independent jobs, two at a
    time, their 2 processes forked by tests/support/forkrun.py: 36 jobs a mode spend most of their time starting."""
    full, out_dir, ops = tmp_path / "full", tmp_path / "unkilled", tmp_path / "ops.txt"
    with ThreadPoolExecutor(2) as pool:
        uninterrupted = pool.submit(finish, command(mode, full, *SAVES, torchrun=False), data_root)
        code, out = run_job(command(mode, out_dir, *SAVES, kill_in_save=True, torchrun=False), data_root,
                        NANOLATENT_KILL_AT="0", NANOLATENT_KILL_LOG=str(ops))
        assert code == 0, out[-3000:]
        done = ops.read_text().splitlines()  # every change of the run: both saves, both links and the prune
        kills = [(tmp_path / f"kill{n}", tmp_path / f"ops{n}.txt", n) for n in range(1, len(done) + 1)]
        list(pool.map(lambda kill: kill_and_resume(mode, *kill, data_root), kills))
        uninterrupted.result()
    for killed in [out_dir, *(kill_dir for kill_dir, _, _ in kills)]:
        assert_same_run(killed, full, tmp_path)
    commits = [op for op in done if re.fullmatch(r"replace \S+\.tmp \S+/iter_000000[01]", op)]
    link = re.escape(f"{out_dir}/") + r"ckpt(_meta)?\.pt"
    links = [op for op in done if re.fullmatch(rf"replace {link}\.tmp\d+ {link}", op)]
    assert len(commits) == len(links) == 2 and done[-1] == f"rmtree {out_dir}/{ckpt.CHECKPOINTS}/iter_0000000.old"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_job_sigkilled_three_times_at_random_steps_ends_as_the_uninterrupted_run(mode, data_root, tmp_path):
    """The issue's acceptance test: SIGKILL to every process of a 2-process job at 3 random steps, each time restarted
    with the same --init_from=auto command (what torchrun --max_restarts and SLURM's requeue do)."""
    args = ["--max_iters=24", "--eval_interval=4", "--checkpoint_interval=3"]
    full, out_dir = tmp_path / "full", tmp_path / "killed"
    finish(command(mode, full, *args), data_root)
    kills = sorted(random.Random(45).sample(range(1, 24), 3))
    for i, step in enumerate(kills):
        log_file = tmp_path / f"launch{i}.log"
        proc = launch(command(mode, out_dir, *args), data_root, log_file)
        # its own stdout, every step logged (a resumed run's metrics.jsonl starts with the old records); a launch
        # resumes from a step before the last kill's, so before this one
        wait_for_line(log_file, f"iter {step}/", proc)
        kill_job(job(proc.pid))
        proc.wait()
    finish(command(mode, out_dir, *args), data_root)
    final = [r["val_loss"] for r in records(out_dir) if "val_loss" in r][-1]
    assert abs(final - [r["val_loss"] for r in records(full) if "val_loss" in r][-1]) < 1e-5
    assert_same_run(out_dir, full, tmp_path)


@pytest.mark.slow
def test_init_from_auto_starts_in_an_empty_out_dir_and_resumes_a_run(data_root, tmp_path):
    args = ["--init_from=auto", "--eval_interval=2"]
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run beside the two parts: each process takes one core
        full = pool.submit(train_det, data_root, tmp_path / "full", *args, "--max_iters=4")
        first = train_det(data_root, tmp_path / "part", *args, "--max_iters=2").stdout
        second = train_det(data_root, tmp_path / "part", *args, "--max_iters=4").stdout
        full.result()
    assert "resuming" not in first
    assert f"resuming from {tmp_path / 'part' / ckpt.CHECKPOINTS / 'iter_0000002'} at iter 2" in second
    assert untimed(tmp_path / "part") == untimed(tmp_path / "full")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["free", "eve", "btrans"])
def test_a_resumed_stochastic_run_evaluates_as_the_uninterrupted_run(model_type, data_root, tmp_path):
    """Its evaluation noise (the posterior Z, EVE's eps, B-Trans minds) is seeded from (seed, step, rank, batch):
    the evaluation at the resumed step, which follows no training step, gives the uninterrupted run's numbers."""
    args = [f"--model_type={model_type}", "--init_from=auto", "--eval_interval=2"]
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run beside the two parts: each process takes one core
        full = pool.submit(run_script, "train.py", f"--out_dir={tmp_path / 'full'}", *TINY, *args, "--max_iters=4",
                           data_dir=data_root)
        run_script("train.py", f"--out_dir={tmp_path / 'part'}", *TINY, *args, "--max_iters=2", data_dir=data_root)
        run_script("train.py", f"--out_dir={tmp_path / 'part'}", *TINY, *args, "--max_iters=4", data_dir=data_root)
        full.result()
    assert untimed(tmp_path / "part") == untimed(tmp_path / "full")


# ----------------------------------------------------------------------------------------------------------------
# what a resume can change takes effect (docs/training.md's table; what it cannot is refused: test_train.py's
# TRAIN_CASES)


@pytest.mark.slow
def test_a_resume_takes_its_new_steps_intervals_and_learning_rate_schedule(data_root, tmp_path):
    out_dir = tmp_path / "run"
    train_det(data_root, out_dir, "--max_iters=2", "--eval_interval=2")
    out = train_det(data_root, out_dir, "--init_from=resume", "--max_iters=7", "--eval_interval=3",
                    "--checkpoint_interval=5", "--keep_checkpoints=1", "--learning_rate=0.002", "--min_lr=0.0001",
                    "--warmup_iters=1", "--lr_decay_iters=6").stdout
    assert [r["iter"] for r in records(out_dir) if "val_loss" in r] == [0, 3, 6, 7]
    assert f"saved checkpoint {out_dir / ckpt.CHECKPOINTS / 'iter_0000005'}" in out
    cosine = lambda it: 1e-4 + 0.5 * (1 + math.cos(math.pi * (it - 1) / 5)) * (2e-3 - 1e-4) if it < 6 else 1e-4
    assert [(r["iter"], r["lr"]) for r in records(out_dir) if "lr" in r][2:] == [(it, pytest.approx(cosine(it)))
                                                                                 for it in range(2, 7)]


@pytest.mark.slow
def test_a_resume_trains_with_the_optimizer_settings_it_is_given(data_root, tmp_path):
    """A Muon run resumed with --muon_lr=0 --weight_decay=0.05 --beta2=0.9: the save's values of these (its groups'
    lr_scale above all) give way to the ones given. Muon's matrices stay as saved, the rest moves, and the next save
    holds the new values in its config and its optimizer's groups."""
    out_dir = tmp_path / "run"
    args = ["--optimizer=muon", "--eval_interval=2", "--checkpoint_interval=1", "--keep_checkpoints=5"]
    train_det(data_root, out_dir, *args, "--max_iters=2")
    train_det(data_root, out_dir, *args, "--max_iters=4", "--init_from=resume", "--muon_lr=0.0", "--weight_decay=0.05",
              "--beta2=0.9")
    before, after = (torch.load(out_dir / ckpt.CHECKPOINTS / f"iter_000000{it}" / "ckpt.pt", weights_only=True)
                     for it in (2, 4))
    model, _ = ckpt.load_model(out_dir / "ckpt.pt")
    hidden = {id(p) for p in optim.muon_params(model)}
    names = {name: id(p) in hidden for name, p in model.named_parameters()}
    assert sum(names.values()) == 7 * 2 and all(
        torch.equal(before["model"][name], after["model"][name]) == muon for name, muon in names.items())
    groups = after["optimizer"]["param_groups"]  # Muon's, then AdamW's matrices and vectors (optim.MuonAdamW)
    assert [g["lr_scale"] for g in groups] == [0.0, 1.0, 1.0] and after["config"]["muon_lr"] == 0.0
    assert [g["weight_decay"] for g in groups] == [0.05, 0.05, 0.0] and tuple(groups[1]["betas"]) == (0.9, 0.9)


@pytest.mark.slow
def test_resume_applies_an_override_that_changes_no_shape_and_says_so(run, data_root):
    proc = train_det(data_root, run, "--init_from=resume", "--max_iters=6", "--rope_theta=5000.0")
    assert "rope_theta=5000.0 (was rope_theta=10000.0)" in proc.stdout
    assert torch.load(run / "ckpt.pt", weights_only=True)["model_config"]["rope_theta"] == 5000.0



def test_prune_keeps_the_newest_and_the_linked_checkpoint_and_ignores_partial_folders(tmp_path):
    for it in range(1, 6):
        os.makedirs(tmp_path / ckpt.CHECKPOINTS / f"iter_{it:07d}")
        (tmp_path / ckpt.CHECKPOINTS / f"iter_{it:07d}" / "ckpt.pt").write_text(str(it))
    os.makedirs(tmp_path / ckpt.CHECKPOINTS / "iter_0000009.tmp")  # a save killed halfway
    os.makedirs(tmp_path / ckpt.CHECKPOINTS / "iter_0000000.old")  # a deletion killed halfway
    saves.point(tmp_path, "ckpt.pt", tmp_path / ckpt.CHECKPOINTS / "iter_0000002" / "ckpt.pt")
    assert sorted(ckpt.saved_steps(tmp_path)) == [1, 2, 3, 4, 5]
    saves.prune(tmp_path, 2, "ckpt.pt")
    assert sorted(ckpt.saved_steps(tmp_path)) == [2, 4, 5]
    assert (tmp_path / "ckpt.pt").read_text() == "2" and os.readlink(tmp_path / "ckpt.pt").startswith(ckpt.CHECKPOINTS)
    saves.prune(tmp_path, 0)
    assert ckpt.saved_steps(tmp_path) == {}
    assert sorted(os.listdir(tmp_path / ckpt.CHECKPOINTS)) == ["iter_0000000.old", "iter_0000009.tmp"]
    lock.lock_out_dir(tmp_path, "test")  # the next writer removes what killed writers left
    lock.release_out_dir(tmp_path)
    assert os.listdir(tmp_path / ckpt.CHECKPOINTS) == []


# ----------------------------------------------------------------------------------------------------------------
# failures end the job fast, and say so


def ranks(pids):
    """{rank: pid} of the worker processes among pids."""
    ranks = {}
    for pid in pids[1:]:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        ranks[int(env[b"RANK"])] = pid
    return ranks


def start_job(data_root, log_file, out_dir, *args):
    """A 2-process DDP job that trains until stopped; returns once it has logged step 3."""
    proc = launch(command("ddp", out_dir, "--max_iters=100000", "--eval_interval=100000", *args), data_root, log_file)
    wait_for_line(log_file, "iter 3/", proc)
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP])
def test_when_a_process_dies_or_hangs_the_other_stops_with_one_line_within_dist_timeout(signum, data_root, tmp_path):
    """kill -9 of one process (gloo sees its connection drop), or SIGSTOP (a hang: only the timeout notices): the other
    process prints one line, not a traceback, and exits, within dist_timeout (10 s here; 20 s of slack for a busy
    machine)."""
    log_file = tmp_path / "job.log"
    proc = start_job(data_root, log_file, tmp_path / "run", "--dist_timeout=10")
    pids = job(proc.pid)  # now: a stopped process outlives torchrun, which leaves it to init
    try:
        os.kill(ranks(pids)[1], signum)
        t0 = time.time()
        while "lost the job's other processes" not in log_file.read_text():
            assert time.time() - t0 < 30, log_file.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        kill_job(pids)
        proc.wait()
    text = log_file.read_text()
    lines = [line for line in text.splitlines() if "lost the job's other processes" in line]
    assert len(lines) == 1 and lines[0].startswith("error: process 0 lost") and "dist_timeout=10 s" in lines[0]
    assert "[rank0]" not in text and "train.py\", line" not in text  # no traceback of train.py's


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_the_current_step_in_every_process_without_a_traceback(data_root, tmp_path):
    """A scheduler's preemption: torchrun passes SIGTERM to its processes, which agree on the step, save it and
    exit; the same command then resumes from it."""
    log_file, out_dir = tmp_path / "job.log", tmp_path / "run"
    proc = start_job(data_root, log_file, out_dir)
    pids = job(proc.pid)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        kill_job(pids)  # nothing left, unless the test failed
    text = log_file.read_text()
    stopped = re.findall(r"stopped by SIGTERM: \S+ holds iter (\d+);", text)
    assert len(stopped) == 1 and max(ckpt.saved_steps(out_dir)) == int(stopped[0]) > 3
    assert "[rank0]" not in text and "[rank1]" not in text and "train.py\", line" not in text


def test_a_run_is_finished_when_its_newest_checkpoint_is_at_max_iters(tmp_path):
    """What the studies' train_if_missing asks before training (a killed run has checkpoints too, from step 0)."""
    def save(it, name):
        os.makedirs(tmp_path / ckpt.CHECKPOINTS / f"iter_{it:07d}")
        torch.save({"iter_num": it, "config": {"max_iters": 6}}, tmp_path / ckpt.CHECKPOINTS / f"iter_{it:07d}" / name)
    assert not ckpt.finished(tmp_path)
    save(0, "ckpt.pt")
    save(3, "ckpt.pt")
    assert not ckpt.finished(tmp_path)
    save(6, "ckpt_meta.pt")  # under FSDP
    assert ckpt.finished(tmp_path)


@pytest.mark.parametrize("keep", [1, 2, 3, 4, 7, 31])
def test_retention_keeps_exactly_the_newest_n_and_the_best_over_thirty_saves(keep, tmp_path):
    """keep_checkpoints=N for every N, fewer folders than N included: after each of 30 saves (a new best at some of
    them, as train.py links it) the folders left are the N newest and the linked one, no more, no fewer."""
    rng, best = random.Random(keep), None
    for it in range(30):
        folder = tmp_path / ckpt.CHECKPOINTS / f"iter_{it:07d}"
        os.makedirs(folder)
        (folder / "ckpt.pt").write_text(str(it))
        if best is None or rng.random() < 0.2:
            best = it
            saves.point(tmp_path, "ckpt.pt", folder / "ckpt.pt")
        saves.prune(tmp_path, keep, "ckpt.pt")
        assert sorted(ckpt.saved_steps(tmp_path)) == sorted(set(range(max(it + 1 - keep, 0), it + 1)) | {best})
        assert (tmp_path / "ckpt.pt").read_text() == str(best)


def tree(out_dir):
    """{path: (link target or size)} of every file and link under out_dir but its lock and metrics."""
    found = {}
    for folder, _, names in os.walk(out_dir):
        for name in names:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, out_dir)] = os.readlink(path) if os.path.islink(path) else os.path.getsize(path)
    return {k: v for k, v in found.items() if k != ".lock"}


@pytest.fixture(scope="module")
def saved_run(data_root, tmp_path_factory):
    """A finished det run saved at every step 0..4 (the newest 3 kept, and the best), and its arguments."""
    args = ["--init_from=auto", "--max_iters=4", "--eval_interval=2", "--checkpoint_interval=1", "--keep_checkpoints=3"]
    out_dir = tmp_path_factory.mktemp("saved") / "full"
    train_det(data_root, out_dir, *args)
    return out_dir, args


def copy_run(saved_run, tmp_path):
    out_dir = tmp_path / "copy"
    shutil.copytree(saved_run[0], out_dir, symlinks=True)
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["empty", "truncated", "no_file"])
def test_auto_resumes_from_the_newest_whole_save_when_the_newest_is_damaged(damage, saved_run, data_root, tmp_path):
    """The newest save cut short (a disk that lost data): auto resumes from the older whole save beside it, keeps the
    damaged folder aside as iter_N.unreadable, and ends as the uninterrupted run did."""
    out_dir = copy_run(saved_run, tmp_path)
    newest = out_dir / ckpt.CHECKPOINTS / "iter_0000004"
    if damage == "no_file":
        os.remove(newest / "ckpt.pt")
    else:
        with open(newest / "ckpt.pt", "r+b") as f:
            f.truncate(0 if damage == "empty" else 1000)
    out = train_det(data_root, out_dir, *saved_run[1]).stdout
    assert f"resuming from {out_dir / ckpt.CHECKPOINTS / 'iter_0000003'} at iter 3" in out
    assert "skipping the save of iter 4" in out and os.path.isdir(f"{newest}.unreadable")
    assert untimed(out_dir) == untimed(saved_run[0])
    a, b = (torch.load(d / ckpt.CHECKPOINTS / "iter_0000004" / "ckpt.pt", weights_only=True)["model"]
            for d in (out_dir, saved_run[0]))
    assert all(torch.equal(a[k], b[k]) for k in a)


def overwrite_tensor_bytes(path):
    """64 bytes of the token embedding's values in a ckpt.pt overwritten with 0xff (NaNs in float32): the file still
    loads, and only its checksum tells."""
    data = bytearray(path.read_bytes())
    at = data.find(torch.load(path, weights_only=True)["model"]["tok_emb.weight"].numpy().tobytes()[:256])
    assert at > 0
    data[at:at + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_save_whose_bytes_changed_is_set_aside_each_time_under_a_fresh_name(saved_run, data_root, tmp_path):
    """The newest save's tensor bytes overwritten, twice (the run resumed from the older save writes iter 4 again):
    each time it is moved aside (iter_N.unreadable, then iter_N.unreadable2), the newest whole save resumes, saying
    so, and the run ends as the uninterrupted one did."""
    out_dir = copy_run(saved_run, tmp_path)
    newest = out_dir / ckpt.CHECKPOINTS / "iter_0000004"
    for aside in ("iter_0000004.unreadable", "iter_0000004.unreadable2"):
        overwrite_tensor_bytes(newest / "ckpt.pt")
        out = train_det(data_root, out_dir, *saved_run[1]).stdout
        assert f"resuming from {out_dir / ckpt.CHECKPOINTS / 'iter_0000003'} at iter 3" in out
        assert f"does not match its checksum in {saves.SUMS}" in out and f"moved to {ckpt.CHECKPOINTS}/{aside}," in out
        assert untimed(out_dir) == untimed(saved_run[0])
    assert os.path.isdir(f"{newest}.unreadable") and os.path.isdir(f"{newest}.unreadable2")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_file_of_a_save_has_its_checksum_written_with_it(mode, data_root, tmp_path):
    """One process, DDP and FSDP (every process's shards, the .metadata and ckpt_meta.pt): SHA256SUMS lists every
    other file of each save folder with its SHA-256, as hashlib computes it."""
    out_dir = tmp_path / "run"
    finish(command(mode, out_dir, *SAVES, "--keep_checkpoints=2", torchrun=False), data_root)
    for folder in ckpt.saved_steps(out_dir).values():
        with open(os.path.join(folder, saves.SUMS)) as f:
            listed = dict(reversed(line.split()) for line in f)
        assert sorted(listed) == sorted(name for name in os.listdir(folder) if name != saves.SUMS)
        for name, digest in listed.items():
            with open(os.path.join(folder, name), "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == digest
        if mode == "fsdp":
            assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "ckpt_meta.pt"} <= set(listed)


@pytest.mark.slow
def test_an_fsdp_save_with_a_truncated_shard_is_set_aside_and_the_older_one_resumes(data_root, tmp_path):
    args = ["--eval_interval=2", "--checkpoint_interval=1", "--keep_checkpoints=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    finish(command("fsdp", full, *args, "--max_iters=3", torchrun=False), data_root)
    finish(command("fsdp", part, *args, "--max_iters=2", torchrun=False), data_root)
    shard = part / ckpt.CHECKPOINTS / "iter_0000002" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    out = finish(command("fsdp", part, *args, "--max_iters=3", torchrun=False), data_root)
    assert "skipping the save of iter 2: its __1_0.distcp does not match its checksum" in out
    assert f"resuming from {part / ckpt.CHECKPOINTS / 'iter_0000001'} at iter 1" in out and "Traceback" not in out
    assert untimed(part) == untimed(full)
    a, b = newest_weights(part, tmp_path), newest_weights(full, tmp_path)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_auto_relinks_ckpt_pt_when_the_best_save_was_deleted_by_hand(saved_run, data_root, tmp_path):
    """learning_rate=min_lr=0: the val loss never improves on step 0's, so the best save is iter 0, kept beside the newest."""
    out_dir, args = tmp_path / "run", [*saved_run[1], "--learning_rate=0", "--min_lr=0"]
    train_det(data_root, out_dir, *args)
    assert os.path.realpath(out_dir / "ckpt.pt") == str(out_dir / ckpt.CHECKPOINTS / "iter_0000000" / "ckpt.pt")
    shutil.rmtree(out_dir / ckpt.CHECKPOINTS / "iter_0000000")
    out = train_det(data_root, out_dir, *args).stdout
    assert "is gone" in out and "done" in out
    assert os.path.realpath(out_dir / "ckpt.pt") == str(out_dir / ckpt.CHECKPOINTS / "iter_0000004" / "ckpt.pt")
    run_script("sample.py", f"--out_dir={out_dir}", "--start=K>", "--num_samples=1", "--max_new_tokens=4",
               data_dir=data_root)


@pytest.mark.slow
@pytest.mark.parametrize("init_from", ["resume", "auto"])
def test_a_run_saved_as_a_single_ckpt_pt_resumes(init_from, saved_run, data_root, tmp_path):
    """The layout before checkpoints/: a plain out_dir/ckpt.pt. It becomes checkpoints/iter_N/ (its bytes unchanged),
    linked by ckpt.pt, and the run goes on from it as the uninterrupted run did."""
    out_dir = tmp_path / "old"
    os.makedirs(out_dir)
    shutil.copyfile(saved_run[0] / ckpt.CHECKPOINTS / "iter_0000002" / "ckpt.pt", out_dir / "ckpt.pt")
    shutil.copyfile(saved_run[0] / "metrics.jsonl", out_dir / "metrics.jsonl")
    data = (out_dir / "ckpt.pt").read_bytes()
    args = [a for a in saved_run[1] if not a.startswith("--init_from")]
    out = train_det(data_root, out_dir, *args, f"--init_from={init_from}").stdout
    assert f"resuming from {out_dir / ckpt.CHECKPOINTS / 'iter_0000002'} at iter 2" in out
    assert (out_dir / ckpt.CHECKPOINTS / "iter_0000002" / "ckpt.pt").read_bytes() == data
    assert untimed(out_dir) == untimed(saved_run[0])


@pytest.mark.slow
def test_auto_with_overwrite_is_refused_in_one_line_and_nothing_changes(saved_run, data_root, tmp_path):
    out_dir = copy_run(saved_run, tmp_path)
    before = tree(out_dir)
    proc = train_det(data_root, out_dir, *saved_run[1], "--overwrite=True", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--init_from=scratch --overwrite=True" in proc.stderr
    assert tree(out_dir) == before


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [("fsdp", "ddp"), ("ddp", "fsdp"), ("fsdp", "single")])
def test_a_run_saved_in_one_parallel_mode_resumes_in_the_other(before, after, data_root, tmp_path):
    """FSDP's sharded save resumed under DDP (or one process), a full save under FSDP: converted, said so, and the
    run ends where the uninterrupted run in the new mode does (the first steps' rounding differs between the modes:
    1e-5; the evaluations too, but for one process, which evaluates rank 0's batches only). The best save is then linked by its own format's name, and only by it."""
    args = ["--eval_interval=2", "--checkpoint_interval=1"]
    full, part = tmp_path / "full", tmp_path / "part"
    finish(command(after, full, *args, "--max_iters=4", torchrun=False), data_root)
    finish(command(before, part, *args, "--max_iters=2", torchrun=False), data_root)
    out = finish(command(after, part, *args, "--max_iters=4", torchrun=False), data_root)
    said = "an FSDP (sharded) save under" if before == "fsdp" else "a full (DDP or one-process) save under FSDP"
    assert said in out and f"resuming from {part / ckpt.CHECKPOINTS / 'iter_0000002'} at iter 2" in out
    a, b = newest_weights(part, tmp_path), newest_weights(full, tmp_path)
    assert sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    val = lambda out_dir: [r["val_loss"] for r in records(out_dir) if "val_loss" in r]
    if after != "single":  # one process evaluates rank 0's batches only, so its first evaluations differ
        assert len(val(part)) == len(val(full)) == 3 and all(abs(x - y) < 1e-5 for x, y in zip(val(part), val(full)))
    links = [name for name in ckpt.RUN_FILES if os.path.islink(part / name)]
    assert links == [next(name for name in ckpt.RUN_FILES if os.path.islink(full / name))]
    assert os.path.exists(part / links[0])


def restart_recipe():
    """(environment, torchrun flags) of docs/training.md's torchrun --max_restarts command, as written there."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "training.md")) as f:
        line = next(line for line in f if "torchrun" in line and "--max_restarts" in line and "`" not in line)
    words = line.split()
    at = words.index("torchrun")
    env = dict(word.split("=", 1) for word in words[:at])
    return env, [w for w in words[at + 1:] if w.startswith("--max_restarts")]


@pytest.mark.slow
def test_the_documented_restart_recipe_reconnects_after_a_worker_is_killed(data_root, tmp_path):
    """docs/training.md's command (its environment and --max_restarts) on a 2-process gloo job: one worker SIGKILLed
    at step 3, torchrun restarts both, and they reconnect, resume from the last save and finish the run, exit 0."""
    env, restarts = restart_recipe()
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} and restarts
    out_dir, log_file = tmp_path / "run", tmp_path / "job.log"
    cmd = command("ddp", out_dir, "--max_iters=8", "--eval_interval=4", "--checkpoint_interval=2")
    cmd[cmd.index("--standalone") + 1:cmd.index("--standalone") + 1] = restarts
    proc = start_script(*cmd[1:], data_dir=data_root, out=log_file, err=log_file, env=env)
    try:
        wait_for_line(log_file, "iter 3/", proc)
        os.kill(ranks(job(proc.pid))[1], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log_file.read_text()[-3000:]
    finally:
        kill_job(job(proc.pid) if proc.poll() is None else [])
    text = log_file.read_text()
    # the last save before the kill lands: at step 2 or 3, or (an idle machine runs a step in 10 ms) 4 or 6
    assert re.search(rf"resuming from {re.escape(str(out_dir / ckpt.CHECKPOINTS))}/iter_\d+ at iter [2-6]", text)
    assert ckpt.finished(out_dir) and text.count("done. Sample from") == 1


@pytest.mark.slow
def test_sigterm_to_a_process_blocked_in_a_collective_ends_it_within_seconds(data_root, tmp_path):
    """The other process hangs (SIGSTOP), so process 0 waits in a collective until dist_timeout (120 s here); torchrun's
    SIGTERM, which its Python handler cannot read there, still ends it within Stop.STUCK = 10 s (20 s of slack)."""
    log_file = tmp_path / "job.log"
    proc = start_job(data_root, log_file, tmp_path / "run", "--dist_timeout=120")
    pids = job(proc.pid)
    try:
        workers = ranks(pids)
        os.kill(workers[1], signal.SIGSTOP)
        time.sleep(1)  # process 0 is in the step's collective by now
        t0 = time.time()
        os.kill(workers[0], signal.SIGTERM)
        while os.path.exists(f"/proc/{workers[0]}") and open(f"/proc/{workers[0]}/stat").read().split()[2] != "Z":
            assert time.time() - t0 < 30, log_file.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        kill_job(pids)
        proc.wait()
    assert "stopped by SIGTERM without saving: the process was blocked" in log_file.read_text()


# ----------------------------------------------------------------------------------------------------------------
# what a resume cannot read: one line naming the save; what killed writers left: removed


@pytest.mark.slow
@pytest.mark.parametrize("content, phrase", [
    (b"", "is empty"),
    (b"not a torch file at all", "is unreadable"),
    ("foreign", "not a nanolatent checkpoint"),
])
def test_unusable_checkpoint_is_one_line_naming_the_file(content, phrase, run, data_root):
    path = run / ckpt.CHECKPOINTS / "iter_0000004" / "ckpt.pt"  # the newest, which a resume reads
    for folder in ckpt.saved_steps(run).values():  # every save: with an older whole one, that one would resume
        if content == "foreign":
            torch.save({"weights": torch.zeros(2)}, os.path.join(folder, "ckpt.pt"))
        else:
            with open(os.path.join(folder, "ckpt.pt"), "wb") as f:
                f.write(content)
    before = snapshot(run)
    proc = train_det(data_root, run, "--init_from=resume", check=False)
    assert_one_line_error(proc, phrase, str(path))
    assert snapshot(run) == before


def test_a_save_that_resumes_to_nan_is_named_in_the_line_that_stops_the_run(run, data_root, monkeypatch, capsys):
    """A whole save (its checksums match) whose weights hold a NaN: every step after the resume is non-finite, and the
    line that stops the run names that save, not only the learning rate."""
    folder = run / ckpt.CHECKPOINTS / "iter_0000004"
    checkpoint = torch.load(folder / "ckpt.pt", weights_only=True)
    checkpoint["model"]["blocks.0.attn.wq.weight"][0, 0] = float("nan")
    torch.save(checkpoint, folder / "ckpt.pt")
    saves.write_sums(folder, {"ckpt.pt": saves.sha256(folder / "ckpt.pt")})
    code, out, err = train_in_process(monkeypatch, capsys, data_root, run, "--init_from=resume", "--max_iters=8",
                                      "--max_nonfinite=2")
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), f"since the resume from {folder}",
                          "blocks.0.attn.wq.weight", "move it aside")


@pytest.mark.slow
def test_temporary_files_of_a_killed_writer_are_removed_by_the_next(run, data_root):
    for name in ("ckpt.pt.tmp4242", "metrics.jsonl.tmp4243", "checkpoints/iter_0000005.tmp/ckpt.pt.tmp4242",
                 "checkpoints/iter_0000002.old/ckpt.pt"):  # what kill -9 during a save or a deletion leaves
        write(run / name, "partial")
    proc = train_det(data_root, run, "--init_from=resume", "--max_iters=6")
    assert "removed 4 temporary file(s)" in proc.stdout and "resuming from" in proc.stdout
    assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoints", "ckpt.pt", "metrics.jsonl"]
    assert sorted(os.listdir(run / ckpt.CHECKPOINTS)) == ["iter_0000004", "iter_0000006"]


# ----------------------------------------------------------------------------------------------------------------
# stopping: Ctrl-C, SIGTERM, a full disk (simulated by a sitecustomize.py the subprocess imports)


def run_with(sitecustomize, tmp_path, *args, data_root):
    """train.py on the tiny det model, with a sitecustomize.py (a fault to inject) imported at interpreter start."""
    write(tmp_path / "hook" / "sitecustomize.py", sitecustomize)
    env = {**os.environ, "NANOLATENT_DATA": str(data_root), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(tmp_path / "hook")}
    return subprocess.run([sys.executable, "train.py", "--model_type=det", *TINY, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def assert_checkpoint_at(folder, iter_num):
    """The newest checkpoint, which a resume reads, loads into its model at the expected step; no temporary file
    is left in the run's folder."""
    saved = ckpt.saved_steps(folder)
    path = os.path.join(saved[max(saved)], "ckpt.pt")
    checkpoint = torch.load(path, weights_only=True)
    assert max(saved) == checkpoint["iter_num"] == iter_num
    ckpt.load_model(path, checkpoint=checkpoint)
    assert not [f for _, _, files in os.walk(folder) for f in files if ".tmp" in f]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_the_current_step_and_says_how_to_resume(signum, data_root, tmp_path):
    out, err = tmp_path.with_name(f"{tmp_path.name}.out"), tmp_path.with_name(f"{tmp_path.name}.err")
    proc = start_script("train.py", "--model_type=det", *TINY, f"--out_dir={tmp_path}", "--max_iters=100000",
                        "--eval_interval=100000", data_dir=data_root, out=out, err=err)
    wait_for_line(out, "iter 5/", proc)
    proc.send_signal(signum)
    proc.wait(timeout=300)
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 128 + signum, (stdout[-500:], stderr)
    logged = max(r["iter"] for r in records(tmp_path) if "loss" in r)  # a record per step (log_interval=1)
    assert stderr.strip().splitlines() == [f"stopped by {signum.name}: {tmp_path / ckpt.CHECKPOINTS} holds iter "
                                           f"{logged + 1}; continue with the same command and --init_from=auto (or "
                                           f"resume)"]
    assert_checkpoint_at(tmp_path, logged + 1)  # every step done is saved: the last logged one included
    proc = train_det(data_root, tmp_path, "--init_from=resume", f"--max_iters={logged + 2}")
    assert max(r["iter"] for r in records(tmp_path) if "loss" in r) == logged + 1  # it goes on from there


SIGINT_DURING_SAVE = """
import os, signal, torch
_save = torch.save
def save(obj, f, *args, **kwargs):  # Ctrl-C while the first checkpoint is being written
    if not save.calls:
        os.kill(os.getpid(), signal.SIGINT)
    save.calls += 1
    return _save(obj, f, *args, **kwargs)
save.calls = 0
torch.save = save
"""


FULL_DISK = """
import torch
_save, calls = torch.save, []
def save(obj, f, *args, **kwargs):  # the second save meets a full disk: a partial file, then torch's own error
    calls.append(f)
    if len(calls) == 2:
        open(f, "wb").write(b"PK partial")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0\\n"
                           "PytorchStreamWriter failed writing file data/0: file write failed")
    return _save(obj, f, *args, **kwargs)
torch.save = save
"""


FULL_DISK_LOG = """
import errno, os
_replace = os.replace
def replace(src, dst):  # the log rewrite at a resume meets a full disk
    if str(dst).endswith("metrics.jsonl"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
    return _replace(src, dst)
os.replace = replace
"""


@pytest.mark.slow
def test_ctrl_c_during_a_checkpoint_write_finishes_it_then_stops(data_root, tmp_path):
    proc = run_with(SIGINT_DURING_SAVE, tmp_path, f"--out_dir={tmp_path / 'run'}", "--max_iters=8",
                    "--eval_interval=2", data_root=data_root)
    assert proc.returncode == 130 and "holds iter 1;" in proc.stderr, proc.stderr  # saved at 0, stopped after 1
    assert_checkpoint_at(tmp_path / "run", 1)


@pytest.mark.slow
def test_a_full_disk_at_a_save_keeps_the_previous_checkpoint(data_root, tmp_path):
    proc = run_with(FULL_DISK, tmp_path, f"--out_dir={tmp_path / 'run'}", "--max_iters=8", "--eval_interval=2",
                    "--always_save_checkpoint=True", data_root=data_root)
    assert_one_line_error(proc, f"could not write {tmp_path / 'run' / ckpt.CHECKPOINTS / 'iter_0000002.tmp'}/ckpt.pt: "
                          "PytorchStreamWriter failed writing file data/0: file write failed", "MiB free on that disk",
                          "is unchanged")
    assert_checkpoint_at(tmp_path / "run", 0)  # the first save, at the first evaluation


@pytest.mark.slow
def test_a_full_disk_at_a_resume_changes_nothing(run, data_root, tmp_path):
    before = snapshot(run)
    proc = run_with(FULL_DISK_LOG, tmp_path, f"--out_dir={run}", "--init_from=resume", "--max_iters=6",
                    data_root=data_root)
    assert_one_line_error(proc, f"could not write {run / 'metrics.jsonl'}: No space left on device")
    assert snapshot(run) == before and not [p.name for p in run.iterdir() if ".tmp" in p.name]
