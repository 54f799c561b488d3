"""sample.py, run as a user runs it on a tiny trained run: the same text for the same seed, the prompt read as text (a
file's byte order mark dropped), and its refusals, each one line naming key and value. (nanolatent/sampling.py's
measures: test_sampling.py.)"""

import pytest

from conftest import assert_one_line_error, run_script, train_det


@pytest.mark.slow
def test_sample_is_reproducible_with_a_seed(data_root, tmp_path):
    train_det(data_root, tmp_path, "--max_iters=2", "--eval_interval=2")
    a, b = (run_script("sample.py", f"--out_dir={tmp_path}", "--start=K>", "--seed=3", data_dir=data_root).stdout
            for _ in range(2))
    assert a == b and a.count("K>") == 4


@pytest.mark.slow
def test_a_prompt_file_with_a_byte_order_mark_reads_as_its_text(trained, data_root, tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfK>")
    a, b = (run_script("sample.py", f"--out_dir={trained}", start, "--seed=3", "--num_samples=2",
                       data_dir=data_root).stdout for start in ("--start=K>", f"--start=FILE:{tmp_path / 'bom.txt'}"))
    assert a == b and a.count("K>") == 2


@pytest.mark.slow
def test_sample_reads_the_prompt_as_text_even_when_it_looks_like_a_number(trained, data_root):
    proc = run_script("sample.py", f"--out_dir={trained}", "--start=K>", "--num_samples=1", data_dir=data_root)
    assert proc.stdout.startswith("K>")
    proc = run_script("sample.py", f"--out_dir={trained}", "--start=12", "--num_samples=1", data_dir=data_root,
                      check=False)
    assert_one_line_error(proc, "not in this dataset's vocabulary")  # '1' is no letter of the task: said, not crashed


@pytest.mark.slow
@pytest.mark.parametrize("args, named", [  # what the line must name: the key and the value (not the wording)
    (["--temperature=-1"], ("temperature", "-1")),
    (["--num_samples=0"], ("num_samples", "0")),
    (["--max_new_tokens=-1"], ("max_new_tokens", "-1")),
    (["--top_k=-1"], ("top_k", "-1")),
    (["--start="], ("start", "empty")),
    (["--start=FILE:no_such_prompt.txt"], ("--start=FILE:no_such_prompt.txt",)),
    (["--latents=everywhere"], ("latents", "everywhere", "shared")),
    (["--seed=-1"], ("seed", "-1")),
    (["--latent_seed=-2"], ("latent_seed", "-2")),
    (["--device=mps"], ("mps",)),
    (["--model_type=free", "--latents=posterior", "--reference=" + "_" * 80], ("--reference", "80", "block_size=66")),
    (["--max_new_tokens=70"], ("70", "block_size=66")),  # 2 prompt tokens + 70 > the context
    (["--start=" + "_" * 60, "--max_new_tokens=10"], ("exceeds the context (block_size=66)",)),  # 60 + 10 > it
    (["--summary=True", "--latents=shared"], ("--summary", "--latents")),
    (["--summary=True", "--groups=0"], ("--summary", "--groups")),
    (["--pin_mind=4", "--num_samples=4"], ("--pin_mind=4", "0..3")),
    (["--pin_mind=1", "--latents=shared"], ("--pin_mind=1", "--latents=shared")),
    (["--model_type=free", "--latents=shared", "--z=0101"], ("--z", "0101")),
    (["--z=01010101"], ("--z", "'none'")),
])
def test_sample_mistake_is_one_line_naming_key_and_value(args, named, trained, data_root):
    assert_one_line_error(run_script("sample.py", f"--out_dir={trained}", "--start=K>", *args, data_dir=data_root,
                                     check=False), *named)


@pytest.mark.slow
@pytest.mark.parametrize("content, phrase", [
    ("caf\xe9 au lait\n".encode("latin-1"), "is not UTF-8 text (byte 3: invalid continuation byte)"),
    (None, "is a folder"),
])
def test_sample_prompt_file_that_is_not_utf8_text_is_one_line(content, phrase, trained, data_root, tmp_path):
    path = tmp_path / "latin1.txt" if content is not None else tmp_path
    if content is not None:
        path.write_bytes(content)
    proc = run_script("sample.py", f"--out_dir={trained}", f"--start=FILE:{path}", data_dir=data_root, check=False)
    assert_one_line_error(proc, f"--start=FILE:{path} {phrase}")
