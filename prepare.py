"""Tokenize a dataset into data/<name>/{train,val}.bin (a flat uint16/uint32 token stream), or shards, and meta.json.

    python prepare.py synthetic                                  # Free Transformer §4.1 task, no download
    python prepare.py arith                                      # "37*12=444" lines for scripts/rlvr.py, no download
    python prepare.py text --input=input.txt --tokenizer=char --name=shakespeare_char
    python prepare.py text --input=wp.jsonl --fields=prompt,story --name=wp
    python prepare.py text --input=input.txt --tokenizer=out-smollm2/tokenizer.json --name=shakespeare_smollm2
    python prepare.py writingprompts | tinystories                # Hugging Face hub, GPT-2 BPE
    python prepare.py fineweb_edu --subset=sample-100BT --max_tokens=47e9   # resumable shards of 100M tokens
"""

import codecs
import collections
import concurrent.futures
import glob
import io
import itertools
import json
import multiprocessing
import os
import sys
import time

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np

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
val_docs = 0  # validation documents (0 = the whole validation split)
# fineweb_edu: data/<name>/val_000000.bin, train_000001.bin, ... resumable: a rerun skips the shards already written
subset = "sample-10BT"  # sample-10BT, sample-100BT, sample-350BT, or default (the full set)
max_tokens = 0.0  # training tokens to write, e.g. 47e9; 0 = the whole subset
shard_tokens = 1e8  # tokens a training shard holds (the last one the rest)
val_tokens = 1e7  # the stream's first tokens, the validation shard
num_proc = 0  # tokenizing processes (0 = one per CPU core)
# ----------------------------------------------------------------------------------------------------------------
configurator.apply(globals(), positional="source")
configurator.require(globals(), positive=("shard_tokens", "val_tokens"),
                     non_negative=("num_train", "num_val", "max_docs", "val_docs", "max_tokens", "num_proc"),
                     choices={"vocab": ("full", "used"), "subset": tuple(tokendata.FINEWEB_EDU_SUBSETS)},
                     within={"val_fraction": "(0, 1)"})


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
    """Encode documents (each an iterable of text pieces) in batches of pieces (tiktoken threads), each document
    followed by <|endoftext|> as in GPT-2's training data."""
    def pieces():  # (text, whether <|endoftext|> follows it)
        for doc in docs:
            yield from ((piece, False) for piece in doc)
            yield "", True
    stream = pieces()
    while group := list(itertools.islice(stream, batch)):
        ids = encoding.encode_ordinary_batch([text for text, _ in group], num_threads=os.cpu_count())
        yield from (tokens + [encoding.eot_token] if end else tokens for tokens, (_, end) in zip(ids, group))


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


def record_text(record, fields, where):
    """The record's `fields` joined into a document; where: the file and line (or the dataset and record) it is."""
    missing = [f for f in fields if f not in record]
    if missing:
        common.die(f"{where}: field(s) {missing} not in the record; available: {', '.join(record)} (choose with "
                   f"--fields)")
    bad = next((f for f in fields if not isinstance(record[f], str)), None)
    if bad is not None:  # a list, null or object would be prepared as its Python repr
        common.die(f"{where}: field {bad!r} holds {json.dumps(record[bad])[:60]}, not a string; fix the record, or "
                   f"choose other --fields")
    return "\n\n".join(record[f].strip() for f in fields)


def load_datasets():
    import datasets
    if not sys.stdout.isatty():
        datasets.disable_progress_bars()  # quiet in logs and CI, like common.progress()
    return datasets


def read_blocks(path, size=1 << 20):
    """A local file's text in blocks of `size` bytes, decoded as open(path).read() decodes it (UTF-8, newlines made
    \\n): never the whole file in memory."""
    # utf-8-sig: a byte-order mark at the start (Windows editors write one) is dropped, not made a character
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8-sig")(), translate=True)
    offset = 0
    with open(path, "rb") as f:
        while True:
            data, pending = f.read(size), len(decoder.getstate()[0])  # bytes of a character cut by the last block
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                common.die(f"{path} is not UTF-8 text (byte {offset - pending + e.start}: {e.reason}); convert it, "
                           f"e.g. iconv -t utf-8")
            offset += len(data)
            if text:
                yield text
            if not data:
                return


def crop(blocks, start, stop):
    """The characters [start, stop) of consecutive blocks of text (stop None: to the end)."""
    position = 0
    for block in blocks:
        if stop is not None and position >= stop:
            return
        piece = block[max(start - position, 0):None if stop is None else max(stop - position, 0)]
        position += len(block)
        if piece:
            yield piece


def jsonl_texts(path, fields):
    """The documents of a .jsonl file, a line each (its `fields` joined), read line by line."""
    rest, number = "", 0
    for block in itertools.chain(read_blocks(path), ["\n"]):
        *lines, rest = (rest + block).split("\n")
        for line in lines:
            number += 1
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                common.die(f"{path} line {number} could not be parsed ({e.msg}): a .jsonl holds one JSON object per "
                           f"line")
            if not isinstance(record, dict):
                common.die(f"{path} line {number} is a JSON {type(record).__name__}, not an object: a .jsonl holds "
                           f"one JSON object per line, its text under --fields={','.join(fields)}")
            yield record_text(record, fields, f"{path} line {number}")


def local_documents(path, fields, start=0, stop=None):
    """A local file's documents, streamed, each an iterable of text pieces cut where GPT-2's pre-tokenizer cuts
    (tokendata.text_pieces): a .txt is one document, a .jsonl a document a line. start, stop: the characters to keep
    of a file that holds one document."""
    if path.endswith(".txt"):
        yield tokendata.text_pieces(crop(read_blocks(path), start, stop))
    else:
        for text in jsonl_texts(path, fields):
            yield tokendata.text_pieces(crop([text], start, stop))


def check_local_file(path, fields):
    """A first pass over a local file, so that what would stop the preparation stops it before anything is written:
    (its documents, the characters of the first)."""
    if os.path.isdir(path):
        common.die(f"input {path!r} is a folder: give one .txt or .jsonl file inside it (prepare.py reads one file, "
                   f"and --val_input=FILE a second)")
    if not os.path.isfile(path):
        common.die(f"input file {path!r} not found")
    if not path.endswith((".jsonl", ".txt")):
        common.die(f"{path}: expected a .txt or .jsonl file")
    docs = chars = 0
    text = False
    for doc in local_documents(path, fields):
        docs += 1
        for piece in doc:
            chars += len(piece) if docs == 1 else 0
            text = text or bool(piece.strip())
    if not text:
        common.die(f"{path} holds no text: nothing to prepare")
    return docs, chars


def local_splits(input, val_input, fields):
    """(train documents, validation documents) of local files, streamed: val_input's, or the last val_fraction of the
    input's documents (of its characters when it holds one)."""
    docs, chars = check_local_file(input, fields)
    if val_input:
        check_local_file(val_input, fields)
        train, val = local_documents(input, fields), local_documents(val_input, fields)
    elif docs == 1:  # one text (Tiny Shakespeare): the last val_fraction of its characters is validation
        cut = int(chars * (1 - val_fraction))
        train, val = local_documents(input, fields, 0, cut), local_documents(input, fields, cut)
    else:
        cut = int(docs * (1 - val_fraction))
        train = itertools.islice(local_documents(input, fields), cut)
        val = itertools.islice(local_documents(input, fields), cut, None)
    return itertools.islice(train, max_docs or None), val


def prepare_text():
    if not input:
        common.die("prepare.py text needs --input=FILE (a .txt or .jsonl)")
    train_docs, val_docs = local_splits(input, val_input, fields)
    kind = tokenizer if tokenizer in ("gpt2", "char") else "hf"
    out = name or f"{os.path.splitext(os.path.basename(input))[0]}_{kind}"
    if kind == "hf":  # a pretrained model's own vocabulary (scripts/convert.py copies its tokenizer.json next to ckpt.pt)
        meta, encode_text = hf_meta(tokenizer)
        # its pre-tokenizer may join text across any cut (Llama 3's joins punctuation and the newlines after it), so
        # each split is encoded as one text, in memory
        encode = lambda docs: [encode_text("\n\n".join("".join(doc) for doc in docs))]
        write_dataset(out, {"train": encode(train_docs), "val": encode(val_docs)}, meta)
    elif kind == "char":  # the characters of the text, and the blank line that joins its documents: a pass to find them
        chars = set()
        for docs in (train_docs, val_docs):
            for i, doc in enumerate(docs):
                chars |= set("\n" if i else "").union(*doc)
        stoi = {ch: i for i, ch in enumerate(sorted(chars))}

        def encode(docs):
            for i, doc in enumerate(docs):
                yield from itertools.chain([[stoi["\n"]] * 2] if i else [], ([stoi[c] for c in piece] for piece in doc))
        meta = dict(vocab_size=len(chars), tokenizer="char", chars=sorted(chars))
        write_dataset(out, {split: encode(docs) for split, docs in
                            zip(("train", "val"), local_splits(input, val_input, fields))}, meta)
    else:
        write_gpt2(out, train_docs, val_docs)


def prepare_hub():
    spec = tokendata.HUB_DATASETS[source]
    copies = [tokendata.local_data(path) for path in spec["local"]]
    if all(copies):  # offline: as prepare.py text on the copies (the first the training file)
        print(f"{source}: reading {' and '.join(copies)} ({tokendata.LOCAL_DATA_ENV}) in place of the hub")
        write_gpt2(name or source, *local_splits(copies[0], copies[1] if len(copies) > 1 else "", spec["fields"]),
                   source=spec["path"], local_copies=copies)
        return
    datasets = load_datasets()
    offline = f"export {tokendata.LOCAL_DATA_ENV}=DIR with DIR/{' and DIR/'.join(spec['local'])}, or "

    def hub_failure(e):
        common.die(f"could not load {spec['path']} from the Hugging Face hub ({type(e).__name__}); offline, "
                   f"{offline}run python prepare.py text --input=FILE.jsonl --fields={','.join(spec['fields'])} "
                   f"--name={source} on a copy")

    def documents(split, limit):
        try:
            stream = datasets.load_dataset(spec["path"], split=split, streaming=True)
            for i, record in enumerate(stream):  # streamed: the hub can fail at any record
                if limit and i >= limit:
                    return
                yield [record_text(record, spec["fields"], f"{spec['path']} {split} record {i}")]
        except Exception as e:
            hub_failure(e)

    write_gpt2(name or source, documents(spec["train"], max_docs), documents(spec["val"], val_docs),
               source=spec["path"])


# ----------------------------------------------------------------------------------------------------------------
# FineWeb-Edu at the papers' scale: shards of shard_tokens tokens, tokenized by a pool of processes, resumable. Shard 0
# (val) holds the stream's first val_tokens tokens, shards 1, 2, ... (train) the next, shard_tokens each, cut at a
# token count (a document may continue in the next shard) until max_tokens. After each shard, progress.json records
# where the next one begins: a document, a token offset in it, and the datasets stream's state_dict() at an earlier
# document, which a rerun loads (datasets then skips whole parquet files, and the records of one) to read on from
# there. A kill at any instant leaves whole shards (each written as .tmp, then renamed) and a rerun writes the same
# bytes as an uninterrupted run.


def fineweb_failure(e, kept=""):
    common.die(f"could not read {tokendata.FINEWEB_EDU} {subset} ({type(e).__name__}){kept}; offline, export "
               f"{tokendata.LOCAL_DATA_ENV}=DIR with a copy of the hub's files in "
               f"DIR/fineweb-edu/{tokendata.FINEWEB_EDU_SUBSETS[subset]}/ (.parquet or .jsonl)")


def fineweb_stream():
    """(FineWeb-Edu's records of the chosen subset, a datasets streaming IterableDataset; where they come from): the
    hub, or under $NANOLATENT_LOCAL_DATA a copy of the hub's files (fineweb-edu/sample/10BT/*.parquet, or .jsonl) read
    by the same datasets call with the files named."""
    datasets = load_datasets()
    folder = tokendata.local_data(os.path.join("fineweb-edu", tokendata.FINEWEB_EDU_SUBSETS[subset]))
    if not folder:
        try:
            return datasets.load_dataset(tokendata.FINEWEB_EDU, name=subset, split="train", streaming=True), \
                f"{tokendata.FINEWEB_EDU} {subset}"
        except Exception as e:
            fineweb_failure(e)
    files = {ext: sorted(glob.glob(os.path.join(folder, "**", f"*.{ext}"), recursive=True))
             for ext in ("parquet", "jsonl")}
    builder, data_files = ("parquet", files["parquet"]) if files["parquet"] else ("json", files["jsonl"])
    if not data_files:
        common.die(f"{folder} ({tokendata.LOCAL_DATA_ENV}) holds no .parquet or .jsonl files of FineWeb-Edu {subset}")
    if builder == "json":
        check_fineweb_jsonl(folder)
    print(f"fineweb_edu: reading {len(data_files)} files under {folder} ({tokendata.LOCAL_DATA_ENV}) in place of "
          f"the hub")
    return datasets.load_dataset(builder, data_files=data_files, split="train", streaming=True), folder


def fineweb_text(line):
    """What is wrong with the `text` of a line of a local FineWeb-Edu .jsonl, or None."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return f"is not JSON ({e.msg})"
    if not isinstance(record, dict) or "text" not in record:
        return f"has no field 'text' (its fields: {', '.join(record) if isinstance(record, dict) else 'none'})"
    return None if isinstance(record["text"], str) else f"field 'text' holds {json.dumps(record['text'])[:60]}, " \
                                                          f"not a string"


def check_fineweb_jsonl(origin):
    """One line naming the first line of the local FineWeb-Edu .jsonl files under origin (read in the stream's order)
    whose `text` is missing or not a string, if any: before the stream, where the datasets library would make a list
    or an object its JSON text. Each file is read by pyarrow first (its C++ reader: seconds a GB); only a file whose
    `text` is not a string column without nulls is read again line by line, to name the line."""
    from pyarrow import json as arrow_json
    for path in sorted(glob.glob(os.path.join(origin, "**", "*.jsonl"), recursive=True)) if os.path.isdir(origin) else ():
        try:
            column = arrow_json.read_json(path).column("text")
            if str(column.type) == "string" and column.null_count == 0:
                continue
        except Exception:  # no such column, types that conflict, a line that is not JSON: found below
            pass
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.strip() and (what := fineweb_text(line)):
                    common.die(f"{path} line {number} {what}: FineWeb-Edu's documents are its 'text' strings; fix "
                               f"or drop that line")


def document_batches(stream, origin, start, size=1024):
    """(index of the first document, anchor, texts) for batches of documents from start["doc"] on. An anchor (document
    index, stream state) is where a rerun can load the stream and count documents from: the batch's first document,
    or in the first batch of a resumed run the anchor it resumed from."""
    anchor = (start["anchor_doc"], start["state"])
    doc, first, batch = start["anchor_doc"], start["doc"], []
    try:
        for record in stream:
            if not isinstance(record.get("text"), str):  # a worker's traceback otherwise, or a repr prepared
                check_fineweb_jsonl(origin)
                common.die(f"{origin}: FineWeb-Edu's document {doc} has no string 'text' (its fields: "
                           f"{', '.join(record)}); fix or drop that record")
            if doc >= start["doc"]:  # those before it are read again from the anchor, not tokenized
                batch.append(record["text"])
            doc += 1
            if len(batch) == size:
                yield first, anchor, batch
                first, anchor, batch = doc, (doc, stream.state_dict()), []
    except Exception as e:  # the hub may fail at any record; the datasets library at a local record of another type
        check_fineweb_jsonl(origin)
        fineweb_failure(e, "; the shards written whole are kept: the same command, run again, goes on")
    if batch:
        yield first, anchor, batch


def encoded(batches, bpe_file, processes):
    """(first document, anchor, tokens, lengths) of each batch, in order, encoded by a pool of processes (spawned, so
    the same on every platform), at most two batches a process ahead of the writer: the stream is read as fast as it
    is written, never into memory."""
    if processes == 1:  # the same code in this process
        tokendata.start_gpt2_process(bpe_file)
        yield from ((first, anchor, *tokendata.encode_gpt2_documents(texts)) for first, anchor, texts in batches)
        return
    pending = collections.deque()
    # an executor, not multiprocessing.Pool: a Pool terminated (as its `with` does) while batches are still being
    # queued can wait forever for its task thread, stuck in the input queue's put with the workers gone (seen here:
    # twice in 70 early stops); the executor cancels what no worker has begun and waits for the rest
    pool = concurrent.futures.ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"),
                                                  tokendata.start_gpt2_process, (bpe_file,))
    try:
        for first, anchor, texts in batches:
            pending.append((first, anchor, pool.submit(tokendata.encode_gpt2_documents, texts)))
            if len(pending) > 2 * processes:
                first, anchor, job = pending.popleft()
                yield first, anchor, *job.result()
        while pending:
            first, anchor, job = pending.popleft()
            yield first, anchor, *job.result()
    finally:  # the budget spent, or an error: the work ahead is dropped
        pool.shutdown(cancel_futures=True)


def write_atomically(path, write):
    """write(file) to path.tmp, then renamed to path: a kill leaves the old file or the new one, never a part."""
    with open(path + ".tmp", "wb" if path.endswith(".bin") else "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def finished_shards(out, settings):
    """The shards a previous run of the same command wrote whole (progress.json's, while their files are there), or
    None when the dataset is complete. Anything else in data/<name> is refused: nothing prepared is overwritten."""
    if os.path.exists(os.path.join(out, "meta.json")):
        with open(os.path.join(out, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("settings") != settings:
            common.die(f"{out} holds a dataset prepared otherwise ({meta.get('settings') or 'not in shards'}): give "
                       f"another --name, or remove the folder")
        if os.path.exists(os.path.join(out, "progress.json")):  # a kill came between meta.json and its removal
            os.remove(os.path.join(out, "progress.json"))
        return None
    if not os.path.exists(os.path.join(out, "progress.json")):
        return []
    with open(os.path.join(out, "progress.json")) as f:
        progress = json.load(f)
    if progress["settings"] != settings:
        common.die(f"{out} holds the shards of another preparation ({progress['settings']}): run that command again to "
                   f"finish it, give another --name, or remove the folder")
    intact = lambda shard: os.path.exists(path := os.path.join(out, shard["file"])) and \
        os.path.getsize(path) == 2 * shard["tokens"]
    return list(itertools.takewhile(intact, progress["shards"]))


def prepare_fineweb():
    if max_docs or val_docs:
        common.die("fineweb_edu takes token counts: --max_tokens (training) and --val_tokens, not --max_docs or "
                   "--val_docs")
    for key, value in dict(max_tokens=max_tokens, shard_tokens=shard_tokens, val_tokens=val_tokens).items():
        if not float(value).is_integer():
            common.die(f"--{key} is a number of tokens, got {value!r}")
    out = tokendata.data_dir(name or source)
    encoding, local_bpe = tokendata.gpt2_encoding(bpe_file)
    stream, origin = fineweb_stream()
    settings = dict(source=origin, subset=subset, max_tokens=int(max_tokens), shard_tokens=int(shard_tokens),
                    val_tokens=int(val_tokens))  # what a rerun must repeat to write the same bytes
    shards = finished_shards(out, settings)
    if shards is None:
        print(f"{out} is prepared already: nothing to do")
        return
    if shards:
        print(f"{out}: {len(shards)} shards written before, going on from shard {len(shards)}")
    start = shards[-1]["next"] if shards else dict(doc=0, offset=0, anchor_doc=0, state=None)
    if start["state"] is not None:
        stream.load_state_dict(start["state"])

    def size(k):  # tokens of shard k: 0 for none (the budget is spent)
        if k == 0:
            return int(val_tokens)
        budget = int(max_tokens) - (k - 1) * int(shard_tokens) if max_tokens else int(shard_tokens)
        return max(0, min(int(shard_tokens), budget))

    began, resumed = time.time(), len(shards)  # the rate a long run reports, its start-up included

    def write(buffer, next):
        split = "val" if len(shards) == 0 else "train"
        os.makedirs(out, exist_ok=True)  # at the first shard: a record refused before it leaves no empty folder
        shards.append(dict(file=f"{split}_{len(shards):06d}.bin", tokens=len(buffer), next=next))
        write_atomically(os.path.join(out, shards[-1]["file"]), lambda f: f.write(buffer.tobytes()))
        write_atomically(os.path.join(out, "progress.json"), lambda f: json.dump(
            dict(settings=settings, shards=shards), f))
        rate = sum(shard["tokens"] for shard in shards[resumed:]) / (time.time() - began)
        print(f"wrote {shards[-1]['file']} ({len(buffer):,} tokens; {rate:,.0f} tokens/s since this run began)")

    buffer, fill = np.empty(size(len(shards)), dtype=np.uint16), 0
    try:
        batches = document_batches(stream, origin, start) if len(buffer) else ()  # () when a kill came after the last shard
        for first, anchor, tokens, lengths in encoded(batches, local_bpe, num_proc or os.cpu_count()):
            ends = np.cumsum(lengths)
            position = start["offset"] if first == start["doc"] else 0  # a resumed run's first document: its rest
            while position < len(tokens) and len(buffer):
                take = min(len(tokens) - position, len(buffer) - fill)
                buffer[fill:fill + take] = tokens[position:position + take]
                fill, position = fill + take, position + take
                if fill == len(buffer):  # the next shard begins at this token of document first + j
                    j = int(np.searchsorted(ends, position, side="right"))
                    offset = position - (int(ends[j - 1]) if j else 0)
                    write(buffer, dict(doc=first + j, offset=offset, anchor_doc=anchor[0], state=anchor[1]))
                    buffer, fill = np.empty(size(len(shards)), dtype=np.uint16), 0
            if not len(buffer):  # the budget is spent: the pool's work ahead is dropped
                break
        else:  # the subset ended: its last tokens are the last shard
            if fill:
                write(buffer[:fill], dict(doc=first + len(lengths), offset=0, anchor_doc=anchor[0], state=anchor[1]))
            if len(shards) < 2:
                common.die(f"FineWeb-Edu {subset} ended after {sum(s['tokens'] for s in shards):,} tokens, within the "
                           f"validation shard: lower --val_tokens")
    except OSError as e:
        common.die(f"could not write {e.filename or out}: {e.strerror or e}{common.free_space(out)}; the shards "
                   f"written whole are kept: run the same command again to go on")
    split = lambda name: [shard["file"] for shard in shards if shard["file"].startswith(name)]
    meta = dict(vocab_size=encoding.n_vocab, tokenizer="gpt2", bpe_file=local_bpe and os.path.abspath(local_bpe),
                dtype="uint16", source=tokendata.FINEWEB_EDU, settings=settings,
                shards=dict(val=split("val"), train=split("train")),
                val_tokens=shards[0]["tokens"], train_tokens=sum(shard["tokens"] for shard in shards[1:]))
    write_atomically(os.path.join(out, "meta.json"), lambda f: json.dump(meta, f, indent=1))
    os.remove(os.path.join(out, "progress.json"))
    if max_tokens and meta["train_tokens"] < int(max_tokens):
        print(f"FineWeb-Edu {subset} holds {meta['train_tokens']:,} training tokens, fewer than --max_tokens: a larger "
              f"--subset holds more")
    print(f"wrote {out}: {meta['val_tokens']:,} validation tokens, {meta['train_tokens']:,} training tokens in "
          f"{len(meta['shards']['train'])} shards")


PREPARE = {"synthetic": prepare_synthetic, "arith": prepare_arith, "text": prepare_text,
           **{hub: prepare_hub for hub in tokendata.HUB_DATASETS}, "fineweb_edu": prepare_fineweb}
if __name__ == "__main__":  # not in prepare_fineweb's tokenizing processes, which import this file (spawn)
    if source not in PREPARE:
        common.die(f"what to prepare? the first argument is one of {', '.join(PREPARE)}"
                   + (f", got {source!r}" if source else "") + " (e.g. python prepare.py synthetic)")
    if vocab == "used" and (source in ("synthetic", "arith", "fineweb_edu") or tokenizer != "gpt2"):
        common.die(f"--vocab=used renumbers GPT-2 BPE ids: it applies to text with --tokenizer=gpt2 and to hub "
                   f"datasets, not to {source} with --tokenizer={tokenizer}")
    PREPARE[source]()
