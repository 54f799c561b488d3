"""GRPO with B-Trans minds as the rollout population (Yang & Zhang, "Many Minds from One Model", §5.2), and label-free
test-time RL with a majority-vote reward (§5.3), at CPU scale:

    python prepare.py arith && python train.py config/det_arith.py      # the supervised phase: a tiny det model
    python -m scripts.rlvr config/rlvr_arith.py                                 # GRPO, each rollout of a group its own mind
    python -m scripts.rlvr config/rlvr_arith.py --rollout=temperature           # the det baseline: token sampling alone
    python -m scripts.rlvr config/rlvr_arith.py --rollout=token                 # §6.1 ablation: a fresh eps at every step
    python -m scripts.rlvr config/rlvr_arith.py --reward=ttrl --train_prompts=eval   # §5.3 TTRL: no labels read
    python -m scripts.rlvr config/rlvr_synthetic.py                             # the letters task (Free Transformer §4.1)
    python -m experiments.rlvr_compare                                  # temperature vs minds vs token, 3 seeds
    python -m scripts.rlvr config/rlvr_smollm2.py                               # a pretrained chat model (SmolLM2)
    python -m scripts.rlvr config/rlvr_smollm2.py --init_from=resume            # go on after Ctrl-C, SIGTERM or a crash

Ctrl-C or SIGTERM lets the current step finish, saves it and says how to continue: the same command with
--init_from=resume, which goes on from the saved step as if never stopped (the same prompts, rollouts and updates:
every draw derives from (seed, step)). A second signal stops at once; the last checkpoint stays as it is.

A det checkpoint is wrapped plug-and-play into B-Trans (§6.2: mu = 0, so the mean model is the det model). Every
step draws prompts_per_step prompts and group_size rollouts of each, scores them (a verifier, or agreement with the
group's majority answer), normalises the rewards within each group and takes updates_per_batch AdamW steps on the
clipped policy-gradient objective of GRPO (Shao et al. 2024, DeepSeekMath Eq. 3), optionally with a KL to the initial
model. As in the paper (§5), noise is injected only while rolling out: the update, and the held-out evaluation, use
the deterministic mean model. The paper fine-tunes LoRA adapters; at this scale every weight is trained.
"""

import copy
import os
import signal
import sys
import time
from types import SimpleNamespace

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch

from nanolatent import ckpt, common, cpu, grpo, lock, metrics, models, records, speedups, tasks, tokendata

# ----------------------------------------------------------------------------------------------------------------
# defaults: GRPO with minds on the arithmetic task, from config/det_arith.py's checkpoint
# I/O
out_dir = "out-rlvr"
overwrite = False  # an out_dir that holds a run (a trained model, an earlier scripts/rlvr.py run) is replaced only when True
init_from = "out-det-arith"  # a checkpoint (folder or ckpt.pt), det or btrans; det is wrapped into B-Trans; or
# 'resume' to continue the scripts/rlvr.py run in out_dir (stopped by Ctrl-C, SIGTERM or a crash) with the same command
log_interval = 1
eval_interval = 25  # held-out evaluation (and a checkpoint) every eval_interval steps and after the last
# task
task = "arith"  # 'arith' (python prepare.py arith), 'letters' (python prepare.py synthetic), or for a chat model
# 'gsm8k' (GSM8K, answer after "####") or 'hellaswag' (lettered multiple choice, tasks.lettered_question)
dataset = ""  # '' = the task's: arith, synthetic, gsm8k, hellaswag; a chat task's can be a local path (chat_problems)
max_calc_steps = 0  # gsm8k: only problems whose reference solution takes at most this many calculator steps (0: all)
train_prompts = "train"  # RL prompts: 'train' split, 'val' (val problems past the eval ones), 'eval' (TTRL only)
eval_prompts = 200  # held-out evaluation on the first eval_prompts problems of the val split (GSM8K's: test)
select_prompts = 0  # a second held-out set, the next select_prompts val problems, evaluated with the first: a step
#                     (or a sigma, a temperature) is chosen on it and read on the first (0: none)
eval_samples = 8  # samples per held-out prompt: pass@1 and pass@eval_samples (unbiased, metrics.pass_at_k)
eval_temperature = 1.0
max_new_tokens = 0  # 0 = the task's: 8 for arith (6 digits and '\n'), 64 for letters, 256 gsm8k, 1 hellaswag
# rollouts
rollout = "minds"  # 'temperature' (det baseline), 'minds' (one eps per rollout, §4.3), 'token' (fresh eps, §6.1)
temperature = 1.0  # token sampling temperature of the rollouts, every mode (0 = greedy: then only minds explore)
reward = "verifier"  # 'verifier' (the task's answer check) or 'ttrl' (agreement with the group majority, no labels)
group_size = 8  # G rollouts per prompt
prompts_per_step = 8
# GRPO and AdamW
max_steps = 100  # 0: evaluate the starting model and stop (nothing saved)
learning_rate = 1e-5  # AdamW; 3e-5 already degraded the tiny det_arith model (config/rlvr_arith.py)
updates_per_batch = 1  # optimizer steps per batch of rollouts (GRPO's mu); 1: the ratio is 1, the clip never acts
update_batch = 0  # rollouts per forward/backward of an update, gradients summed over the batch (0: all at once).
# An update's memory grows with it: GRPO from SmolLM2-135M on GSM8K, 16 rollouts of 256 new tokens, peaked at
# 15.8 GiB resident all at once (float32 activations of 30 layers, 49,152-token logits) and 6.8 GiB 4 at a time
clip_eps = 0.2  # PPO's ratio clip
kl_coef = 0.0  # beta of the KL to the initial model (0: logged, not optimised)
adv_eps = 1e-4  # (r - mean) / (std + adv_eps): TRL's GRPO value
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0  # 0 disables clipping
# system
device = "cuda" if torch.cuda.is_available() else "cpu"
seed = 1337
kernels = "fast"  # 'plain': the model file's own modules, no speed-up applied from outside (docs/models.md)
# ----------------------------------------------------------------------------------------------------------------
NOISE_MODE = {"temperature": "mean", "minds": "sequence", "token": "token"}  # rollout -> model_btrans noise_mode
PROMPTS, ROLLOUT_TOKENS, ROLLOUT_LATENTS, ROLLOUT_NOISE = range(4)  # the streams seeded() draws from


@torch.no_grad()
def evaluate_heldout(model, prompts, encode, decode, verify, k, temperature, max_new_tokens, seed, stop_id,
                     rollout_temperature=None):
    """The mean model (the one the updates train) on held-out prompts: greedy accuracy (and each prompt's 0/1, for a
    bootstrap over prompts), pass@1 and pass@k of k samples at `temperature`; with rollout_temperature, also the
    share of k rollouts drawn as GRPO draws them (the run's noise_mode, at that temperature) that are right: what a
    rule setting sigma or the temperature reads (experiments/rlvr_compare.py)."""
    device = model.tok_emb.weight.device
    ids = [encode(p) for p in prompts]
    generator = torch.Generator(device).manual_seed(seed)
    with cpu.inference_linears(model):  # on a CPU, the weights laid out for decoding
        with grpo.noise_mode(model, "mean"):
            greedy, _ = grpo.rollouts(model, ids, 1, max_new_tokens, 0.0, generator, generator)
            sampled, _ = grpo.rollouts(model, ids, k, max_new_tokens, temperature, generator, generator)
        if rollout_temperature is not None:  # the latents from their own stream, as in grpo_step
            drawn, _ = grpo.rollouts(model, ids, k, max_new_tokens, rollout_temperature, generator,
                                     torch.Generator(device).manual_seed(seed + 1))
    right = lambda completions, n: np.array([verify(p, t) for p, t in zip(np.repeat(prompts, n),
                                                                         grpo.replies(completions, decode, stop_id))])
    greedy_ok, correct = right(greedy, 1), right(sampled, k).reshape(len(prompts), k).sum(1)
    evals = {"greedy": float(np.mean(greedy_ok)),
             "pass@1": float(np.mean([metrics.pass_at_k(k, int(c), 1) for c in correct])),
             f"pass@{k}": float(np.mean([metrics.pass_at_k(k, int(c), k) for c in correct]))}
    if rollout_temperature is not None:
        evals["rollout_pass@1"] = float(np.mean(right(drawn, k)))
    return evals, [int(ok) for ok in greedy_ok]


# ----------------------------------------------------------------------------------------------------------------
# the script


def grpo_step(model, ref, optimizer, spec, pool, step, encode, decode, stop_id, max_new):
    """One GRPO step: prompts_per_step prompts drawn from pool, group_size rollouts of each, their rewards (the
    verifier, or agreement with the group's majority for TTRL), group-normalised advantages, updates_per_batch
    AdamW steps. Every draw derives from (seed, stream, step). -> the step's log record"""
    t0 = time.time()
    rng = common.seeded(seed, PROMPTS, step)
    prompts = [pool[i] for i in rng.choice(len(pool), prompts_per_step, replace=False)]
    prompt_ids = [encode(p) for p in prompts]
    torch.manual_seed(common.seed_of(seed, ROLLOUT_NOISE, step))  # 'token' mode draws its eps from the global RNG
    # On a CPU the rollouts decode through the weights laid out for it (cpu.inference_linears), anew each step: the
    # updates change them
    with cpu.inference_linears(model):
        completions, _ = grpo.rollouts(model, prompt_ids, group_size, max_new, temperature,
                                       torch.Generator(device).manual_seed(common.seed_of(seed, ROLLOUT_TOKENS, step)),
                                       torch.Generator(device).manual_seed(common.seed_of(seed, ROLLOUT_LATENTS, step)))
    texts = grpo.replies(completions, decode, stop_id)
    group_prompts = [p for p in prompts for _ in range(group_size)]
    correct = np.array([spec.verify(p, t) for p, t in zip(group_prompts, texts)], dtype=float)  # ttrl: logged only
    answers = [spec.answer(t) for t in texts]
    groups = [answers[i:i + group_size] for i in range(0, len(answers), group_size)]
    rewards = correct if reward == "verifier" else np.array([r for g in groups for r in grpo.ttrl_rewards(g)])
    rewards = torch.tensor(rewards, dtype=torch.float32, device=device).view(-1, group_size)  # (P, G)
    advantages = grpo.group_advantages(rewards, adv_eps)  # (P, G)
    stats = grpo.grpo_update(model, ref, optimizer, [ids for ids in prompt_ids for _ in range(group_size)], completions,
                             grpo.completion_mask(completions, stop_id), advantages.flatten(), updates_per_batch, clip_eps,
                             kl_coef, grad_clip, update_batch)
    return {"iter": step, "reward": rewards.mean().item(), "pass_rate": correct.mean(),
            "adv_std": advantages.std().item(), **stats,
            "informative": (rewards.std(1) > 0).float().mean().item(),  # groups with a learning signal
            "distinct": float(np.mean([len(set(g)) for g in groups])),  # answers per group, None one of them
            "step_s": time.time() - t0}


def main():
    if "RANK" in os.environ:
        common.die("scripts/rlvr.py runs in one process (RANK is set, as under torchrun): run it with plain python")
    # the model is always B-Trans: sigma etc. are its Config fields
    config, overrides = configurator.apply(globals(), model_fields=lambda values: models.config_fields("btrans"))
    configurator.require(config, positive=("log_interval", "eval_interval", "eval_prompts", "eval_samples",
                                           "prompts_per_step", "updates_per_batch", "adv_eps"),
                         non_negative=("max_steps", "select_prompts", "max_new_tokens", "max_calc_steps",
                                       "update_batch", "temperature", "eval_temperature", "learning_rate", "kl_coef",
                                       "clip_eps", "grad_clip", "weight_decay", "seed"),
                         choices={"task": tuple(tasks.TASKS), "rollout": tuple(NOISE_MODE),
                                  "reward": ("verifier", "ttrl"), "train_prompts": ("train", "val", "eval"),
                                  "kernels": speedups.KERNELS},
                         within={"beta1": "[0, 1)", "beta2": "[0, 1)"})
    common.check_device(device)
    speedups.use(kernels)
    if "noise_mode" in overrides:
        common.die("the rollout mode sets the B-Trans noise_mode: use --rollout=temperature|minds|token")
    if group_size < 2:
        common.die("group_size must be >= 2: GRPO's advantages are relative to the rest of the group")
    if max_calc_steps and task != "gsm8k":
        common.die(f"max_calc_steps keeps GSM8K problems by their calculator steps: only with task=gsm8k, not {task}")
    if train_prompts == "eval" and reward != "ttrl":
        common.die("train_prompts=eval trains on the held-out problems: only with reward=ttrl, which reads no label")
    spec = tasks.TASKS[task]
    data = dataset or spec.dataset
    # recorded in the checkpoint, where evaluate.py looks for a prepared dataset: a chat task's jsonl is none
    config["dataset"], config["chat_dataset"] = ("", data) if spec.chat else (data, "")
    max_new = max_new_tokens or spec.max_new_tokens
    lock.lock_out_dir(out_dir, "scripts/rlvr.py")
    ckpt_file = os.path.join(out_dir, "ckpt.pt")
    resume = init_from == "resume"
    rlvr_run = lambda: "ref_model" in ckpt.load_checkpoint(ckpt_file)  # memory-mapped: asking costs little
    if resume and not os.path.exists(ckpt_file):
        common.die(f"init_from=resume continues the scripts/rlvr.py run in {out_dir}, and {ckpt_file} does not exist: start "
                   f"one with --init_from=<a trained model>")
    if resume and not rlvr_run():
        common.die(f"init_from=resume continues a scripts/rlvr.py run, and {ckpt_file} is a train.py or scripts/convert.py "
                   f"checkpoint: give it as --init_from={out_dir} with another --out_dir")
    if not resume:
        ckpt.refuse_existing_run(out_dir, overwrite,
                                 resumable=not overwrite and os.path.exists(ckpt_file) and rlvr_run())
    source = ckpt_file if resume else init_from

    # the policy: the checkpoint as B-Trans, noise_mode set by the rollout mode; a frozen copy of the starting model
    # as the KL reference, which a resumed run reads back from its checkpoint
    model, checkpoint = ckpt.load_model(source, device, "btrans", **overrides, noise_mode=NOISE_MODE[rollout])
    checkpoint.pop("model")  # the model holds the weights now: unmap the checkpoint's pages
    model.eval()  # config.noise_mode alone decides the noise, switched here: rollout's mode, then 'mean' to update (§5)
    meta = checkpoint["meta"] if spec.chat else tokendata.load_meta(data)  # a chat task: the model's own tokenizer
    if (checkpoint["meta"]["tokenizer"], checkpoint["meta"].get("chars")) != (meta["tokenizer"], meta.get("chars")):
        common.die(f"{source} was trained with another tokenizer or vocabulary than dataset {data!r}")
    ref = copy.deepcopy(model).requires_grad_(False)  # kept even at kl_coef = 0: the KL is logged as the drift
    ref.config.noise_mode = "mean"
    if resume:
        ref.load_state_dict(checkpoint.pop("ref_model"))
        config["init_from"] = checkpoint["config"]["init_from"]  # the run's starting model, not 'resume'
    if spec.chat and tokendata.chat_template(meta) is None:
        common.die(f"task={task} prompts a chat model in its chat template, and {source} has none: import an "
                   f"Instruct model with scripts/convert.py gguf or hf (README, B-Trans minds on a pretrained model)")
    encode, decode = tokendata.tokenizer(meta)
    # a reply ends at the chat turn's end, a problem at '\n'
    stop_id = tokendata.turn_end(meta, encode) if spec.chat else encode("\n")[0]
    if stop_id is None:
        common.die(f"task={task} needs a chat model whose tokenizer_config.json names its end of turn as one token "
                   f"(eos_token: <|im_end|>, <|eot_id|>); {source}'s does not")
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
    start = checkpoint["iter_num"] if resume else 0
    if resume:
        optimizer.load_state_dict(checkpoint["optimizer"])  # AdamW's moments are the run's, its settings this command's
        changed = [f"{key}={config[key]!r} (was {checkpoint['config'][key]!r})" for key in
                   ("learning_rate", "weight_decay", "beta1", "beta2") if config[key] != checkpoint["config"][key]]
        for group in optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2))
        optimizer.param_groups[0]["weight_decay"] = weight_decay  # configure_optimizers: the matrices; norms: none
        if changed:
            print(f"resuming with {', '.join(changed)}")
        if start > max_steps:
            common.die(f"{ckpt_file} is at step {start}, past --max_steps={max_steps}: give a larger --max_steps")

    # Prompts. Held-out: the first eval_prompts val problems, and the next select_prompts to choose on. RL: the train
    # split (the supervised phase's problems, which GRPO sharpens, as SimpleRL-Zoo's prompts come from its training
    # distribution), or the val problems past the held-out ones, or for TTRL (§5.3) the held-out problems themselves:
    # test-time training reads no label.
    load, verify = tasks.chat_task(task, data, meta, max_calc_steps) if spec.chat else (
        lambda split: tasks.load_prompts(task, data, split, meta), spec.verify)
    spec = SimpleNamespace(**{**vars(spec), "verify": verify})
    val = load("val")
    eval_set, select_set = val[:eval_prompts], val[eval_prompts:eval_prompts + select_prompts]
    pool = {"train": lambda: load("train"), "val": lambda: val[eval_prompts + select_prompts:],
            "eval": lambda: eval_set}[train_prompts]()
    if len(select_set) < select_prompts:
        common.die(f"{len(val)} val problems in {data}: too few for eval_prompts={eval_prompts} and "
                   f"select_prompts={select_prompts} (prepare more, or lower them)")
    if len(pool) < prompts_per_step or not eval_set:
        common.die(f"{len(pool)} RL prompts and {len(eval_set)} held-out prompts in {data}: too few for "
                   f"prompts_per_step={prompts_per_step} (prepare more, or lower eval_prompts)")
    print(f"rlvr: {task} from {config['init_from']} as B-Trans (sigma={model.config.sigma}), rollout={rollout}, "
          f"reward={reward}; {prompts_per_step} prompts x {group_size} rollouts per step from "
          f"{len(pool):,} {train_prompts} prompts; held-out: {len(eval_set)} val prompts"
          + (f", {len(select_set)} more to select on" if select_set else "")
          + (f"; resuming at step {start}" if resume else ""))
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    records.keep_records(metrics_path, before_iter=start)  # a resumed run logs its steps again from `start` on
    stop = common.Stop()  # Ctrl-C and SIGTERM from here on: the current step finishes, is saved, and the run stops
    saved = start if resume else None  # the step the checkpoint in out_dir holds

    def save(step):
        """train.py's format (RL has no validation loss, so a train.py resume saves at its first eval), and the KL
        reference: a resumed run needs the starting model, which init_from may no longer hold."""
        nonlocal saved
        ckpt.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                              "ref_model": ref.state_dict(), "model_type": "btrans",
                              "model_config": models.config_dict(model.config), "config": config, "meta": meta,
                              "iter_num": step, "best_val_loss": float("inf")}, ckpt_file)
        saved = step

    def save_and_stop(step):
        """After a signal, between two steps: the weights and AdamW state of `step` whole steps, saved (unless they
        are already), and one line on how to go on; exit code 128 + the signal's number, as a shell reports it."""
        if step > 0 and saved != step:
            save(step)
        what = (f"{ckpt_file} holds step {step}; continue with the same command and --init_from=resume"
                if saved is not None else "no step was done and nothing was written; run the same command to start "
                                          "again")
        print(f"stopped by {signal.Signals(stop.signum).name}: {what}", file=sys.stderr)
        stop.exit(128 + stop.signum)

    for step in range(start, max_steps + 1):
        if stop:
            save_and_stop(step)
        if step % eval_interval == 0 or step == max_steps:
            evals, greedy_ok = evaluate_heldout(model, eval_set, encode, decode, spec.verify, eval_samples,
                                                eval_temperature, max_new, seed, stop_id)
            line = f"step {step}/{max_steps}: held-out " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items())
            record = {"iter": step, **{f"eval_{k}": v for k, v in evals.items()}, "eval_greedy_correct": greedy_ok}
            if select_set:  # the same seed: the two sets' draws differ only by their problems
                chosen, _ = evaluate_heldout(model, select_set, encode, decode, spec.verify, eval_samples,
                                             eval_temperature, max_new, seed, stop_id, rollout_temperature=temperature)
                line += "; selection set " + ", ".join(f"{k} {v:.4f}" for k, v in chosen.items())
                record.update({f"select_{k}": v for k, v in chosen.items()})
            print(line)
            records.append_record(metrics_path, record)
            if step > 0 and saved != step:
                save(step)
            if stop and step < max_steps:  # before a GRPO step, which can take minutes (after the last: done)
                save_and_stop(step)
        if step == max_steps:
            break
        record = grpo_step(model, ref, optimizer, spec, pool, step, encode, decode, stop_id, max_new)
        if step % log_interval == 0:
            print(f"step {step}/{max_steps}: reward {record['reward']:.3f}, pass {record['pass_rate']:.3f}, adv_std "
                  f"{record['adv_std']:.3f}, loss {record['loss']:.4f}, kl {record['kl']:.5f}, informative "
                  f"{record['informative']:.2f}, distinct {record['distinct']:.2f}, {record['step_s'] * 1000:.0f} ms")
            records.append_record(metrics_path, record)
    print(f"saved {ckpt_file}" if max_steps else f"evaluated {config['init_from']}; {metrics_path} holds it")


if __name__ == "__main__":
    main()
