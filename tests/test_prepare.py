"""prepare.py: the synthetic task's format, local text files, and the GPT-2 path with the offline BPE file."""

import json
import os
import re

import numpy as np
import pytest

from conftest import SHARED_DATA, run_script

from nanolatent import tokendata

GPT2_BPE = os.path.join(SHARED_DATA, "gpt2", "gpt2.tiktoken")
SHAKESPEARE = os.path.join(SHARED_DATA, "tinyshakespeare", "input.txt")


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
@pytest.mark.skipif(not os.path.exists(GPT2_BPE), reason="../shared/data/gpt2 (offline GPT-2 BPE) is absent")
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
@pytest.mark.skipif(not os.path.exists(GPT2_BPE), reason="../shared/data/gpt2 (offline GPT-2 BPE) is absent")
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


@pytest.mark.skipif(not os.path.exists(GPT2_BPE), reason="../shared/data/gpt2 (offline GPT-2 BPE) is absent")
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
    monkeypatch.setenv(tokendata.LOCAL_DATA_ENV, SHARED_DATA)  # the folder of local copies: gpt2/gpt2.tiktoken in it
    encoding, used = tokendata.gpt2_encoding()
    assert used == os.path.join(SHARED_DATA, "gpt2", "gpt2.tiktoken") and encoding.encode("Hello world") == [15496, 995]


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
@pytest.mark.skipif(not os.path.exists(GPT2_BPE), reason="../shared/data/gpt2 (offline GPT-2 BPE) is absent")
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
@pytest.mark.skipif(not os.path.exists(GPT2_BPE), reason="../shared/data/gpt2 (offline GPT-2 BPE) is absent")
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
