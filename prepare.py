"""Tokenize a dataset into data/<name>/{train,val}.bin (a flat uint16/uint32 token stream) and meta.json.

    python prepare.py synthetic                                  # Free Transformer §4.1 task, no download
    python prepare.py arith                                      # "37*12=444" lines for scripts/rlvr.py, no download
    python prepare.py text --input=input.txt --tokenizer=char --name=shakespeare_char
    python prepare.py text --input=wp.jsonl --fields=prompt,story --name=wp
    python prepare.py text --input=input.txt --tokenizer=out-smollm2/tokenizer.json --name=shakespeare_smollm2
    python prepare.py writingprompts | tinystories | fineweb_edu  # Hugging Face hub, GPT-2 BPE
"""

import json
import os
import sys

import numpy as np

import configurator
from nanolatent import common, tasks, tokendata

# ----------------------------------------------------------------------------------------------------------------
source = ""  # what to prepare (the first argument): synthetic, arith, text, or a hub name below
name = ""  # the folder under data/; '' = the source's name (text: <input stem>_<tokenizer>)
# synthetic and arith
num_train = 0  # sequences or problems; 0 = the source's default (synthetic 100,000, arith 200,000)
num_val = 0  # 0 = the source's default (synthetic 5,000, arith 2,000)
seed = 1337
# text: a local .txt (one document) or .jsonl (one document a line)
input = ""
val_input = ""  # a separate validation file ('' = split off the input)
val_fraction = 0.1
fields = ("text",)  # jsonl fields joined into a document, e.g. --fields=prompt,story
tokenizer = "gpt2"  # gpt2, char, or a pretrained model's tokenizer.json (scripts/convert.py copies it beside ckpt.pt)
bpe_file = ""  # a local gpt2.tiktoken (offline; or $NANOLATENT_GPT2_BPE)
vocab = "full"  # gpt2: 'full' (50,257 ids) or 'used' (only the ids the train and val text use, renumbered from 0)
max_docs = 0  # stop after this many training documents (0 = all); text and hub
# hub datasets
val_docs = 0  # validation documents (0 = the whole validation split, or 1,000 for a hub set with none)
# ----------------------------------------------------------------------------------------------------------------
configurator.apply(globals(), positional="source")
configurator.require(globals(), non_negative=("num_train", "num_val", "max_docs", "val_docs"),
                     choices={"vocab": ("full", "used")}, within={"val_fraction": "(0, 1)"})


def hf_meta(path):
    """meta.json of a dataset in a pretrained model's own vocabulary, and its encode."""
    if not os.path.isfile(path):
        common.die(f"--tokenizer must be gpt2, char or the path of a tokenizer.json, got {path!r}")
    meta = dict(tokenizer="hf", tokenizer_file=os.path.abspath(path))
    meta["vocab_size"] = tokendata.hf_tokenizer(meta["tokenizer_file"]).get_vocab_size()
    return meta, tokendata.tokenizer(meta)[0]


def token_dtype(vocab_size):
    return "uint16" if vocab_size <= 2**16 else "uint32"


def write_dataset(name, splits, meta):
    """splits: {'train': iterable of token arrays, 'val': ...}; streams them to disk, so memory stays bounded. Every
    file is written beside its place as .tmp and moved there once all are whole: a failure (a full disk, a hub that
    stops answering mid-stream) leaves a dataset prepared earlier as it was, and no .tmp."""
    out = tokendata.data_dir(name)
    made = not os.path.isdir(out)
    meta["dtype"] = token_dtype(meta["vocab_size"])
    written = []  # (.tmp, its final name)
    try:
        os.makedirs(out, exist_ok=True)
        for split, chunks in splits.items():
            written.append((os.path.join(out, f"{split}.bin.tmp"), os.path.join(out, f"{split}.bin")))
            n = 0
            with open(written[-1][0], "wb") as f:
                for chunk in common.progress(chunks, desc=f"writing {split}.bin"):
                    f.write(np.asarray(chunk, dtype=meta["dtype"]).tobytes())
                    n += len(chunk)
            meta[f"{split}_tokens"] = n
            print(f"{split}: {n:,} tokens")
        written.append((os.path.join(out, "meta.json.tmp"), os.path.join(out, "meta.json")))
        with open(written[-1][0], "w") as f:
            json.dump(meta, f, indent=1)
        for tmp, final in written:
            os.replace(tmp, final)
    except OSError as e:
        failed = e.filename or (written[-1][1] if written else out)
        common.die(f"could not write {failed}: {e.strerror or e}{common.free_space(out)}; {out} is as it was")
    finally:
        for tmp, _ in written:
            if os.path.lexists(tmp):
                os.remove(tmp)
        if made and os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)
    print(f"wrote {out}/{{train,val}}.bin and meta.json (vocab {meta['vocab_size']}, {meta['tokenizer']})")


# ----------------------------------------------------------------------------------------------------------------
# the Free Transformer's synthetic task (Fleuret, §4.1 and Fig. 2)


def prepare_synthetic():
    rng = np.random.default_rng(seed)
    train = tasks.synthetic_sequences(num_train or 100_000, rng)
    val = tasks.synthetic_sequences(num_val or 5_000, rng)
    chars = sorted(set("".join(train[:1000])) | set("\n!>_" + tasks.LETTERS))
    stoi = {ch: i for i, ch in enumerate(chars)}
    encode = lambda docs: [np.array([stoi[c] for c in "".join(docs)])]
    meta = dict(vocab_size=len(chars), tokenizer="char", chars=chars,
                doc_len=len(train[0]))  # fixed-length sequences: train.py aligns batches to their starts
    write_dataset(name or "synthetic", {"train": encode(train), "val": encode(val)}, meta)


def prepare_arith():
    """Arithmetic with a verifiable answer (scripts/rlvr.py): one problem a line; validation problems never occur in training."""
    rng = np.random.default_rng(seed)
    val = tasks.arith_lines(num_val or 2_000, rng)
    train = tasks.arith_lines(num_train or 200_000, rng, exclude=frozenset(val))
    chars = sorted("0123456789+*=\n")
    stoi = {ch: i for i, ch in enumerate(chars)}
    encode = lambda lines: [np.array([stoi[c] for c in "".join(lines)])]
    meta = dict(vocab_size=len(chars), tokenizer="char", chars=chars, task="arith")
    if tokenizer not in ("char", "gpt2"):  # the same problems in a pretrained model's vocabulary (scripts/convert.py)
        meta, encode_text = hf_meta(tokenizer)
        meta["task"] = "arith"
        encode = lambda lines: [encode_text("".join(lines))]
    write_dataset(name or "arith", {"train": encode(train), "val": encode(val)}, meta)


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


def write_gpt2(out, train_docs, val_docs, **meta):
    """Documents in GPT-2 BPE to data/<out>; with --vocab=used, in the ids the text uses, renumbered from 0."""
    encoding, local_bpe = tokendata.gpt2_encoding(bpe_file)
    meta.update(vocab_size=encoding.n_vocab, tokenizer="gpt2", bpe_file=local_bpe and os.path.abspath(local_bpe))
    splits = {"train": gpt2_chunks(train_docs, encoding), "val": gpt2_chunks(val_docs, encoding)}
    if vocab == "used":  # a closed vocabulary for small data: the output layer shrinks to the ids that occur
        splits = {split: list(chunks) for split, chunks in splits.items()}
        used = np.unique(np.concatenate([np.concatenate(chunks) for chunks in splits.values()]))  # sorted ids
        splits = {split: [np.searchsorted(used, chunk) for chunk in chunks] for split, chunks in splits.items()}
        meta.update(vocab_size=len(used), token_ids=used.tolist())  # new id i is GPT-2's token_ids[i]
    write_dataset(out, splits, meta)


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
    """Documents of a local file: a .txt is one document, a .jsonl one per line (its `fields` joined)."""
    if os.path.isdir(path):
        common.die(f"input {path!r} is a folder: give one .txt or .jsonl file inside it (prepare.py reads one file, "
                   f"and --val_input=FILE a second)")
    if not os.path.isfile(path):
        common.die(f"input file {path!r} not found")
    if not path.endswith((".jsonl", ".txt")):
        common.die(f"{path}: expected a .txt or .jsonl file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        common.die(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); convert it, e.g. iconv -t utf-8")
    docs = [text] if path.endswith(".txt") else []
    for i, line in enumerate(text.split("\n") if path.endswith(".jsonl") else [], 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                common.die(f"{path} line {i} could not be parsed ({e.msg}): a .jsonl holds one JSON object per line")
            if not isinstance(record, dict):
                common.die(f"{path} line {i} is a JSON {type(record).__name__}, not an object: a .jsonl holds one "
                           f"JSON object per line, its text under --fields={','.join(fields)}")
            docs.append(record_text(record, fields))
    if not any(doc.strip() for doc in docs):
        common.die(f"{path} holds no text: nothing to prepare")
    return docs


def local_splits(input, val_input, fields):
    """(train documents, validation documents) of local files: val_input's, or the last val_fraction of the input."""
    docs = load_local_documents(input, fields)
    if val_input:
        train_docs, val_docs = docs, load_local_documents(val_input, fields)
    elif len(docs) == 1:  # one text (Tiny Shakespeare): the last val_fraction of its characters is validation
        cut = int(len(docs[0]) * (1 - val_fraction))
        train_docs, val_docs = [docs[0][:cut]], [docs[0][cut:]]
    else:
        cut = int(len(docs) * (1 - val_fraction))
        train_docs, val_docs = docs[:cut], docs[cut:]
    return train_docs[:max_docs or None], val_docs


def prepare_text():
    if not input:
        common.die("prepare.py text needs --input=FILE (a .txt or .jsonl)")
    train_docs, val_docs = local_splits(input, val_input, fields)
    kind = tokenizer if tokenizer in ("gpt2", "char") else "hf"
    out = name or f"{os.path.splitext(os.path.basename(input))[0]}_{kind}"
    if kind == "hf":  # a pretrained model's own vocabulary (scripts/convert.py copies its tokenizer.json next to ckpt.pt)
        meta, encode_text = hf_meta(tokenizer)
        encode = lambda ds: [encode_text("\n\n".join(ds))]
        write_dataset(out, {"train": encode(train_docs), "val": encode(val_docs)}, meta)
    elif kind == "char":  # the characters of the text, and the blank line that joins its documents
        chars = sorted(set("\n\n".join(train_docs)) | set("\n\n".join(val_docs)))
        stoi = {ch: i for i, ch in enumerate(chars)}
        encode = lambda ds: [[stoi[c] for c in "\n\n".join(ds)]]
        meta = dict(vocab_size=len(chars), tokenizer="char", chars=chars)
        write_dataset(out, {"train": encode(train_docs), "val": encode(val_docs)}, meta)
    else:
        write_gpt2(out, train_docs, val_docs)


def prepare_hub():
    spec = tokendata.HUB_DATASETS[source]
    copies = [tokendata.local_data(path) for path in spec["local"]]
    if copies and all(copies):  # offline: as prepare.py text on the copies (the first the training file)
        print(f"{source}: reading {' and '.join(copies)} ({tokendata.LOCAL_DATA_ENV}) in place of the hub")
        write_gpt2(name or source, *local_splits(copies[0], copies[1] if len(copies) > 1 else "", spec["fields"]),
                   source=spec["path"], local_copies=copies)
        return
    datasets = load_datasets()
    offline = (f"export {tokendata.LOCAL_DATA_ENV}=DIR with DIR/{' and DIR/'.join(spec['local'])}, or "
               if spec["local"] else "")

    def hub_failure(e):
        common.die(f"could not load {spec['path']} from the Hugging Face hub ({type(e).__name__}); offline, "
                   f"{offline}run python prepare.py text --input=FILE.jsonl --fields={','.join(spec['fields'])} "
                   f"--name={source} on a copy")

    def documents(split, limit):
        try:
            stream = datasets.load_dataset(spec["path"], spec.get("name"), split=split, streaming=True)
            for i, record in enumerate(stream):  # streamed: the hub can fail at any record
                if limit and i >= limit:
                    return
                yield record_text(record, spec["fields"])
        except Exception as e:
            hub_failure(e)

    if spec["val"]:
        train, val = documents(spec["train"], max_docs), documents(spec["val"], val_docs)
    else:  # a single split: its first val_docs documents are validation, the rest training
        n_val = val_docs or 1000
        val = documents(spec["train"], n_val)
        train = (d for i, d in enumerate(documents(spec["train"], max_docs and max_docs + n_val)) if i >= n_val)
    write_gpt2(name or source, train, val, source=spec["path"])


PREPARE = {"synthetic": prepare_synthetic, "arith": prepare_arith, "text": prepare_text,
           **{hub: prepare_hub for hub in tokendata.HUB_DATASETS}}
if source not in PREPARE:
    common.die(f"what to prepare? the first argument is one of {', '.join(PREPARE)}"
               + (f", got {source!r}" if source else "") + " (e.g. python prepare.py synthetic)")
if vocab == "used" and (source in ("synthetic", "arith") or tokenizer != "gpt2"):
    common.die(f"--vocab=used renumbers GPT-2 BPE ids: it applies to text with --tokenizer=gpt2 and to hub datasets, "
               f"not to {source} with --tokenizer={tokenizer}")
PREPARE[source]()
