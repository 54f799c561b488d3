"""The tasks with a checkable answer: what prepare.py writes, what evaluate.py, scripts/rlvr.py and the experiments
score (their population metrics are in metrics.py). No model in here.

    letters  the Free Transformer's synthetic task (Fleuret, §4.1): "K>" then 64 characters holding the letter 8 times
    arith    "37*12=444" lines: two- and three-digit addition and multiplication, verified exactly (scripts/rlvr.py)
and two real ones for a pretrained chat model, asked in its chat template: GSM8K (the number after "####") and
HellaSwag as lettered multiple choice (the format of B-Trans §5.1's MMLU-Pro: the answer is a letter).
"""

import json
import os
import re
from types import SimpleNamespace

import numpy as np

from nanolatent import tokendata
from nanolatent.common import die

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# ----------------------------------------------------------------------------------------------------------------
# generation: the text prepare.py tokenizes


def synthetic_sequences(n, rng, length=64, target_len=8, noise=1 / 16):
    """n sequences "K>" + 64 chars + "\\n": underscores, a target of one random upper-case letter repeated 8 times at
    a random position, every character of the 64 replaced by '!' with probability 1/16, the letter as prompt."""
    letters = rng.integers(len(LETTERS), size=n)
    starts = rng.integers(length - target_len + 1, size=n)
    body = np.full((n, length), "_", dtype="<U1")
    cols = np.arange(length)
    in_target = (cols >= starts[:, None]) & (cols < starts[:, None] + target_len)  # (n, 64)
    body[in_target] = np.repeat(np.array(list(LETTERS))[letters], target_len)
    body[rng.random((n, length)) < noise] = "!"
    return ["%s>%s\n" % (LETTERS[k], "".join(row)) for k, row in zip(letters, body)]


def arith_lines(n, rng, exclude=frozenset()):
    """n distinct problems "a+b=c" or "a*b=c" with 2- or 3-digit operands, none of them in `exclude`, in an order
    that depends on rng alone (a dict keeps insertion order; a set's would follow the per-process string hash)."""
    lines = {}
    while len(lines) < n:
        a, b = rng.integers(10, 1000, size=2)
        op = "+*"[rng.integers(2)]
        line = f"{a}{op}{b}={a + b if op == '+' else a * b}\n"
        if line not in exclude:
            lines[line] = None
    lines = list(lines)
    return [lines[i] for i in rng.permutation(len(lines))]


# ----------------------------------------------------------------------------------------------------------------
# answers and verifiers


def letters_answer(text, strict=False, length=64, run=8):
    """The letter a continuation of the synthetic task (Free Transformer §4.1, prepare.py) writes, or None.

    The continuation's first `length` (64) characters must all be '_', '!' or one upper-case letter L, L must
    appear, and some window of `run` (8) consecutive positions must hold every L while being L or '!' throughout:
    the task's target of 8 L's, each of which the data's noise may have replaced by '!'. So the answer is L exactly
    when the 64 characters could have come from the task's generator for prompt "L>". Characters past 64 (the
    data's '\\n') are ignored. strict=True asks for the noise-free form: exactly 8 L's, consecutive."""
    body = text[:length]
    letters = set(body) - {"_", "!"}
    if len(body) < length or len(letters) != 1 or not letters <= set(LETTERS):
        return None
    (letter,) = letters
    if strict:
        return letter if body.count(letter) == run and letter * run in body else None
    pos = [i for i, ch in enumerate(body) if ch == letter]
    for s in range(max(0, pos[-1] - run + 1), min(pos[0], length - run) + 1):  # the windows holding every L
        if all(ch in (letter, "!") for ch in body[s:s + run]):
            return letter
    return None


def verify_letters(prompt, text, strict=False):
    """True when the continuation `text` of the prompt "L>" is well formed for L (see letters_answer)."""
    if not re.fullmatch(r"[A-Z]>", prompt):
        raise ValueError(f"a letters-task prompt is one upper-case letter and '>', got {prompt!r}")
    return letters_answer(text, strict) == prompt[0]


def arith_answer(text):
    """The digits a continuation writes before its first '\\n' (all of it when the budget ran out first), or None
    when that is empty or not only digits. Text after the '\\n' (the model's next problem) is ignored."""
    answer = text.split("\n", 1)[0]
    return answer if re.fullmatch("[0-9]+", answer) else None


def verify_arith(prompt, text):
    """Exact match with the true result as written in the data: '0444' is not 444, '444 ' is not either."""
    a, op, b = re.fullmatch(r"\n?([0-9]+)([+*])([0-9]+)=", prompt).groups()
    return arith_answer(text) == str(int(a) + int(b) if op == "+" else int(a) * int(b))


GSM8K_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_answer(text):
    """A GSM8K answer as a float: the first number after the last '####' (the dataset's convention), else the text's
    last number; None when there is none. Thousands separators are dropped ('1,000' is 1000)."""
    after = GSM8K_NUMBER.findall(text.rsplit("####", 1)[1]) if "####" in text else []
    numbers = after[:1] or GSM8K_NUMBER.findall(text)[-1:]
    return float(numbers[0].replace(",", "")) if numbers else None


def gsm8k_steps(answer):
    """The calculator steps of a GSM8K reference solution (its "<<48/2=24>>" annotations): a measure of difficulty."""
    return answer.count("<<")


def lettered_question(context, choices, ask="Which ending is the most likely continuation of the text?"):
    """A multiple-choice item as one user message: what is asked, the text, the choices as "A. ...", and the answer
    format asked for (the letter first), as MMLU-Pro is posed (B-Trans §5.1). ask="" for a text that is itself the
    question (MMLU-Pro's)."""
    options = "\n".join(f"{LETTERS[i]}. {c.strip()}" for i, c in enumerate(choices))
    return f"{ask}\n\n" * bool(ask) + f"{context.strip()}\n\n{options}\n\nAnswer with the letter only."


def mmlu_pro_problems(rows):
    """MMLU-Pro's rows (its test split: question, options, answer_index; up to 10 options) as lettered problems
    {question, answer letter, choices}: the question itself, the options A-J."""
    return [{"question": lettered_question(row["question"], row["options"], ask=""),
             "answer": LETTERS[row["answer_index"]], "choices": len(row["options"])} for row in rows]


def letter_answer(text, n_choices=4):
    """The letter a reply starts with ("B", "B. the dog ...", " B"), or None: the format asked for is the letter
    first, so "The answer is B" counts as no answer."""
    match = re.match(r"\s*([A-Z])(?![A-Za-z])", text)
    return match.group(1) if match and LETTERS.index(match.group(1)) < n_choices else None


TASKS = {  # dataset, default max_new_tokens, answer extraction (TTRL's vote), verifier (chat: scripts/rlvr.py's, from labels)
    "arith": SimpleNamespace(dataset="arith", max_new_tokens=8, answer=arith_answer, verify=verify_arith, chat=False),
    "letters": SimpleNamespace(dataset="synthetic", max_new_tokens=64, answer=letters_answer, verify=verify_letters,
                               chat=False),
    # a pretrained chat model's own vocabulary, prompts in its chat template; the dataset is a jsonl folder or file
    "gsm8k": SimpleNamespace(dataset="gsm8k", max_new_tokens=256, answer=gsm8k_answer, verify=None, chat=True),
    "hellaswag": SimpleNamespace(dataset="hellaswag", max_new_tokens=1, answer=letter_answer, verify=None, chat=True),
}


def load_prompts(task, dataset, split, meta):
    """Every prompt of a split in data order. arith: each line "37*12=444" gives "\\n37*12=": the '\\n' that precedes
    every problem in training marks the first operand's start (without it "37*12=" could be the end of "137*12=").
    letters: the first two characters "K>" of each fixed-length sequence."""
    data = tokendata.load_tokens(dataset, split, meta)
    if task == "letters":
        n = meta["doc_len"]
        return ["".join(meta["chars"][t] for t in data[i:i + 2]) for i in range(0, len(data) - n + 1, n)]
    text = tokendata.tokenizer(meta)[1](data.tolist())  # char, or a pretrained model's tokenizer (prepare.py arith)
    return ["\n" + line[:line.index("=") + 1] for line in text.split("\n") if "=" in line]


def chat_problems(task, dataset, split, max_calc_steps=0):
    """(question, answer) of every problem of a chat task's split, in data order. gsm8k: `dataset` is a folder with
    GSM8K's train.jsonl and test.jsonl (openai/grade-school-math), else the hub's openai/gsm8k; 'val' is its test
    split; max_calc_steps > 0 keeps the problems whose reference takes at most that many calculator steps (the easier
    real split of experiments/btrans_passk_pretrained). hellaswag: a jsonl file or hub name, as evaluate.py's
    --mc_file; HellaSwag's labelled items are its validation split, so they are all 'val'."""
    if task == "hellaswag":
        if split == "train":
            die("hellaswag has labelled validation items only: use --train_prompts=val (the items past the "
                       "held-out ones)")
        from nanolatent import multiple_choice
        return [(lettered_question(ex["context"], ex["choices"]), LETTERS[ex["label"]])
                for ex in multiple_choice.load_mc_examples(dataset)]
    name = "test" if split == "val" else "train"
    path = os.path.join(dataset, f"{name}.jsonl")
    if not os.path.isfile(path) and tokendata.local_data(f"gsm8k/{name}.jsonl"):  # offline: the local copy
        path = tokendata.local_data(f"gsm8k/{name}.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        try:
            import datasets
            rows = datasets.load_dataset("openai/gsm8k", "main", split=name)
        except Exception as e:
            die(f"no {path}, and the hub's openai/gsm8k did not load ({type(e).__name__}); offline, pass "
                f"--dataset=<a folder with GSM8K's train.jsonl and test.jsonl>, or export "
                f"{tokendata.LOCAL_DATA_ENV}=DIR with DIR/gsm8k/train.jsonl and test.jsonl")
    return [(row["question"], gsm8k_answer(row["answer"])) for row in rows
            if not max_calc_steps or gsm8k_steps(row["answer"]) <= max_calc_steps]


def chat_task(task, dataset, meta, max_calc_steps=0):
    """A chat task's (load(split) -> prompts, verify(prompt, reply) -> bool): each question in the run's chat template
    (tokendata.chat_prompt, as sample.py --chat=True), and a reply right when its answer (the task's) is the label of
    the question it replies to."""
    labels = {}

    def load(split):
        pairs = [(tokendata.chat_prompt(meta, q), a) for q, a in chat_problems(task, dataset, split, max_calc_steps)]
        labels.update(pairs)
        return [p for p, _ in pairs]
    answer = TASKS[task].answer
    return load, lambda prompt, reply: answer(reply) == labels[prompt]
