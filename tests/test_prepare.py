"""prepare.py: the synthetic task's format, local text files, the GPT-2 path with the offline BPE file, its refusals
(one line each, nothing written), and fineweb_edu's shards."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, LOCAL_DATA, assert_one_line_error, needs_local, run_script

from nanolatent import common, tokendata

GPT2_BPE = os.path.join(LOCAL_DATA, "gpt2", "gpt2.tiktoken")
SHAKESPEARE = os.path.join(LOCAL_DATA, "tinyshakespeare", "input.txt")


def read(data_root, name, split):
    with open(os.path.join(data_root, name, "meta.json")) as f:
        meta = json.load(f)
    return np.fromfile(os.path.join(data_root, name, f"{split}.bin"), dtype=meta["dtype"]), meta


@pytest.mark.slow
def test_synthetic_sequences_follow_the_papers_recipe(data_root):
    tokens, meta = read(data_root, "synthetic", "train")
    text = "".join(meta["chars"][i] for i in tokens)
    docs = text.split("\n")[:-1]
    assert len(docs) == 2000 and meta["doc_len"] == 67 and all(len(d) == 66 for d in docs)
    bodies = [d[2:] for d in docs]
    assert all(re.fullmatch(r"[A-Z]>[_!A-Z]{64}", d) for d in docs)
    assert all(set(b) - {"_", "!"} <= {d[0]} for d, b in zip(docs, bodies))  # only the prompt's letter appears
    noise = sum(b.count("!") for b in bodies) / (64 * len(bodies))
    assert abs(noise - 1 / 16) < 0.005
    letters = sum(b.count(d[0]) for d, b in zip(docs, bodies)) / len(bodies)
    assert abs(letters - 8 * 15 / 16) < 0.1  # 8 target letters, each kept with probability 15/16
    runs = [re.search(d[0] + "{8}", b) for d, b in zip(docs, bodies)]
    assert 0.55 < np.mean([r is not None for r in runs]) < 0.65  # (15/16)^8 = 0.597 are intact
    starts = [r.start() for r in runs if r]
    assert min(starts) == 0 and max(starts) == 56


@pytest.mark.slow
def test_synthetic_is_seeded(tmp_path):
    for name in ("a", "b"):
        run_script("prepare.py", "synthetic", "--num_train=50", "--num_val=5", f"--name={name}", data_dir=tmp_path)
    assert np.array_equal(read(tmp_path, "a", "train")[0], read(tmp_path, "b", "train")[0])


@pytest.mark.slow
def test_char_text_round_trips_and_splits_ninety_ten(tmp_path):
    text = "hello world, the quick brown fox.\n" * 30
    (tmp_path / "in.txt").write_text(text)
    run_script("prepare.py", "text", f"--input={tmp_path / 'in.txt'}", "--tokenizer=char", "--name=t", data_dir=tmp_path)
    train, meta = read(tmp_path, "t", "train")
    val, _ = read(tmp_path, "t", "val")
    encode, decode = tokendata.tokenizer(meta)
    assert decode(train.tolist()) + decode(val.tolist()) == text
    assert len(train) == int(len(text) * 0.9) and encode("fox") == [meta["chars"].index(c) for c in "fox"]


@pytest.mark.slow
def test_jsonl_fields_become_one_document_each(tmp_path):
    rows = [{"prompt": f"p{i}", "story": f"s{i}", "other": 1} for i in range(10)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_script("prepare.py", "text", f"--input={tmp_path / 'in.jsonl'}", "--fields=prompt,story", "--tokenizer=char",
               "--name=j", data_dir=tmp_path)
    val, meta = read(tmp_path, "j", "val")
    assert "".join(meta["chars"][i] for i in val) == "p9\n\ns9"
    proc = run_script("prepare.py", "text", f"--input={tmp_path / 'in.jsonl'}", "--fields=title", data_dir=tmp_path,
                      check=False)
    assert proc.returncode == 2 and "available: prompt, story, other" in proc.stderr


@pytest.mark.slow
@needs_local("gpt2/gpt2.tiktoken")
def test_gpt2_tokenization_of_tiny_shakespeare_matches_the_reference_counts(tmp_path):
    run_script("prepare.py", "text", f"--input={SHAKESPEARE}", f"--bpe_file={GPT2_BPE}", "--name=s",
               data_dir=tmp_path)
    train, meta = read(tmp_path, "s", "train")
    val, _ = read(tmp_path, "s", "val")
    # reference 301,966 / 36,059 tokens, plus the <|endoftext|> that closes each document
    assert (len(train), len(val)) == (301_967, 36_060) and train[-1] == val[-1] == 50256
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16"
    encode, decode = tokendata.tokenizer(meta)
    assert encode("Hello world") == [15496, 995] and decode(train[:200].tolist()) in open(SHAKESPEARE).read()


@pytest.mark.slow
@needs_local("gpt2/gpt2.tiktoken")
def test_gpt2_text_read_in_blocks_has_the_tokens_of_the_whole_text(tmp_path):
    """A .txt of 1.3 MB, read in 1 MiB blocks and encoded piece by piece, against tiktoken's encoding of the whole
    text (its first 90% of characters, then the rest): whitespace runs, CRLF and 2-byte characters at any cut."""
    rng = np.random.default_rng(0)
    parts = np.array(["word", "é", " ", "  ", "\n", "\n\n", " \n", "\r\n", "\t", "'s", "42", "."])
    (tmp_path / "in.txt").write_bytes("".join(rng.choice(parts, size=700_000)).encode())
    run_script("prepare.py", "text", f"--input={tmp_path / 'in.txt'}", f"--bpe_file={GPT2_BPE}", "--name=s",
               data_dir=tmp_path)
    text = open(tmp_path / "in.txt", encoding="utf-8").read()  # newlines as Python reads them, "\r\n" as "\n"
    cut, encoding = int(len(text) * 0.9), tokendata.gpt2_from_file(GPT2_BPE)
    assert read(tmp_path, "s", "train")[0].tolist() == encoding.encode_ordinary(text[:cut]) + [50256]
    assert read(tmp_path, "s", "val")[0].tolist() == encoding.encode_ordinary(text[cut:]) + [50256]


@pytest.mark.slow
@needs_local("gpt2/gpt2.tiktoken")
def test_gpt2_used_vocabulary_renumbers_the_ids_that_occur_and_round_trips(tmp_path):
    rows = [{"text": f"The {w} sat on the mat, story {i}."} for i, w in enumerate(["cat", "dog", "owl"] * 4)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["prepare.py", "text", f"--input={tmp_path / 'in.jsonl'}", f"--bpe_file={GPT2_BPE}", "--max_docs=6"]
    run_script(*args, "--name=full", data_dir=tmp_path)
    run_script(*args, "--name=used", "--vocab=used", data_dir=tmp_path)
    full = {split: read(tmp_path, "full", split)[0] for split in ("train", "val")}
    used = {split: read(tmp_path, "used", split)[0] for split in ("train", "val")}
    _, meta = read(tmp_path, "used", "train")
    ids = np.array(meta["token_ids"])
    # exactly the GPT-2 ids of the text, sorted, renumbered from 0; max_docs kept 6 of the 10 training stories
    assert ids.tolist() == sorted(set(full["train"].tolist()) | set(full["val"].tolist()))
    assert meta["vocab_size"] == len(ids) < 60 and full["train"].tolist().count(50256) == 6
    assert all(np.array_equal(ids[used[s]], full[s]) for s in used)
    encode, decode = tokendata.tokenizer(meta)
    assert decode(used["val"].tolist()) == "".join(f"The {w} sat on the mat, story {i}.<|endoftext|>"
                                                   for i, w in ((10, "dog"), (11, "owl")))
    assert ids[encode("The dog sat")].tolist() == [464, 3290, 3332]
    with pytest.raises(SystemExit):  # a word the dataset never uses has no id
        encode("The giraffe")


@needs_local("gpt2/gpt2.tiktoken")
def test_gpt2_falls_back_to_the_environment_variables_when_the_download_fails(tmp_path, monkeypatch):
    import tiktoken
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: (_ for _ in ()).throw(ConnectionError("offline")))
    monkeypatch.delenv(tokendata.LOCAL_DATA_ENV, raising=False)
    monkeypatch.setenv(tokendata.GPT2_BPE_ENV, GPT2_BPE)
    encoding, used = tokendata.gpt2_encoding()
    assert used == GPT2_BPE and encoding.encode("Hello world") == [15496, 995]
    monkeypatch.delenv(tokendata.GPT2_BPE_ENV)
    with pytest.raises(SystemExit):
        tokendata.gpt2_encoding()
    monkeypatch.setenv(tokendata.LOCAL_DATA_ENV, LOCAL_DATA)  # the folder of local copies: gpt2/gpt2.tiktoken in it
    encoding, used = tokendata.gpt2_encoding()
    assert used == os.path.join(LOCAL_DATA, "gpt2", "gpt2.tiktoken") and encoding.encode("Hello world") == [15496, 995]


@pytest.mark.slow
@needs_local("gpt2")
def test_byte_level_spelling_equals_gpt2s_own_encoder_json():
    with open(os.path.join(LOCAL_DATA, "gpt2", "encoder.json")) as f:
        encoder = json.load(f)
    encoding = tokendata.gpt2_encoding(GPT2_BPE)[0]
    spelled = {tokendata.byte_level(encoding.decode_single_token_bytes(i)): i for i in range(50257)}
    assert spelled == encoder


@pytest.mark.slow
def test_arith_problems_are_correct_and_validation_never_occurs_in_training(tmp_path):
    run_script("prepare.py", "arith", "--num_train=3000", "--num_val=300", data_dir=tmp_path)
    lines = {}
    for split in ("train", "val"):
        tokens, meta = read(tmp_path, "arith", split)
        lines[split] = "".join(meta["chars"][i] for i in tokens).splitlines()
    assert len(lines["train"]) == 3000 and len(lines["val"]) == 300 and meta["task"] == "arith"
    assert not set(lines["train"]) & set(lines["val"])
    for line in lines["train"] + lines["val"]:
        a, op, b, answer = re.fullmatch(r"(\d{2,3})([+*])(\d{2,3})=(\d+)", line).groups()
        assert int(answer) == (int(a) + int(b) if op == "+" else int(a) * int(b))
    assert {line[line.index("+") if "+" in line else line.index("*")] for line in lines["val"]} == {"+", "*"}


@pytest.mark.slow
def test_arith_data_is_the_same_whatever_the_string_hash_seed(tmp_path, monkeypatch):
    """The problems' order depends on the seed alone: Python's per-process string hashing must not reach it."""
    for hash_seed in ("1", "2"):
        monkeypatch.setenv("PYTHONHASHSEED", hash_seed)
        run_script("prepare.py", "arith", "--num_train=200", "--num_val=20", f"--name=a{hash_seed}", data_dir=tmp_path)
    assert all((tmp_path / "a1" / f"{s}.bin").read_bytes() == (tmp_path / "a2" / f"{s}.bin").read_bytes()
               for s in ("train", "val"))


@pytest.mark.slow
@needs_local("gpt2/gpt2.tiktoken")
@pytest.mark.parametrize("source, as_text", [
    ("writingprompts", ["writingprompts/wp_sample_train.jsonl",
                        "--val_input={local}/writingprompts/wp_sample_test.jsonl", "--fields=prompt,story"]),
    ("tinystories", ["tinystories/tinystories_head_197k.txt"]),
])
def test_a_hub_dataset_reads_its_local_copies_as_prepare_text_would(source, as_text, tmp_path):
    """Under NANOLATENT_LOCAL_DATA the hub names the docs list are prepared from the copies, without the hub: the
    tokens prepare.py text writes from the same files."""
    local = os.environ[tokendata.LOCAL_DATA_ENV]
    proc = run_script("prepare.py", source, f"--bpe_file={GPT2_BPE}", "--max_docs=50", data_dir=tmp_path)
    assert f"reading {local}/{as_text[0]}" in proc.stdout
    run_script("prepare.py", "text", f"--input={local}/{as_text[0]}", *[a.format(local=local) for a in as_text[1:]],
               f"--bpe_file={GPT2_BPE}", "--max_docs=50", "--name=as_text", data_dir=tmp_path)
    for split in ("train", "val"):
        assert (tmp_path / source / f"{split}.bin").read_bytes() == (tmp_path / "as_text" / f"{split}.bin").read_bytes()
    assert len(read(tmp_path, source, "train")[0]) > 10_000


@pytest.mark.slow
@needs_local("gpt2/gpt2.tiktoken")
def test_a_hub_failure_names_the_offline_variable_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(tokendata.LOCAL_DATA_ENV, str(tmp_path / "copies"))  # a folder without the copies
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub unreachable at once, as on a machine without a network
    proc = run_script("prepare.py", "tinystories", f"--bpe_file={GPT2_BPE}", data_dir=tmp_path / "data", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "export NANOLATENT_LOCAL_DATA=DIR with DIR/tinystories/tinystories_head_197k.txt" in proc.stderr
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").rglob("*"))  # not even a .tmp


@pytest.mark.slow
def test_a_full_disk_leaves_the_dataset_prepared_before_and_no_tmp(tmp_path):
    """A write that fails (here a .tmp that is /dev/full, so the real ENOSPC) ends in one line; the files of the
    dataset prepared earlier under that name are untouched, since every file is moved into place only once all are
    whole."""
    (tmp_path / "in.txt").write_text("some text, enough of it\n" * 20)
    prepare = ["prepare.py", "text", f"--input={tmp_path / 'in.txt'}", "--tokenizer=char", "--name=x"]
    run_script(*prepare, data_dir=tmp_path / "data")
    before = {p.name: p.read_bytes() for p in (tmp_path / "data" / "x").iterdir()}
    (tmp_path / "in.txt").write_text("other words entirely\n" * 20)
    os.symlink("/dev/full", tmp_path / "data" / "x" / "val.bin.tmp")
    proc = run_script(*prepare, data_dir=tmp_path / "data", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"could not write {tmp_path / 'data' / 'x' / 'val.bin'}: No space left on device" in proc.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "data" / "x").iterdir()} == before


@pytest.mark.slow
@pytest.mark.parametrize("line, phrase", [
    ('["a", "list"]', "line 2 is a JSON list, not an object"),
    ('"a string"', "line 2 is a JSON str, not an object"),
])
def test_a_jsonl_line_that_is_not_an_object_is_one_line(line, phrase, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    proc = run_script("prepare.py", "text", f"--input={tmp_path / 'in.jsonl'}", "--tokenizer=char", "--name=x",
                      data_dir=tmp_path / "data", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and phrase in proc.stderr, proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
def test_char_documents_without_a_newline_keep_the_blank_line_that_joins_them(tmp_path):
    """WritingPrompts' --fields=prompt: no document holds a newline, yet documents are joined by one blank line."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(10)))
    run_script("prepare.py", "text", f"--input={tmp_path / 'in.jsonl'}", "--fields=prompt", "--tokenizer=char",
               "--name=p", data_dir=tmp_path)
    train, meta = read(tmp_path, "p", "train")
    assert tokendata.tokenizer(meta)[1](train.tolist()) == "\n\n".join(f"p{i}" for i in range(9))
    assert "\n" in meta["chars"] and len(read(tmp_path, "p", "val")[0]) == 2  # "p9"


@pytest.mark.slow
def test_an_empty_gpt2_bpe_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "gpt2.tiktoken").write_bytes(b"")
    (tmp_path / "in.txt").write_text("some text\n")
    proc = run_script("prepare.py", "text", f"--input={tmp_path / 'in.txt'}",
                      f"--bpe_file={tmp_path / 'gpt2.tiktoken'}", "--name=x", data_dir=tmp_path / "data", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{tmp_path / 'gpt2.tiktoken'} is not GPT-2's BPE in tiktoken's format (0 tokens" in proc.stderr
    assert not (tmp_path / "data").exists()


def test_prepared_data_lives_in_data_at_the_repository_root_unless_the_variable_says_otherwise(monkeypatch):
    monkeypatch.delenv("NANOLATENT_DATA", raising=False)
    assert tokendata.data_dir("synthetic") == os.path.join(ROOT, "data", "synthetic")  # where prepare.py writes
    monkeypatch.setenv("NANOLATENT_DATA", "/elsewhere")
    assert tokendata.data_dir("synthetic") == os.path.join("/elsewhere", "synthetic")


@pytest.mark.slow
def test_prepare_without_a_source_says_which_there_are(tmp_path):
    assert_one_line_error(run_script("prepare.py", data_dir=tmp_path, check=False), "synthetic, arith, text")


@pytest.mark.slow
@pytest.mark.parametrize("name, content, phrase", [
    ("empty.txt", b"", "holds no text"),
    ("latin1.txt", "caf\xe9 au lait\n".encode("latin-1"), "is not UTF-8 text"),
    ("broken.jsonl", b'{"text": "fine"}\n{"text": broken\n', "could not be parsed"),
    ("missing.txt", None, "not found"),
])
def test_prepare_bad_input_is_one_line_and_writes_nothing(name, content, phrase, tmp_path):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    proc = run_script("prepare.py", "text", f"--input={tmp_path / name}", "--tokenizer=char", "--name=x",
                      data_dir=tmp_path / "data", check=False)
    assert_one_line_error(proc, phrase, name)
    assert not (tmp_path / "data" / "x").exists()


@pytest.mark.slow
def test_prepare_input_that_is_a_folder_says_so(tmp_path):
    proc = run_script("prepare.py", "text", f"--input={tmp_path}", "--tokenizer=char", "--name=x",
                      data_dir=tmp_path / "data", check=False)
    assert_one_line_error(proc, f"input '{tmp_path}' is a folder: give one .txt or .jsonl file inside it")
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args, phrase", [
    (["--vocab=some"], "--vocab must be one of full, used"),
    (["--vocab=used"], "--vocab=used renumbers GPT-2 BPE ids"),  # a char vocabulary is already what the text uses
])
def test_prepare_bad_vocab_is_one_line_and_writes_nothing(args, phrase, tmp_path):
    (tmp_path / "in.txt").write_text("some text\n")
    proc = run_script("prepare.py", "text", f"--input={tmp_path / 'in.txt'}", "--tokenizer=char", "--name=x", *args,
                      data_dir=tmp_path / "data", check=False)
    assert_one_line_error(proc, phrase)
    assert not (tmp_path / "data" / "x").exists()


@pytest.mark.slow
def test_prepare_vocab_used_on_a_char_task_is_one_line(tmp_path):
    proc = run_script("prepare.py", "synthetic", "--vocab=used", data_dir=tmp_path / "data", check=False)
    assert_one_line_error(proc, "--vocab=used renumbers GPT-2 BPE ids", "not to synthetic")
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fraction", ["1.5", "0", "1"])
def test_prepare_val_fraction_outside_0_1_is_one_line(fraction, tmp_path):
    (tmp_path / "in.txt").write_text("some text\n" * 10)
    proc = run_script("prepare.py", "text", f"--input={tmp_path / 'in.txt'}", "--tokenizer=char", "--name=x",
                      f"--val_fraction={fraction}", data_dir=tmp_path / "data", check=False)
    assert_one_line_error(proc, f"--val_fraction must lie in (0, 1), got {float(fraction)}")
    assert not (tmp_path / "data").exists()


# ----------------------------------------------------------------------------------------------------------------
# prepare.py fineweb_edu: shards, a pool of processes, kills and reruns, on a local copy read by the same datasets calls

FINEWEB = ["prepare.py", "fineweb_edu", f"--bpe_file={GPT2_BPE}", "--val_tokens=3000", "--shard_tokens=9000"]
needs_bpe = needs_local("gpt2/gpt2.tiktoken")


def fineweb_texts(subset_seed, n):
    """n documents of words and the whitespace GPT-2's BPE merges (blank lines, runs of spaces)."""
    rng = np.random.default_rng(subset_seed)
    words = np.array("the of and a to in is that for it as was with be by on not this are or from at which".split()
                     + ["  ", "\n", "\n\n", "3.14", "l'été"])
    return [" ".join(rng.choice(words, size=rng.integers(3, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def fineweb_copy(tmp_path_factory):
    """A local FineWeb-Edu copy in the hub's layout: sample-10BT as 4 parquet files (row groups of 100 records, as
    the hub's files hold many), sample-100BT as 2 .jsonl files; and the GPT-2 tokens each subset's stream must have."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    root = tmp_path_factory.mktemp("copies")
    expected = {}
    for subset, files, ext in (("sample-10BT", 4, "parquet"), ("sample-100BT", 2, "jsonl")):
        folder = root / "fineweb-edu" / tokendata.FINEWEB_EDU_SUBSETS[subset]
        folder.mkdir(parents=True)
        texts = fineweb_texts(len(expected), 1100 * files)
        for k in range(files):
            part = texts[1100 * k:1100 * (k + 1)]
            if ext == "parquet":
                pq.write_table(pa.table({"text": part, "id": [f"{k}-{i}" for i in range(len(part))]}),
                               folder / f"{k:03d}_00000.parquet", row_group_size=100)
            else:
                (folder / f"{k:03d}_00000.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        encoding = tokendata.gpt2_from_file(GPT2_BPE)
        expected[subset] = np.array([t for text in texts for t in encoding.encode_ordinary(text) + [50256]])
    return root, expected


def fineweb(copy, data, *args, check=True):
    """prepare.py fineweb_edu with the local copy as $NANOLATENT_LOCAL_DATA."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(tokendata.LOCAL_DATA_ENV, str(copy))
        return run_script(*FINEWEB, *args, data_dir=data, check=check)


def shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def fineweb_run(fineweb_copy, tmp_path_factory):
    """An uninterrupted run by 2 processes with a budget of 120,000 training tokens (of the copy's 185,124): 13 shards
    of 9,000 and one of 3,000, the documents of 3 of its 4 files."""
    data = tmp_path_factory.mktemp("data")
    proc = fineweb(fineweb_copy[0], data, "--max_tokens=1.2e5", "--num_proc=2")
    return data / "fineweb_edu", proc.stdout


@pytest.mark.slow
@needs_bpe
def test_fineweb_edu_shards_are_the_subsets_tokens_in_order_cut_at_the_budget(fineweb_copy, fineweb_run):
    folder, stdout = fineweb_run
    expected = fineweb_copy[1]["sample-10BT"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["shards"] == {"val": ["val_000000.bin"], "train": [f"train_{k:06d}.bin" for k in range(1, 15)]}
    sizes = [len(np.fromfile(folder / f, dtype=np.uint16)) for f in meta["shards"]["train"]]
    assert sizes == [9000] * 13 + [3000] and (meta["train_tokens"], meta["val_tokens"]) == (120_000, 3000)
    stream = np.concatenate([np.fromfile(folder / f, dtype=np.uint16)
                             for f in meta["shards"]["val"] + meta["shards"]["train"]])
    assert np.array_equal(stream, expected[:123_000])  # documents in the copy's order, each closed by <|endoftext|>
    assert sorted(p.name for p in folder.iterdir()) == sorted(["meta.json", "val_000000.bin", *meta["shards"]["train"]])
    assert f"reading 4 files under {fineweb_copy[0]}/fineweb-edu/sample/10BT" in stdout


@pytest.mark.slow
@needs_bpe
def test_fineweb_edu_in_one_process_writes_the_bytes_of_two(fineweb_copy, fineweb_run, tmp_path):
    fineweb(fineweb_copy[0], tmp_path, "--max_tokens=1.2e5", "--num_proc=1")
    assert shard_bytes(tmp_path / "fineweb_edu") == shard_bytes(fineweb_run[0])


# python -c STOP_EARLY BPE: prepare.py's encoder pool stopped two batches in with more submitted (as a spent budget
# stops it); prints the processes still alive, then whether the two batches are those one process encodes
STOP_EARLY = """import multiprocessing, runpy, sys
bpe, sys.argv = sys.argv[1], ["prepare.py"]
encoded = runpy.run_path("prepare.py", run_name="prepare")["encoded"]
batches = lambda: ((k, None, [f"document {k}.{j}: " + "the quick brown fox " * 400 for j in range(40)]) for k in range(50))
stream = encoded(batches(), bpe, 2)
got = [next(stream) for _ in range(2)]
stream.close()
alone = encoded(batches(), bpe, 1)
print(len(multiprocessing.active_children()), all(
    (a[0], a[2].tolist(), list(a[3])) == (b[0], b[2].tolist(), list(b[3])) for a, b in zip(got, [next(alone), next(alone)])))
"""


@pytest.mark.slow
@needs_bpe
def test_the_encoder_pool_stopped_with_work_in_flight_exits_with_its_workers():
    """A spent budget stops reading the pool's results with batches still queued and large ones being written to the
    workers: the pool shuts down, no worker is left, and the batches read are those one process encodes."""
    job = subprocess.run([sys.executable, "-c", STOP_EARLY, GPT2_BPE], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (job.returncode, job.stdout) == (0, "0 True\n"), job.stdout + job.stderr[-3000:]


# python -c KILL_BEFORE_RENAME N prepare.py ARGS: prepare.py with a SIGKILL of its whole job (itself and its pool, the
# process group of a session of its own) injected before its Nth os.replace, the step that makes a file whole
KILL_BEFORE_RENAME = """import os, runpy, signal, sys
kill_at, calls, replace = int(sys.argv[1]), [0], os.replace
def killing(*args, **kwargs):
    calls[0] += 1
    if calls[0] == kill_at:
        os.killpg(0, signal.SIGKILL)
    return replace(*args, **kwargs)
os.replace, sys.argv = killing, sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@needs_bpe
def test_fineweb_edu_killed_three_times_and_rerun_writes_the_uninterrupted_bytes(fineweb_copy, fineweb_run, tmp_path):
    """A shard renamed but not yet in progress.json, a shard written but not renamed, every shard written but not
    meta.json: the same command, run again after each SIGKILL, skips the shards recorded whole, reads on from where
    they end (the stream's saved state, in the middle of the copy's second file), and finishes with the bytes of the
    uninterrupted run."""
    folder = tmp_path / "fineweb_edu"
    env = {**os.environ, "NANOLATENT_DATA": str(tmp_path), tokendata.LOCAL_DATA_ENV: str(fineweb_copy[0]),
           "OMP_NUM_THREADS": "1"}
    # renames, in order: val, progress, train_1, progress, ...; then (1 to 3) as counted again by each rerun
    for kill_at, recorded in ((20, 9), (5, 11), (9, 15)):  # before progress lists train_9; before train_11; meta.json
        job = subprocess.run([sys.executable, "-c", KILL_BEFORE_RENAME, str(kill_at), *FINEWEB, "--max_tokens=1.2e5",
                              "--num_proc=2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                             start_new_session=True)
        assert job.returncode == -signal.SIGKILL, job.stderr[-3000:]
        assert len(json.loads((folder / "progress.json").read_text())["shards"]) == recorded
        assert not (folder / "meta.json").exists()
    progress = (folder / "progress.json").read_text()
    proc = fineweb(fineweb_copy[0], tmp_path, "--max_tokens=1.2e5", "--num_proc=2")
    assert "15 shards written before" in proc.stdout
    assert shard_bytes(folder) == shard_bytes(fineweb_run[0])  # and no .tmp, no progress.json
    (folder / "progress.json").write_text(progress)  # as a kill between meta.json and progress.json's removal leaves it
    assert "prepared already" in fineweb(fineweb_copy[0], tmp_path, "--max_tokens=1.2e5").stdout
    assert shard_bytes(folder) == shard_bytes(fineweb_run[0])


@pytest.mark.slow
@needs_bpe
def test_fineweb_edu_subset_reads_its_own_files_and_without_a_budget_all_of_them(fineweb_copy, tmp_path):
    fineweb(fineweb_copy[0], tmp_path, "--subset=sample-100BT", "--name=fw100", "--num_proc=1")
    meta = json.loads((tmp_path / "fw100" / "meta.json").read_text())
    stream = np.concatenate([np.fromfile(tmp_path / "fw100" / f, dtype=np.uint16)
                             for f in meta["shards"]["val"] + meta["shards"]["train"]])
    assert np.array_equal(stream, fineweb_copy[1]["sample-100BT"])  # the .jsonl files, to their last token
    assert meta["settings"]["subset"] == "sample-100BT" and meta["train_tokens"] == len(stream) - 3000


@pytest.mark.slow
@needs_bpe
@pytest.mark.parametrize("args, phrase", [
    (["--subset=sample-1BT"], "--subset must be one of sample-10BT, sample-100BT, sample-350BT, default"),
    (["--max_tokens=-1"], "--max_tokens must be >= 0"),
    (["--shard_tokens=0"], "--shard_tokens must be > 0"),
    (["--val_tokens=0.5"], "--val_tokens is a number of tokens, got 0.5"),
    (["--max_docs=10"], "fineweb_edu takes token counts"),
])
def test_fineweb_edu_bad_settings_are_one_line_and_write_nothing(args, phrase, fineweb_copy, tmp_path):
    proc = fineweb(fineweb_copy[0], tmp_path / "data", *args, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and phrase in proc.stderr, proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
@needs_bpe
def test_fineweb_edu_without_the_hub_or_a_copy_is_one_line_naming_the_copys_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub unreachable at once, as on a machine without a network
    proc = fineweb(tmp_path / "copies", tmp_path / "data", "--subset=sample-350BT", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "export NANOLATENT_LOCAL_DATA=DIR with a copy of the hub's files in DIR/fineweb-edu/sample/350BT/" in proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
@needs_bpe
def test_fineweb_edu_other_settings_on_a_prepared_name_are_refused_and_it_is_kept(fineweb_copy, fineweb_run, tmp_path):
    shutil.copytree(fineweb_run[0], tmp_path / "fineweb_edu")
    proc = fineweb(fineweb_copy[0], tmp_path, "--max_tokens=1.3e5", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "give another --name" in proc.stderr, proc.stderr
    assert shard_bytes(tmp_path / "fineweb_edu") == shard_bytes(fineweb_run[0])


@pytest.mark.slow
@needs_bpe
def test_train_py_trains_on_the_shards_as_one_stream(fineweb_run, tmp_path):
    shutil.copytree(fineweb_run[0], tmp_path / "fineweb_edu")
    proc = run_script("train.py", "--dataset=fineweb_edu", "--model_type=det", f"--out_dir={tmp_path / 'out'}",
                      "--n_layer=1", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--block_size=64",
                      "--batch_size=4", "--max_iters=3", "--eval_interval=3", "--eval_iters=2", "--log_interval=1",
                      "--warmup_iters=1", "--lr_decay_iters=3", data_dir=tmp_path)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 3 and all(9 < loss < 12 for loss in losses), proc.stdout  # ln(50257) = 10.8 at the start


def test_shards_read_as_one_stream_across_their_boundaries(tmp_path):
    meta = {"dtype": "uint16", "shards": {"train": ["a.bin", "b.bin", "c.bin"]}}
    stream = np.arange(23, dtype=np.uint16)
    for file, part in zip(meta["shards"]["train"], np.split(stream, [10, 13])):
        part.tofile(tmp_path / file)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NANOLATENT_DATA", str(tmp_path.parent))
        data = tokendata.load_tokens(tmp_path.name, "train", meta)
    assert len(data) == 23
    for i, j in [(0, 23), (8, 12), (9, 14), (10, 13), (12, 12), (20, 23), (-5, None)]:
        assert np.array_equal(data[i:j], stream[i:j]), (i, j)


@needs_bpe
def test_text_pieces_encode_to_the_tokens_of_the_whole_text():
    """GPT-2's pre-tokenizer always cuts between a non-space character and a newline: the pieces tokendata.text_pieces
    cuts there encode, one by one, to the whole text's tokens, whatever the blocks the file was read in."""
    encoding = tokendata.gpt2_from_file(GPT2_BPE)
    rng = np.random.default_rng(0)
    alphabet = ["a", "b", " ", "  ", "\n", "\n\n", "\t", "'s", "'ll", "1", "23", ".", "é", "\u00a0", "\x1c",
                "\u3000", "\r\n", " \n"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet, size=rng.integers(1, 60)))
        size = int(rng.integers(1, 10))
        pieces = list(tokendata.text_pieces(text[i:i + size] for i in range(0, len(text), size)))
        assert "".join(pieces) == text
        assert [t for p in pieces for t in encoding.encode_ordinary(p)] == encoding.encode_ordinary(text), repr(text)


def test_train_py_on_shards_not_yet_finished_says_to_run_their_command_again(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOLATENT_DATA", str(tmp_path))
    with pytest.raises(common.Refused) as refused:
        tokendata.load_meta("fineweb_edu_47b")  # config/free_1b5.py's dataset, not prepared
    assert "run `python prepare.py fineweb_edu --name=fineweb_edu_47b` with the --subset and --max_tokens its config" \
        in refused.value.message
    (tmp_path / "fineweb_edu_47b").mkdir()
    (tmp_path / "fineweb_edu_47b" / "progress.json").write_text("{}")  # a preparation killed, or still running
    with pytest.raises(common.Refused) as refused:
        tokendata.load_meta("fineweb_edu_47b")
    assert "is not finished" in refused.value.message and "run again, goes on where it stopped" in refused.value.message


@pytest.mark.slow
@pytest.mark.parametrize("value", ['["a", "list"]', "null", '{"an": "object"}', "3"])
def test_a_text_field_that_is_not_a_string_is_one_line_naming_file_line_and_field(value, tmp_path):
    """Not its Python repr prepared as text: one line naming the file, the line and the field, and nothing written."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "fine"}\n{"title": "t", "text": ' + value + "}\n")
    proc = run_script("prepare.py", "text", f"--input={path}", "--tokenizer=char", "--name=x",
                      data_dir=tmp_path / "data", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{path} line 2" in proc.stderr and "'text'" in proc.stderr and "not a string" in proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
@needs_bpe
@pytest.mark.parametrize("record, phrase", [
    ({"text": None}, "field 'text' holds null, not a string"),
    ({"text": ["a", "list"]}, "field 'text' holds [\"a\", \"list\"], not a string"),
    ({"body": "no text field"}, "has no field 'text' (its fields: body)"),
])
def test_a_fineweb_record_without_a_string_text_is_one_line_naming_the_file_and_line(record, phrase, tmp_path):
    """A local .jsonl copy of FineWeb-Edu with NANOLATENT_LOCAL_DATA set: its file, line and field, not the hub's
    'export NANOLATENT_LOCAL_DATA' line nor a worker's traceback; and no data folder is left."""
    folder = tmp_path / "copies" / "fineweb-edu" / tokendata.FINEWEB_EDU_SUBSETS["sample-100BT"]
    folder.mkdir(parents=True)
    (folder / "000_00000.jsonl").write_text('{"text": "fine"}\n' * 3)
    (folder / "001_00000.jsonl").write_text('{"text": "fine"}\n' + json.dumps(record) + "\n")
    proc = fineweb(tmp_path / "copies", tmp_path / "data", "--subset=sample-100BT", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{folder / '001_00000.jsonl'} line 2 {phrase}" in proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
@pytest.mark.parametrize("suffix", ["txt", "jsonl"])
def test_a_utf8_byte_order_mark_is_not_a_character_of_the_data(suffix, tmp_path):
    text = "hello world, the quick brown fox.\n" * 30
    body = text if suffix == "txt" else "".join(json.dumps({"text": line}) + "\n" for line in text.splitlines())
    (tmp_path / f"in.{suffix}").write_bytes(b"\xef\xbb\xbf" + body.encode())
    run_script("prepare.py", "text", f"--input={tmp_path / f'in.{suffix}'}", "--tokenizer=char", "--name=t",
               data_dir=tmp_path)
    train, meta = read(tmp_path, "t", "train")
    assert "\ufeff" not in meta["chars"] and meta["chars"] == sorted(set(text if suffix == "txt" else text + "\n"))
    if suffix == "txt":
        val, _ = read(tmp_path, "t", "val")
        decode = tokendata.tokenizer(meta)[1]
        assert decode(train.tolist()) + decode(val.tolist()) == text
