"""Prepared datasets (data/<name>/{train,val}.bin or shards of them, and meta.json) and their tokenizers: characters,
GPT-2's BPE, a pretrained model's tokenizer.json and chat template; offline copies of public files through
NANOLATENT_LOCAL_DATA."""

import datetime
import json
import os

import numpy as np

from nanolatent.common import die

GPT2_BPE_ENV = "NANOLATENT_GPT2_BPE"  # path to a gpt2.tiktoken file, used when tiktoken cannot download GPT-2's BPE


LOCAL_DATA_ENV = "NANOLATENT_LOCAL_DATA"  # offline: a folder of local copies (gpt2/gpt2.tiktoken, hellaswag/..., gsm8k/...)


GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


# FineWeb-Edu (prepare.py fineweb_edu): its subsets, as the hub names them, and the folder of each one's parquet files
# in the hub's repository, which a local copy under $NANOLATENT_LOCAL_DATA/fineweb-edu/ mirrors ("default": the full set)
FINEWEB_EDU = "HuggingFaceFW/fineweb-edu"
FINEWEB_EDU_SUBSETS = {"sample-10BT": "sample/10BT", "sample-100BT": "sample/100BT", "sample-350BT": "sample/350BT",
                       "default": "data"}


# Named hub datasets: parquet-backed repositories (no loading scripts), their text fields and splits, and the local
# copies under $NANOLATENT_LOCAL_DATA that prepare.py reads in their place (training file, then validation file).
HUB_DATASETS = {
    "writingprompts": dict(path="euclaise/writingprompts", fields=("prompt", "story"), train="train", val="validation",
                           local=("writingprompts/wp_sample_train.jsonl", "writingprompts/wp_sample_test.jsonl")),
    "tinystories": dict(path="roneneldan/TinyStories", fields=("text",), train="train", val="validation",
                        local=("tinystories/tinystories_head_197k.txt",)),
}


def data_dir(dataset):
    """data/<dataset> at the repository's root, or under $NANOLATENT_DATA when set (the tests use a temporary folder)."""
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.environ.get("NANOLATENT_DATA") or os.path.join(repository, "data")
    return os.path.join(root, dataset)


def local_data(path, otherwise=""):
    """$NANOLATENT_LOCAL_DATA/path when that variable names a folder holding it, else `otherwise` (a hub name, or ""
    for none). For machines without a network: the folder holds local copies of the public files the scripts
    download (gpt2/gpt2.tiktoken, tinyshakespeare/input.txt, hellaswag/hellaswag_val_sample1000.jsonl, gsm8k/test.jsonl,
    ...); configs and experiments take their defaults through it, and a user online never needs it."""
    root = os.environ.get(LOCAL_DATA_ENV)
    return os.path.join(root, path) if root and os.path.exists(os.path.join(root, path)) else otherwise


def load_meta(dataset):
    path = os.path.join(data_dir(dataset), "meta.json")
    if not os.path.exists(path):
        if os.path.exists(os.path.join(data_dir(dataset), "progress.json")):
            die(f"dataset {dataset!r} is not finished ({path} is missing): its shards are being written, or their "
                f"writing was stopped; the same prepare.py fineweb_edu command, run again, goes on where it stopped")
        named = dataset in ("synthetic", "arith", "fineweb_edu", *HUB_DATASETS)  # the names prepare.py makes on its own
        how = (f"`python prepare.py {dataset}`" if named else
               f"`python prepare.py fineweb_edu --name={dataset}` with the --subset and --max_tokens its config names"
               if dataset.startswith("fineweb_edu") else
               f"`python prepare.py text --input=FILE --name={dataset}` on a local .txt or .jsonl")
        die(f"dataset {dataset!r} is not prepared ({path} is missing): run {how}")
    with open(path) as f:
        return json.load(f)


def load_tokens(dataset, split, meta):
    """A split's token stream: the memmap of its .bin, or its shards (prepare.py fineweb_edu) read as one."""
    arrays = []
    for file in meta["shards"][split] if "shards" in meta else [f"{split}.bin"]:
        path = os.path.join(data_dir(dataset), file)
        if not os.path.exists(path):
            die(f"{path} is missing: run `python prepare.py {dataset}` again")
        if os.path.getsize(path) == 0:  # np.memmap cannot map an empty file
            die(f"{path} is empty (prepared with --val_fraction=0?): prepare {dataset!r} again with a split that "
                f"holds tokens")
        arrays.append(np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r"))
    return arrays[0] if len(arrays) == 1 else Shards(arrays)


def check_fit(dataset, meta, splits, vocab_size, block_size):
    """One line (exit 2) when a model of vocab_size and block_size cannot train on the dataset's splits."""
    if vocab_size < meta["vocab_size"]:  # the embedding would have no row for the data's higher ids
        die(f"vocab_size={vocab_size} is below dataset {dataset!r}'s {meta['vocab_size']}: drop --vocab_size (the "
            f"data's is the default) or set it >= {meta['vocab_size']}")
    if "doc_len" in meta and block_size >= meta["doc_len"]:
        die(f"{dataset} holds sequences of {meta['doc_len']} tokens: set block_size <= {meta['doc_len'] - 1}")
    train, val = (len(split) for split in splits)
    if min(train, val) <= block_size:
        die(f"dataset {dataset!r} has {train:,} train and {val:,} val tokens: too few for one window of block_size "
            f"+ 1 = {block_size + 1}; prepare more data or lower block_size")


def windows(data, meta, T, n, rng):
    """n random windows of T tokens of a split and their targets, each (n, T) int64: anywhere in a stream, or from the
    first token of a sequence where the data is fixed-length sequences (meta's doc_len: the synthetic task)."""
    if "doc_len" in meta:
        starts = meta["doc_len"] * rng.integers(len(data) // meta["doc_len"], size=n)
    else:
        starts = rng.integers(len(data) - T, size=n)
    x = np.stack([data[i:i + T] for i in starts]).astype(np.int64)
    y = np.stack([data[i + 1:i + 1 + T] for i in starts]).astype(np.int64)
    return x, y


class Shards:
    """Token files read as one stream: len() and data[i:j], which reads across a file boundary as the stream before
    sharding did (prepare.py cuts shards at a token count, so a document may begin in one file and end in the next)."""

    def __init__(self, arrays):
        self.arrays = arrays
        self.starts = np.cumsum([0] + [len(a) for a in arrays])  # where each file begins in the stream

    def __len__(self):
        return int(self.starts[-1])

    def __getitem__(self, index):
        start, stop, step = index.indices(len(self))  # slices only: what train.py and evaluate.py read
        assert step == 1, "Shards reads contiguous windows"
        parts = []
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            piece = self.arrays[k][start - self.starts[k]:stop - self.starts[k]]
            parts.append(piece)
            start += len(piece)
            k += 1
        return np.concatenate(parts) if parts else np.empty(0, self.arrays[0].dtype)


def text_pieces(blocks):
    """The text of consecutive blocks, cut again only between a non-space character and a newline, where GPT-2's
    pre-tokenizer always cuts (no pre-token holds a non-space character followed by a space, and its only end-of-text
    rule, `\\s++$`, needs a space before the cut): each piece encodes to exactly the tokens it has inside the whole
    text, so a file is encoded piece by piece. A text with no such cut stays one piece."""
    buffer = ""
    for block in blocks:
        buffer += block
        cut = len(buffer)
        while (cut := buffer.rfind("\n", 0, cut)) > 0 and buffer[cut - 1].isspace():  # str.isspace covers \s
            pass
        if cut > 0:
            yield buffer[:cut]
            buffer = buffer[cut:]
    if buffer:
        yield buffer


# prepare.py's tokenizing processes: GPT-2's BPE loaded once per process, documents encoded in batches
_gpt2 = None


def start_gpt2_process(bpe_file):
    global _gpt2
    if bpe_file:
        _gpt2 = gpt2_from_file(bpe_file)
    else:  # tiktoken's own copy, downloaded (and cached) by the parent process already
        import tiktoken
        _gpt2 = tiktoken.get_encoding("gpt2")


def encode_gpt2_documents(texts):
    """(tokens, lengths): the documents in GPT-2 BPE, each followed by <|endoftext|>, as one uint16 array."""
    docs = [_gpt2.encode_ordinary(text) + [_gpt2.eot_token] for text in texts]
    return np.array([t for doc in docs for t in doc], dtype=np.uint16), np.array([len(doc) for doc in docs])


_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


BYTE_LEVEL = {**{b: chr(b) for b in _PRINTABLE},
              **{b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}}


def byte_level(token):
    """GPT-2's byte-level spelling of a token's bytes (its encoder.py bytes_to_unicode, the keys of encoder.json and
    the strings of a byte-level BPE's vocab and merges, SmolLM2's GGUF vocabulary included): printable bytes stand
    for themselves, the others for chr(256), chr(257), ... in order."""
    return "".join(map(BYTE_LEVEL.__getitem__, token))


def gpt2_from_file(bpe_file):
    import tiktoken
    import tiktoken.load
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(bpe_file)
    except (OSError, ValueError) as e:  # a folder, unreadable, or lines that are not `base64 rank`
        ranks = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if not isinstance(ranks, dict) or len(ranks) != 50256:
        found = ranks if isinstance(ranks, str) else f"{len(ranks):,} tokens"
        die(f"{bpe_file} is not GPT-2's BPE in tiktoken's format ({found}; GPT-2's has 50,256 lines "
            f"`base64(bytes) rank`): it is openai/whisper's whisper/assets/gpt2.tiktoken")
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def gpt2_encoding(bpe_file=None):
    """GPT-2's BPE: from bpe_file when given, else tiktoken's download, else the file named by $NANOLATENT_GPT2_BPE,
    else $NANOLATENT_LOCAL_DATA/gpt2/gpt2.tiktoken. Returns (encoding, the local file used or None)."""
    import tiktoken
    if bpe_file:
        return gpt2_from_file(bpe_file), bpe_file
    try:
        return tiktoken.get_encoding("gpt2"), None
    except Exception as e:
        fallback = os.environ.get(GPT2_BPE_ENV) or local_data(os.path.join("gpt2", "gpt2.tiktoken"))
        if not fallback:
            die(f"tiktoken could not download GPT-2's BPE ({type(e).__name__}). Offline, point to a local "
                f"gpt2.tiktoken file: --bpe_file=PATH, export {GPT2_BPE_ENV}=PATH, or export {LOCAL_DATA_ENV}=DIR "
                f"with DIR/gpt2/gpt2.tiktoken (the file is openai/whisper's whisper/assets/gpt2.tiktoken)")
        print(f"tiktoken could not download GPT-2's BPE ({type(e).__name__}); using the local file {fallback}")
        return gpt2_from_file(fallback), fallback


def hf_tokenizer(path):
    """A Hugging Face tokenizer.json (a pretrained model's own BPE, recorded by scripts/convert.py or prepare.py), read with
    the tokenizers package: an optional dependency, imported only here."""
    if not os.path.exists(path):
        die(f"tokenizer file {path} not found (checkpoints and datasets record it by absolute path): put it back, "
            f"or run scripts/convert.py or prepare.py --tokenizer=... again")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        die("a Hugging Face tokenizer needs the tokenizers package: pip install tokenizers")
    return Tokenizer.from_file(path)


def chat_template(meta):
    """The chat template of a run with a Hugging Face tokenizer, or None: chat_template.jinja beside its tokenizer.json
    (transformers 5, scripts/convert.py gguf), else tokenizer_config.json's chat_template (older saves)."""
    if meta.get("tokenizer") != "hf":
        return None
    folder = os.path.dirname(meta["tokenizer_file"])
    if os.path.exists(os.path.join(folder, "chat_template.jinja")):
        with open(os.path.join(folder, "chat_template.jinja")) as f:
            return f.read()
    template = hf_json(meta, "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def hf_json(meta, name):
    """A JSON file kept beside the run's tokenizer.json (tokenizer_config.json, generation_config.json), or {}."""
    path = os.path.join(os.path.dirname(meta["tokenizer_file"]), name) if meta.get("tokenizer") == "hf" else ""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def turn_end(meta, encode):
    """The id of the token that ends an assistant's turn, or None: tokenizer_config.json's eos_token, one token in the
    run's vocabulary (<|im_end|> in SmolLM2-Instruct and Qwen3, <|eot_id|> in Llama-3.x-Instruct)."""
    token = hf_json(meta, "tokenizer_config.json").get("eos_token")
    ids = encode(token["content"] if isinstance(token, dict) else token) if token else []
    return ids[0] if len(ids) == 1 else None


def chat_prompt(meta, text, **variables):
    """text as one user message in the run's chat template, ending where the assistant's answer starts: what an
    Instruct model was trained on. Rendered as transformers' apply_chat_template renders it (jinja2 in a sandbox,
    trim_blocks and lstrip_blocks, the special tokens as variables, its strftime_now, which Llama 3.x's templates
    date the system turn with, and its tojson, which leaves HTML characters unescaped); variables are the template's
    own switches, as apply_chat_template's keyword arguments (Qwen3's enable_thinking)."""
    template = chat_template(meta)
    if template is None:
        die("--chat=True but the run has no chat template (no chat_template.jinja, nor a chat_template in "
            "tokenizer_config.json, beside its tokenizer.json): prompt it with plain --start, or import an Instruct "
            "model with scripts/convert.py hf or gguf")
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    config = hf_json(meta, "tokenizer_config.json")
    specials = {name: (token["content"] if isinstance(token, dict) else token) for name, token in config.items()
                if name.endswith("_token") and token is not None}
    try:
        return env.from_string(template).render(messages=[{"role": "user", "content": text}],
                                                add_generation_prompt=True, **specials, **variables)
    except jinja2.exceptions.TemplateError as e:
        die(f"the run's chat template failed on --start: {e}")


def tokenizer(meta):
    """(encode, decode) for a prepared dataset's meta.json."""
    if meta["tokenizer"] == "hf":  # no special tokens added, as lm-evaluation-harness encodes for causal LMs
        tok = hf_tokenizer(meta["tokenizer_file"])
        return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode
    if meta["tokenizer"] == "char":
        stoi = {ch: i for i, ch in enumerate(meta["chars"])}

        def encode(text):
            missing = sorted(set(text) - set(stoi))
            if missing:
                die(f"characters {missing!r} are not in this dataset's vocabulary; use only: {''.join(meta['chars'])!r}")
            return [stoi[ch] for ch in text]
        return encode, lambda ids: "".join(meta["chars"][i] for i in ids)
    bpe_file = meta.get("bpe_file")  # recorded by prepare.py when it used a local file
    encoding, _ = gpt2_encoding(bpe_file if bpe_file and os.path.exists(bpe_file) else None)
    encode = lambda text: encoding.encode(text, allowed_special={"<|endoftext|>"})
    if "token_ids" not in meta:
        return encode, encoding.decode
    token_ids = meta["token_ids"]  # prepare.py --vocab=used: id i is GPT-2's token_ids[i]
    index = {t: i for i, t in enumerate(token_ids)}

    def encode_used(text):
        ids = encode(text)
        missing = [t for t in ids if t not in index]
        if missing:
            die(f"{len(missing)} of the {len(ids)} tokens of {text[:40]!r} ({encoding.decode(missing[:5])!r}...) "
                f"are not in this dataset's vocabulary (prepare.py --vocab=used keeps the {len(token_ids):,} ids its "
                f"text uses); use words from the dataset, or prepare it with --vocab=full")
        return [index[t] for t in ids]
    return encode_used, lambda ids: encoding.decode([token_ids[i] for i in ids])
