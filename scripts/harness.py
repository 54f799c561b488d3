"""EleutherAI's lm-evaluation-harness on nanolatent runs: the `nanolatent` model scores a run of any of the four
models, the stochastic ones with Monte Carlo latents exactly as evaluate.py does.

    python -m scripts.harness --model nanolatent --model_args out_dir=out-eve,mc_samples=8 --tasks my_mc \
        --include_path my_tasks/        # my_tasks/my_mc.yaml: the local task of docs/evaluation.md
    python -m scripts.harness --model nanolatent --model_args out_dir=out-det,model_type=btrans,sigma=0.05 --tasks ...  # minds

`python -m scripts.harness ARGS` is `lm_eval ARGS` with nanolatent registered (lm_eval 0.4 finds its own models only, no
plugins; every flag and every other model works as with `lm_eval`). From Python, `import scripts.harness` registers it:
lm_eval.simple_evaluate(model="nanolatent", model_args={"out_dir": "out-eve"}, ...).

model_args: out_dir (the run), model_type ('' or a type to load it into, with its Config overrides, e.g. sigma), mc_samples
(M passes), mixture (auto | token | sequence, evaluate.py's --mixture), seed, dtype (float32 | bfloat16 | float16),
max_gen_toks, kernels (fast | plain, as evaluate.py's --kernels); --device and --batch_size come from lm_eval's flags.

- loglikelihood: the requests of one document (its choices) are scored together by multiple_choice.score_choices,
  tokenized by multiple_choice.choice_tokens, with M passes whose latents the choices share, drawn from
  multiple_choice.example_generator(seed, doc_id): the draws evaluate.py --task=mc gives its example doc_id, so the
  two agree item by item. A document's draws depend on nothing else, so the results do not depend on the batch size,
  on --limit or on the other tasks. One document per forward, whatever --batch_size: its choices read their shared
  context from one KV cache, where documents batched together would each be padded to the longest. On a CPU the
  weights are packed for oneDNN once, for the whole run (cpu.inference_linears, as evaluate.py). is_greedy (the acc of
  loglikelihood tasks such as LAMBADA, one request per document) is computed for documents of one request, under the
  token mixture p̄; multiple-choice documents, whose metrics never read it, report False. A sequence longer than
  block_size + 1 tokens is left-truncated and a continuation longer than block_size scored on its last block_size
  tokens, as evaluate.py does (lm_eval's hf model stops the run with an AssertionError there); the count is logged.
- loglikelihood_rolling: lm_eval's rolling windows of block_size tokens, all windows of a document in one
  score_choices call (one draw of latents per pass for the whole document), summed.
- generate_until: one request at a time, latents fixed per request from (seed, doc_id, idx, repeat): a B-Trans mind,
  EVE noise, the Free Transformer's Z from its encoder on the prompt (sample_latents(prompt=...)), so the repeats of
  a pass@k task are different minds; greedy unless the task asks do_sample (then tokens are drawn from the same
  generator); max_gen_toks tokens (at most block_size - 1), the context left-truncated to make room, as hf does, and
  the text cut at the first stop string.
"""

import contextlib
import sys
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F

from nanolatent import ckpt, common, cpu, hf_format, models, multiple_choice, speedups, tokendata

try:
    # lm_eval's own models are registered lazily, by importing lm_eval.models, and get_model() imports it only into
    # an empty registry: import it before registering ours, or `--model hf` would be unknown in this process.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:
    if __name__ == "__main__" and {"--help", "-h"} & set(sys.argv[1:]):  # what it is, and how to get its flags
        print(f"{__doc__.strip()}\n\nlm-evaluation-harness is not installed ({e}), and every flag but the model is "
              f"its own: pip install \"lm_eval[hf]\", then python -m scripts.harness --help lists them")
        raise SystemExit(0)
    common.die(f"scripts/harness.py needs lm-evaluation-harness ({e}): pip install \"lm_eval[hf]\"")


def model_arg(key, value, default, at_least=None, choices=None):
    """One of --model_args, checked as the scripts check their values: of its default's type (lm_eval passes numbers
    and true/false typed, anything else as text; Python callers any object), in its range, one line if not."""
    if type(default) is float and type(value) is int:
        value = float(value)
    if type(default) is tuple and type(value) is list:
        value = tuple(value)
    if type(default) is int and type(value) is float and value.is_integer():  # lm_eval reads "-1" as -1.0
        value = int(value)
    if default is not None and type(value) is not type(default):
        common.die(f"--model_args {key}={value!r}: {key} must be a{'n' if type(default) is int else ''} "
                   f"{type(default).__name__} (default {default!r})")
    if at_least is not None and not value >= at_least:
        common.die(f"--model_args {key}={value!r}: {key} must be >= {at_least}")
    if choices is not None and value not in choices:
        common.die(f"--model_args {key}={value!r}: {key} must be one of {', '.join(choices)}")
    return value


@register_model("nanolatent")
class NanoLatentLM(LM):
    def __init__(self, out_dir="", model_type="", mc_samples=8, mixture="auto", seed=1337, dtype="float32", device=None,
                 batch_size=1, max_batch_size=None, max_gen_toks=256, kernels="fast", **overrides):
        super().__init__()
        # every value before anything loads: a typo costs one line, not a checkpoint read and a traceback
        if not out_dir:
            common.die("--model_args needs out_dir=RUN, the run to evaluate (its folder or a ckpt.pt): "
                       "--model_args out_dir=out-eve,mc_samples=8")
        out_dir = model_arg("out_dir", str(out_dir) if type(out_dir) is int else out_dir, "")  # a folder "123"
        model_type = model_arg("model_type", model_type, "", choices=("", *models.MODEL_TYPES))
        mc_samples = model_arg("mc_samples", mc_samples, 8, at_least=1)
        mixture = model_arg("mixture", mixture, "auto", choices=("auto", "token", "sequence"))
        seed = model_arg("seed", seed, 1337, at_least=0)
        dtype = model_arg("dtype", dtype, "float32", choices=tuple(common.DTYPES))
        max_gen_toks = model_arg("max_gen_toks", max_gen_toks, 256, at_least=1)
        speedups.use(model_arg("kernels", kernels, "fast", choices=speedups.KERNELS))
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        common.check_device(device)
        checkpoint = ckpt.load_checkpoint(out_dir)
        fields = models.config_fields(model_type or checkpoint["model_type"])
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            common.die(f"model_args {', '.join(unknown)}: not an argument of nanolatent nor a Config field of the "
                       f"{model_type or checkpoint['model_type']} model")
        overrides = {k: model_arg(k, v, fields[k]) for k, v in overrides.items()}
        self.model, _ = ckpt.load_model(out_dir, device, model_type or None, checkpoint=checkpoint, **overrides)
        self.model.eval()
        self._device = torch.device(device)
        _, self.autocast = common.autocast(device, dtype)
        self.encode, self.decode = tokendata.tokenizer(checkpoint["meta"])
        self.passes = 1 if self.model.latent_kind == "none" else mc_samples
        self.mixture = multiple_choice.mixture_for(self.model, mixture)
        self.seed, self.max_gen_toks = seed, max_gen_toks
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1  # accepted; one document a forward
        # the products through oneDNN's packed weights for every request of the run, packed once (a no-op off a CPU)
        self.packed = contextlib.ExitStack()
        self.packed.enter_context(cpu.inference_linears(self.model, common.DTYPES[dtype]))
        self.eot = eot_token(checkpoint)
        self.block_size = self.model.config.block_size

    @property
    def eot_token_id(self):
        return self.eot

    def draws(self, *key):
        return torch.Generator(self._device).manual_seed(common.seed_of(self.seed, *key))

    # ------------------------------------------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm=False):
        docs = defaultdict(list)  # (task, doc_id) -> positions of its requests, in order
        for i, req in enumerate(requests):
            docs[(req.task_name, req.doc_id if req.doc_id is not None else i)].append(i)
        out, truncated = [None] * len(requests), 0
        for (_, doc_id), members in common.progress(docs.items(), desc="nanolatent loglikelihood", total=len(docs)):
            pairs = [multiple_choice.choice_tokens(self.encode, *requests[i].args, eot=self.eot, delimiter="")
                     for i in members]
            draws = multiple_choice.example_generator(self.model, self.seed, doc_id)
            ll, _, _ = multiple_choice.score_choices(self.model, pairs, self.passes, draws, self.autocast, self.mixture)
            truncated += sum(len(ctx) + len(cont) > self.block_size + 1 for ctx, cont in pairs)
            greedy = len(members) == 1 and self.is_greedy(pairs[0], doc_id)
            for i, score in zip(members, ll):
                out[i] = (score, greedy)
        if truncated:
            print(f"nanolatent: {truncated} requests longer than block_size + 1 = {self.block_size + 1} tokens were "
                  f"left-truncated (continuations longer than {self.block_size} tokens scored on their last "
                  f"{self.block_size}, as evaluate.py does; lm_eval's hf model stops with an AssertionError there)")
        return out

    @torch.no_grad()
    def is_greedy(self, pair, doc_id):
        """Whether every continuation token is the argmax of p̄ (the mean of the passes' softmaxes), on the draws the
        document was scored with (multiple_choice.example_latents from the same generator)."""
        ctx, cont = pair
        seq = (ctx + cont)[-(self.block_size + 1):]
        n = min(len(cont), len(seq) - 1)
        x, y = torch.tensor([seq[:-1]], device=self._device), torch.tensor([seq[1:]], device=self._device)  # (1, L)
        generator, p_bar = multiple_choice.example_generator(self.model, self.seed, doc_id), 0
        for _ in range(self.passes):
            latents = multiple_choice.example_latents(self.model, [seq[:len(seq) - n]], generator)
            with self.autocast:
                logits = self.model(x, y, latents=latents)[0]  # (1, L, V), as score_choices calls it
            p_bar = p_bar + F.softmax(logits[0, -n:].float(), dim=-1) / self.passes  # (n, V)
        return p_bar.argmax(-1).tolist() == seq[-n:]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        out = []
        for i, req in enumerate(common.progress(requests, desc="nanolatent loglikelihood_rolling")):
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.encode(text), prefix_token=self.eot, max_seq_len=self.block_size, context_len=1)]
            doc_id = req.doc_id if req.doc_id is not None else i
            draws = multiple_choice.example_generator(self.model, self.seed, doc_id)
            ll, _, _ = multiple_choice.score_choices(self.model, [(list(c), list(t)) for c, t in windows], self.passes,
                                                     draws, self.autocast, self.mixture)
            out.append(sum(ll))
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm=False):
        eos = self.decode([self.eot]) if self.eot is not None else None
        repeat, out, warned = Counter(), [], False
        for i, req in enumerate(common.progress(requests, desc="nanolatent generate_until")):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = min(kwargs.pop("max_gen_toks"), self.block_size - 1)
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            top_k = kwargs.pop("top_k", None)
            if kwargs and not warned:
                print(f"nanolatent: generation ignores {', '.join(sorted(kwargs))} (it reads until, max_gen_toks, "
                      f"do_sample, temperature, top_k)")
                warned = True
            ids = self.encode(context) or [self.eot]
            if ids == [None]:
                common.die("a generation request has an empty context and this run's tokenizer has no end-of-text "
                           "token to start from: give every request a context")
            ids = ids[-(self.block_size - max_new):]  # hf's left truncation: room for max_new tokens
            key = (req.doc_id if req.doc_id is not None else i, req.idx)
            generator = self.draws(*key, repeat[key])  # repeats of a request (pass@k) get their own latents
            repeat[key] += 1
            idx = torch.tensor([ids], device=self._device)
            with self.autocast:
                latents = self.model.sample_latents(1, generator, prompt=idx)
                new = self.model.generate(idx, max_new, temperature=temperature, top_k=top_k or None, latents=latents,
                                        generator=generator)[0, len(ids):]
            out.append(postprocess_generated_text(self.decode(new.tolist()), until, None))
        return out


def eot_token(checkpoint):
    """The token an empty context conditions on (and generation stops at): GPT-2's <|endoftext|>, or an imported
    model's BOS (else EOS) as lm_eval's hf model takes it; None for a char run."""
    meta = checkpoint["meta"]
    if meta["tokenizer"] == "gpt2" and "token_ids" not in meta:
        return 50256
    hf = hf_format.imported_hf_config(checkpoint)
    eot = hf.get("bos_token_id", hf.get("eos_token_id"))
    return eot[0] if isinstance(eot, list) else eot


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate
    cli_evaluate()
