"""Run records: metrics.jsonl, one JSON line per evaluation or log step, appended, read, and cut back on resume; and
the lines train.py prints (its first, each step's and evaluation's, its last)."""

import json
import os
import sys

from nanolatent.common import die, free_space, replacing


def append_record(path, record):
    """One JSON object per line (out_dir/metrics.jsonl): what scripts/plot.py reads. A full disk is one line; a partial line
    it may leave is dropped with a warning by the next reader."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        die(f"could not append to {path}: {e.strerror or e}{free_space(path)}; free some space or choose another "
            f"out_dir (the checkpoint there, if any, is unchanged)")


def read_records(path):
    """The records of a metrics.jsonl. A partial last line (a crash mid-append) is dropped with a warning, so a log
    never blocks a run or a plot; a broken line before the last is an error naming it."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines):
                die(f"{path} line {i} is not JSON: fix or delete that line")
            print(f"warning: {path} ends in a partial line (a crash mid-write?); it is ignored", file=sys.stderr)
    return records


def refuse_earlier_records(path, overwrite):
    """A run started afresh where metrics.jsonl holds an earlier run's records (its checkpoints deleted) replaces
    them only with --overwrite=True; otherwise one line, and they stay as they are."""
    held = read_records(path) if os.path.exists(path) else []
    if held and not overwrite:
        iters = [r["iter"] for r in held if "iter" in r] or [0]
        die(f"{path} holds {len(held)} records of an earlier run (iters {min(iters)} to {max(iters)}), but "
            f"{os.path.dirname(path) or '.'} holds no checkpoint to resume: choose another --out_dir, or replace those "
            f"records with --overwrite=True")


def keep_records(path, before_iter):
    """Rewrite metrics.jsonl with only the records of iterations before `before_iter` (0: none), atomically."""
    kept = [r for r in read_records(path) if r.get("iter", 0) < before_iter] if os.path.exists(path) else []
    try:
        with replacing(path) as tmp, open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
    except OSError as e:  # a full disk or a read-only folder: the log stays as it was
        die(f"could not write {path}: {e.strerror or e}{free_space(path)}; free some space or choose another out_dir "
            f"(the run there is unchanged)")


def duration(seconds):
    """h:mm:ss, or m:ss under an hour: a training log line's elapsed time and ETA."""
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}" if minutes >= 60 else f"{minutes}:{s:02d}"


def fit_line(head, optional, tail, width=120):
    """head, the optional parts and tail joined, dropping from the end of the optional ones until it fits `width`."""
    while optional and len(" ".join([head, *optional, tail])) > width:
        optional = optional[:-1]
    return " ".join([head, *optional, tail])


def step_line(record, stats, seconds, max_iters, elapsed, eta):
    """A training step's line from its record: the loss and the model's stats (as many as fit), the step's time and
    speed, skipped steps, the run's elapsed time and ETA."""
    speed = f"| {seconds * 1000:.0f} ms, {record['tokens_per_s']:,.0f} tok/s"
    speed += (f", mfu {record['mfu']:.1%}" if record["mfu"] else "") + (
        f", peak {record['peak_mib']:,.0f} MiB" if "peak_mib" in record else "")
    skipped = f", skipped {record['nonfinite']}" if record["nonfinite"] else ""
    return fit_line(f"iter {record['iter']}/{max_iters}: loss {record['loss']:.4f}",
                    [f"{k} {record[k]:.4f}" for k in stats], f"{speed}{skipped} | {duration(elapsed)} elapsed, ETA "
                    f"{duration(eta)}")


def eval_line(evals, iter_num, max_iters):
    """An evaluation's line: the losses that fit (every value is in metrics.jsonl)."""
    shown = [f"{k} {evals[k]:.4f}" for k in ("train_loss", "val_loss", "val_ce_prior", "val_kl") if k in evals]
    return fit_line(f"iter {iter_num}/{max_iters} eval:", shown, "(all in metrics.jsonl)")


def run_line(model_type, model, tokens_per_iter, world_size, device, threads):
    """train.py's first line: the model's size and the step's tokens, where."""
    return (f"{model_type} model: {model.num_params() / 1e6:.2f}M parameters, {model.flops_per_token() / 1e6:.1f} "
            f"MFLOPs per token; {tokens_per_iter:,} tokens per iteration on {world_size} process(es), {device}"
            + (f" ({threads} thread{'s' if threads > 1 else ''}; OMP_NUM_THREADS=N sets it)" if threads else ""))


def done_lines(out_dir, dataset, model_type):
    """train.py's last lines: what to do with the run next. A stochastic model also samples with one draw of the
    latents for the whole group: what they carry shows as what the group shares."""
    start = ' --start="K>"' if dataset == "synthetic" else ""  # the synthetic task's prompt: a letter and '>'
    lines = [f"done. Sample from {out_dir}:", f"  python sample.py --out_dir={out_dir}{start} --num_samples=8"]
    if model_type != "det":
        lines.append(f"  python sample.py --out_dir={out_dir}{start} --num_samples=8 --latents=shared --latent_seed=1")
    return "\n".join(lines)
