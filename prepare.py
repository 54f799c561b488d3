"""Tokenize a dataset into data/<name>/{train,val}.bin (a flat uint16/uint32 token stream) and meta.json.

    python prepare.py synthetic                                  # Free Transformer §4.1 task, no download
    python prepare.py arith                                      # "37*12=444" lines for rlvr.py, no download
    python prepare.py text --input=input.txt --tokenizer=char --name=shakespeare_char
    python prepare.py text --input=wp.jsonl --fields=prompt,story --name=wp
    python prepare.py text --input=input.txt --tokenizer=out-smollm2/tokenizer.json --name=shakespeare_smollm2
    python prepare.py writingprompts | tinystories | fineweb_edu  # Hugging Face hub, GPT-2 BPE
"""

import argparse
import json
import os
import sys

import numpy as np

import common

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Named hub datasets: parquet-backed repositories (no loading scripts), their text fields and splits.
HUB_DATASETS = {
    "writingprompts": dict(path="euclaise/writingprompts", fields=("prompt", "story"), train="train", val="validation"),
    "tinystories": dict(path="roneneldan/TinyStories", fields=("text",), train="train", val="validation"),
    "fineweb_edu": dict(path="HuggingFaceFW/fineweb-edu", name="sample-10BT", fields=("text",), train="train",
                        val=None),
}


def token_dtype(vocab_size):
    return "uint16" if vocab_size <= 2**16 else "uint32"


def write_dataset(name, splits, meta):
    """splits: {'train': iterable of token arrays, 'val': ...}; streams them to disk, so memory stays bounded."""
    out = common.data_dir(name)
    os.makedirs(out, exist_ok=True)
    meta["dtype"] = token_dtype(meta["vocab_size"])
    for split, chunks in splits.items():
        n = 0
        with open(os.path.join(out, f"{split}.bin.tmp"), "wb") as f:
            for chunk in common.progress(chunks, desc=f"writing {split}.bin", unit="doc"):
                f.write(np.asarray(chunk, dtype=meta["dtype"]).tobytes())
                n += len(chunk)
        os.replace(os.path.join(out, f"{split}.bin.tmp"), os.path.join(out, f"{split}.bin"))
        meta[f"{split}_tokens"] = n
        print(f"{split}: {n:,} tokens")
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {out}/{{train,val}}.bin and meta.json (vocab {meta['vocab_size']}, {meta['tokenizer']})")


# ----------------------------------------------------------------------------------------------------------------
# the Free Transformer's synthetic task (Fleuret, §4.1 and Fig. 2)


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


def prepare_synthetic(args):
    rng = np.random.default_rng(args.seed)
    train, val = synthetic_sequences(args.num_train, rng), synthetic_sequences(args.num_val, rng)
    chars = sorted(set("".join(train[:1000])) | set("\n!>_" + LETTERS))
    stoi = {ch: i for i, ch in enumerate(chars)}
    encode = lambda docs: [np.array([stoi[c] for c in "".join(docs)])]
    meta = dict(vocab_size=len(chars), tokenizer="char", chars=chars,
                doc_len=len(train[0]))  # fixed-length sequences: train.py aligns batches to their starts
    write_dataset(args.name or "synthetic", {"train": encode(train), "val": encode(val)}, meta)


def arith_lines(n, rng, exclude=frozenset()):
    """n distinct problems "a+b=c" or "a*b=c" with 2- or 3-digit operands, none of them in `exclude`."""
    lines = set()
    while len(lines) < n:
        a, b = rng.integers(10, 1000, size=2)
        op = "+*"[rng.integers(2)]
        line = f"{a}{op}{b}={a + b if op == '+' else a * b}\n"
        if line not in exclude:
            lines.add(line)
    return sorted(lines, key=lambda _: rng.random())


def prepare_arith(args):
    """Arithmetic with a verifiable answer (rlvr.py): one problem a line; validation problems never occur in training."""
    rng = np.random.default_rng(args.seed)
    val = arith_lines(args.num_val, rng)
    train = arith_lines(args.num_train, rng, exclude=frozenset(val))
    chars = sorted("0123456789+*=\n")
    stoi = {ch: i for i, ch in enumerate(chars)}
    encode = lambda lines: [np.array([stoi[c] for c in "".join(lines)])]
    meta = dict(vocab_size=len(chars), tokenizer="char", chars=chars, task="arith")
    if args.tokenizer != "char":  # the same problems in a pretrained model's vocabulary (convert.py's tokenizer.json)
        meta = dict(tokenizer="hf", tokenizer_file=os.path.abspath(args.tokenizer), task="arith")
        meta["vocab_size"] = common.hf_tokenizer(meta["tokenizer_file"]).get_vocab_size()
        encode_text, _ = common.tokenizer(meta)
        encode = lambda lines: [encode_text("".join(lines))]
    write_dataset(args.name or "arith", {"train": encode(train), "val": encode(val)}, meta)


# ----------------------------------------------------------------------------------------------------------------
# text: local files and hub datasets


def gpt2_chunks(docs, encoding, batch=256):
    """Encode documents in batches (tiktoken threads), each followed by <|endoftext|> as in GPT-2's training data."""
    eot = encoding.eot_token
    buffer = []
    for doc in docs:
        buffer.append(doc)
        if len(buffer) == batch:
            yield from (ids + [eot] for ids in encoding.encode_ordinary_batch(buffer, num_threads=os.cpu_count()))
            buffer = []
    yield from (ids + [eot] for ids in encoding.encode_ordinary_batch(buffer, num_threads=os.cpu_count()))


def record_text(record, fields):
    missing = [f for f in fields if f not in record]
    if missing:
        common.die(f"field(s) {missing} not in the records; available: {', '.join(record)} (choose with --fields)")
    return "\n\n".join(str(record[f]).strip() for f in fields)


def load_datasets():
    import datasets
    if not sys.stdout.isatty():
        datasets.disable_progress_bars()  # quiet in logs and CI, like common.progress()
    return datasets


def load_local_documents(path, fields):
    """Documents of a local file through datasets' local loaders: a .txt is one document, a .jsonl one per line."""
    datasets = load_datasets()
    if not os.path.exists(path):
        common.die(f"input file {path} not found")
    if path.endswith((".jsonl", ".json")):
        rows = datasets.load_dataset("json", data_files=path, split="train")
        return [record_text(r, fields) for r in rows]
    if path.endswith(".txt"):
        rows = datasets.load_dataset("text", data_files=path, sample_by="document", split="train")
        return [r["text"] for r in rows]
    common.die(f"{path}: expected a .txt or .jsonl file")


def prepare_text(args):
    fields = tuple(args.fields.split(","))
    docs = load_local_documents(args.input, fields)
    if args.val_input:
        train_docs, val_docs = docs, load_local_documents(args.val_input, fields)
    elif len(docs) == 1:  # one text (Tiny Shakespeare): the last val_fraction of its characters is validation
        cut = int(len(docs[0]) * (1 - args.val_fraction))
        train_docs, val_docs = [docs[0][:cut]], [docs[0][cut:]]
    else:
        cut = int(len(docs) * (1 - args.val_fraction))
        train_docs, val_docs = docs[:cut], docs[cut:]
    kind = args.tokenizer if args.tokenizer in ("gpt2", "char") else "hf"
    name = args.name or f"{os.path.splitext(os.path.basename(args.input))[0]}_{kind}"
    if kind == "hf":  # a pretrained model's own vocabulary (convert.py copies its tokenizer.json next to ckpt.pt)
        if not os.path.isfile(args.tokenizer):
            common.die(f"--tokenizer must be gpt2, char or the path of a tokenizer.json, got {args.tokenizer!r}")
        meta = dict(tokenizer="hf", tokenizer_file=os.path.abspath(args.tokenizer))
        meta["vocab_size"] = common.hf_tokenizer(meta["tokenizer_file"]).get_vocab_size()
        encode_text, _ = common.tokenizer(meta)
        encode = lambda ds: [encode_text("\n\n".join(ds))]
        write_dataset(name, {"train": encode(train_docs), "val": encode(val_docs)}, meta)
    elif kind == "char":
        chars = sorted(set("".join(train_docs + val_docs)))
        stoi = {ch: i for i, ch in enumerate(chars)}
        encode = lambda ds: [[stoi[c] for c in "\n\n".join(ds)]]
        meta = dict(vocab_size=len(chars), tokenizer="char", chars=chars)
        write_dataset(name, {"train": encode(train_docs), "val": encode(val_docs)}, meta)
    else:
        encoding, bpe_file = common.gpt2_encoding(args.bpe_file)
        meta = dict(vocab_size=encoding.n_vocab, tokenizer="gpt2", bpe_file=bpe_file and os.path.abspath(bpe_file))
        write_dataset(name, {"train": gpt2_chunks(train_docs, encoding), "val": gpt2_chunks(val_docs, encoding)},
                      meta)


def prepare_hub(args):
    datasets = load_datasets()
    spec = HUB_DATASETS[args.source]
    encoding, bpe_file = common.gpt2_encoding(args.bpe_file)

    def documents(split, limit):
        try:
            stream = datasets.load_dataset(spec["path"], spec.get("name"), split=split, streaming=True)
        except Exception as e:
            common.die(f"could not load {spec['path']} from the Hugging Face hub ({type(e).__name__}). Offline, "
                       f"download its files elsewhere and run `python prepare.py text --input=FILE.jsonl "
                       f"--fields={','.join(spec['fields'])} --name={args.source}`")
        for i, record in enumerate(stream):
            if limit is not None and i >= limit:
                return
            yield record_text(record, spec["fields"])

    if spec["val"]:
        train, val = documents(spec["train"], args.max_docs), documents(spec["val"], args.val_docs)
    else:  # a single split: its first val_docs documents are validation, the rest training
        val = documents(spec["train"], args.val_docs)
        train = (d for i, d in enumerate(documents(spec["train"], args.max_docs)) if i >= args.val_docs)
    meta = dict(vocab_size=encoding.n_vocab, tokenizer="gpt2", bpe_file=bpe_file and os.path.abspath(bpe_file),
                source=spec["path"])
    write_dataset(args.name or args.source, {"train": gpt2_chunks(train, encoding), "val": gpt2_chunks(val, encoding)},
                  meta)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="source", required=True)
    p = sub.add_parser("synthetic", help="the Free Transformer's synthetic letters task (§4.1)")
    p.add_argument("--num_train", type=int, default=100_000)
    p.add_argument("--num_val", type=int, default=5_000)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--name", default=None, help="output folder under data/ (default: synthetic)")
    p = sub.add_parser("arith", help="two- and three-digit addition and multiplication, one problem a line")
    p.add_argument("--num_train", type=int, default=200_000)
    p.add_argument("--num_val", type=int, default=2_000)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--name", default=None, help="output folder under data/ (default: arith)")
    p.add_argument("--tokenizer", default="char", help="char, or a Hugging Face tokenizer.json (convert.py)")
    p = sub.add_parser("text", help="a local .txt (one document) or .jsonl (one document a line)")
    p.add_argument("--input", required=True)
    p.add_argument("--val_input", default=None, help="a separate validation file (default: split off the input)")
    p.add_argument("--val_fraction", type=float, default=0.1)
    p.add_argument("--fields", default="text", help="jsonl fields joined into a document, e.g. prompt,story")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2, char, or a Hugging Face tokenizer.json (convert.py)")
    p.add_argument("--bpe_file", default=None, help=f"local gpt2.tiktoken (offline; or ${common.GPT2_BPE_ENV})")
    p.add_argument("--name", default=None, help="output folder under data/ (default: <input stem>_<tokenizer>)")
    for source in HUB_DATASETS:
        p = sub.add_parser(source, help=f"{HUB_DATASETS[source]['path']} from the Hugging Face hub (GPT-2 BPE)")
        p.add_argument("--max_docs", type=int, default=None, help="stop after this many training documents")
        p.add_argument("--val_docs", type=int, default=None if HUB_DATASETS[source]["val"] else 1000)
        p.add_argument("--bpe_file", default=None)
        p.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    {"synthetic": prepare_synthetic, "arith": prepare_arith, "text": prepare_text}.get(args.source, prepare_hub)(args)


if __name__ == "__main__":
    main()
