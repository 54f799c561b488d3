"""scripts/explore.py, the latent page, against the scripts it stands for: on tiny trained det, EVE and Free runs, its
server (on 127.0.0.1, a free port) answers each view with exactly the texts and numbers of the sample.py or
evaluate.py command it shows, the page in headless Chromium shows them, and bad input is one message in the page and
in the server's log, with the server still up and the run folders untouched."""

import itertools
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from conftest import ROOT, TINY, run_script, script_env, start_script, wait_for_line
import torch.nn.functional as F

from nanolatent import ckpt, metrics, tasks, tokendata

pytestmark = pytest.mark.slow  # a server, the scripts and a browser, spawned
TIMEOUT = 120  # seconds for any one request or wait; every request goes to 127.0.0.1


@pytest.fixture(scope="module")
def runs(data_root, tmp_path_factory):
    """Tiny det, EVE and Free runs on the synthetic task (a few seconds each), and the Free run with its Z made to
    change nothing (post_sampler, the only way Z enters the decoder, zeroed: §3.1's R = 0)."""
    root = tmp_path_factory.mktemp("explore")
    for model in ("det", "eve", "free"):
        run_script("train.py", f"--model_type={model}", f"--out_dir={root / model}", *TINY, "--max_iters=20",
                   "--eval_interval=20", data_dir=data_root)
    checkpoint = torch.load(root / "free" / "ckpt.pt", map_location="cpu", weights_only=False)
    checkpoint["model"]["post_sampler.weight"].zero_()
    (root / "free_z_ignored").mkdir()
    torch.save(checkpoint, root / "free_z_ignored" / "ckpt.pt")
    return root


@pytest.fixture(scope="module")
def server(runs, data_root):
    """The explorer on the Free run, on a port the OS picks; yields (url, the path of its log)."""
    out, log = runs / "server.out", runs / "server.log"
    proc = start_script("-m", "scripts.explore", f"--out_dir={runs / 'free'}", "--port=0", "--stream_every=0",
                        data_dir=data_root, out=out, err=log)
    try:
        line = wait_for_line(out, "serving", proc, TIMEOUT)  # "serving ... on http://127.0.0.1:PORT ..."
        assert "http://127.0.0.1:" in line, open(log).read()
        yield line.split("http://")[1].split()[0], log
    finally:
        proc.terminate()
        proc.wait(timeout=TIMEOUT)


def post(server, view, **fields):
    """(HTTP status, the answer's JSON lines) of one view."""
    request = urllib.request.Request(f"http://{server[0]}/api/{view}", data=json.dumps(fields).encode(),
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, [json.loads(line) for line in response.read().decode().splitlines()]
    except urllib.error.HTTPError as e:
        return e.code, [json.loads(e.read())]


def run_command(command, data_root, tmp_path):
    """Run a command the page shows, as a user pastes it (its thread count, script and flags), with any --out_json
    under tmp_path; -> its stdout."""
    words = shlex.split(command)
    assert words[0] == "OMP_NUM_THREADS=1" and words[1] == "python"
    args = [f"--out_json={tmp_path / 'tokens.json'}" if w.startswith("--out_json=") else w for w in words[3:]]
    return run_script(words[2], *args, data_dir=data_root).stdout


def printed_samples(stdout):
    """sample.py's samples: each printed text (and Z line) up to its separator line, after the line saying that a det
    checkpoint became B-Trans minds, if any, without --summary's block labels."""
    if stdout.startswith("loaded a det checkpoint into btrans;"):
        stdout = stdout.split("\n", 1)[1]
    stdout = "".join(line for line in stdout.splitlines(keepends=True) if not line.startswith("# block "))
    return stdout.split("---------------\n")[:-1]


def run_files(runs):
    """Every file under the run folders with its size and modification time."""
    return {os.path.join(d, f): (os.path.getsize(os.path.join(d, f)), os.path.getmtime(os.path.join(d, f)))
            for model in ("det", "eve", "free", "free_z_ignored")
            for d, _, files in os.walk(runs / model) for f in files}


GROUP = dict(prompt="K>", k="4", groups="2", max_new_tokens="30", temperature="0.8", latent_seed="5", seed="11")


def test_groups_stream_each_token_and_end_with_sample_py_texts_for_each_block(server, runs, data_root, tmp_path):
    status, events = post(server, "groups", run=str(runs / "eve"), **GROUP)
    assert status == 200 and events[0] == {"model_type": "eve", "latent_kind": "noise", "blocks": 3}
    blocks = [e for e in events if "block" in e]
    assert [(b["latents"], b["latent_seed"]) for b in blocks] == [("shared", 5), ("shared", 6), ("independent", 5)]
    for b in blocks:
        assert printed_samples(run_command(b["command"], data_root, tmp_path)) == [t + "\n" for t in b["texts"]]
        partial = [e["texts"] for e in events if e.get("partial") == b["block"]]
        # --stream_every=0: a line for every token fed back (all but the last), each a prefix of the final texts
        assert len(partial) == 29 and all(len(p[0]) == len("K>") + 1 + i for i, p in enumerate(partial))
        assert all(final.startswith(p) for texts in partial for p, final in zip(texts, b["texts"]))
    shared = blocks[0]["texts"]
    assert len(set(shared)) > 1  # the token draws differ within a group; the noise is what they share


def test_det_uncertainty_is_evaluate_py_per_token_with_exactly_zero_mi(server, runs, data_root, tmp_path):
    status, events = post(server, "uncertainty", run=str(runs / "det"), text="K>__!_KKKKKKKK__", passes="8",
                          seed="3")
    (scores,) = events
    assert status == 200 and scores["passes"] == 1 and scores["mi"] == [0.0] * 15
    run_command(scores["command"], data_root, tmp_path)
    with open(tmp_path / "tokens.json") as f:
        expected = json.load(f)["results"][str(runs / "det")]
    assert {k: scores[k] for k in ("tokens", "nll", "entropy", "expected_entropy", "mi", "passes")} == \
        {k: expected[k] for k in ("tokens", "nll", "entropy", "expected_entropy", "mi", "passes")}


def test_minds_of_a_det_run_are_sample_py_minds_each_scoring_one_text(server, runs, data_root, tmp_path):
    status, events = post(server, "minds", run=str(runs / "det"), prompt="K>", k="3", sigma="0.3",
                          max_new_tokens="64", temperature="1.0", latent_seed="2", seed="7")
    minds = events[-1]
    assert status == 200 and printed_samples(run_command(minds["command"], data_root, tmp_path)) == \
        [t + "\n" for t in minds["texts"]]
    # each mind's NLL of the mean model's first row: sample.py's minds (drawn from the latent seed) forward on it
    assert minds["nll_text"] == minds["mean_texts"][0]
    model, _ = ckpt.load_model(str(runs / "det"), "cpu", "btrans", sigma=0.3)
    drawn = model.eval().sample_latents(3, torch.Generator().manual_seed(2))
    encode, _ = tokendata.tokenizer(ckpt.load_checkpoint(str(runs / "det"))["meta"])
    ids = torch.tensor([encode(minds["nll_text"])])
    with torch.no_grad():
        expected = [F.cross_entropy(model(ids[:, :-1], ids[:, 1:], latents=drawn[i:i + 1])[0][0], ids[0, 1:]).item()
                    for i in range(3)]
    assert np.allclose(minds["nll"], expected, rtol=0, atol=1e-5) and np.std(expected) > 1e-4
    assert minds["headline"] == f"the 3 minds on one text: NLL std {np.std(minds['nll']):.4f}, range " \
        f"{max(minds['nll']) - min(minds['nll']):.4f} nats per token (mean {np.mean(minds['nll']):.4f})"
    answers = [tasks.letters_answer(t[len("K>"):]) for t in minds["texts"]]  # the synthetic task's answers
    assert minds["answers"] == answers and minds["majority"] == metrics.majority_answer(answers)


def test_z_shows_the_bits_and_texts_of_sample_py_show_latents(server, runs, data_root, tmp_path):
    reference = "K>____KKKKKKKK_______"
    status, events = post(server, "z", run=str(runs / "free"), prompt="K>", reference=reference, k="3",
                          max_new_tokens="20", temperature="0.8", latent_seed="4", seed="9")
    z = events[-1]
    assert status == 200 and len(z["bits"]) == len(reference) and all(len(b) == 8 for b in z["bits"])
    expected = [f"{text}\nZ: {' '.join(z['bits'])}\n" for text in z["texts"]]
    assert printed_samples(run_command(z["command"], data_root, tmp_path)) == expected
    assert ["".join(row) for row in z["tokens"]] == z["texts"]


def pair_agreement(texts):
    """Per position, the share of pairs of equal-length texts with the same character there (counted pair by pair)."""
    pairs = list(itertools.combinations(texts, 2))
    return [sum(a[i] == b[i] for a, b in pairs) / len(pairs) for i in range(len(texts[0]))]


def summary_of(events):
    (summary,) = [e for e in events if "summary" in e]
    return summary


def test_groups_agreement_is_sample_py_summary_and_counts_pairs(server, runs, data_root, tmp_path):
    status, events = post(server, "groups", run=str(runs / "eve"), **dict(GROUP, groups="3", max_new_tokens="40"))
    summary, blocks = summary_of(events), [e for e in events if "block" in e]
    stdout = run_command(summary["command"], data_root, tmp_path)
    # the samples, block after block (the shared groups, then a draw each), then exactly the page's lines
    assert printed_samples(stdout) == [t + "\n" for b in blocks for t in b["texts"]]
    assert stdout.split("---------------\n")[-1].splitlines() == summary["lines"]
    new = lambda block: [t[len("K>"):] for t in block["texts"]]  # one character a token on this task
    within = np.mean([pair_agreement(new(b)) for b in blocks[:-1]], axis=0)
    across = pair_agreement(new(blocks[-1]))
    assert np.allclose(summary["summary"]["within"], within, rtol=0, atol=1e-12)
    assert np.allclose(summary["summary"]["across"], across, rtol=0, atol=1e-12)
    assert math.isclose(summary["summary"]["within_mean"], np.mean(within), abs_tol=1e-12)
    # the reproduction's spread: sample std (ddof 1) of the target's start over the well-formed samples
    starts = [t.index(tasks.letters_answer(t)) for t in new(blocks[-1]) if tasks.letters_answer(t)]
    assert summary["summary"]["formed_independent"] == len(starts)
    assert summary["summary"]["spread_independent"] == (float(np.std(starts, ddof=1)) if len(starts) >= 2 else None)
    assert not summary["summary"]["identical"] and not any(line.startswith("warning") for line in summary["lines"])


@pytest.mark.parametrize("run", ["det", "free_z_ignored"])
def test_groups_flag_a_run_whose_latents_change_nothing(server, runs, data_root, tmp_path, run):
    status, events = post(server, "groups", run=str(runs / run), **GROUP)
    summary, blocks = summary_of(events), [e for e in events if "block" in e]
    assert status == 200 and all(b["texts"] == blocks[-1]["texts"] for b in blocks)
    assert summary["summary"]["identical"] and summary["summary"]["within"] == summary["summary"]["across"]
    assert summary["lines"][-2].startswith("warning: every group is identical")
    assert summary["lines"][-1] == ("no measurable effect of the latents on the agreement of pairs (d = 0 exactly at "
                                    "each of the 30 new positions)")
    assert run_command(summary["command"], data_root, tmp_path).splitlines()[-2:] == summary["lines"][-2:]


@pytest.mark.parametrize("run, changes", [("free", True), ("det", False), ("free_z_ignored", False)])
def test_the_groups_verdict_says_whether_the_latents_change_the_samples(server, runs, data_root, tmp_path, run,
                                                                       changes):
    """Greedy, so that a group sharing a draw writes one text: pairs agree less across draws only where the latents
    move an argmax (the tiny Free run's Z does; det has none; the Free run with R = 0 ignores its Z)."""
    status, events = post(server, "groups", run=str(runs / run), **dict(GROUP, temperature="0"))
    summary = summary_of(events)
    d = np.subtract(summary["summary"]["within"], summary["summary"]["across"])
    verdict = summary["lines"][-1]
    if changes:
        assert d.mean() > 0 and verdict.startswith(f"the latents change the agreement of pairs by +{d.mean():.4f} [")
    else:
        assert not d.any() and verdict.startswith("no measurable effect of the latents on the agreement of pairs")
    assert run_command(summary["command"], data_root, tmp_path).splitlines()[-1] == verdict


def test_minds_at_sigma_0_are_one_model(server, runs):
    minds = post(server, "minds", run=str(runs / "det"), prompt="K>", k="4", sigma="0", max_new_tokens="30",
                 temperature="1.0", latent_seed="2", seed="7")[1][-1]
    assert len(set(minds["nll"])) == 1 and minds["nll_std"] == 0 and minds["nll_range"] == 0
    assert minds["headline"].startswith("the minds are one model at σ = 0: each of the 4 gives this text the same NLL")


@pytest.mark.parametrize("run", ["free", "free_z_ignored"])
def test_the_z_headline_and_verdict_are_evaluate_py_s(server, runs, data_root, tmp_path, run):
    reference = "K>____KKKKKKKK_______"
    for fields in (dict(reference=reference), {}):  # with no reference, the first sample is the text read
        z = post(server, "z", run=str(runs / run), prompt="K>", k="2", max_new_tokens="20", temperature="0.8",
                 latent_seed="4", seed="9", **fields)[1][-1]
        assert z["read"] == ("the reference" if fields else "sample 0")
        assert f"--text={reference if fields else z['texts'][0]}" in shlex.split(z["lines_command"])
        run_command(z["lines_command"] + " --out_json=tokens.json", data_root, tmp_path)
        stdout = run_command(z["lines_command"], data_root, tmp_path)
        assert stdout.splitlines()[-2:] == z["lines"]
        with open(tmp_path / "tokens.json") as f:
            kl = json.load(f)["results"][str(runs / run)]["kl_bits"]
        assert math.isclose(z["kl_mean"], np.mean(kl), abs_tol=1e-12) and math.isclose(z["kl_total"], sum(kl),
                                                                                         abs_tol=1e-9)
        assert z["lines"][0].startswith(f"Z carries {np.mean(kl):.4f} bits per position, {sum(kl):.2f} bits")
    if run == "free_z_ignored":  # the encoder still reads the text (its KL above), but the decoder never sees Z
        assert z["lines"][1] == ("no measurable effect of the latents on its NLL (d = 0 exactly at each of the 21 "
                                 "predicted positions)")


def test_uncertainty_top_tokens_are_evaluate_py_s_each_pass_and_their_mean(server, runs, data_root, tmp_path):
    text = "K>___KKKKKKKK___!__"
    for run, passes in (("eve", 6), ("det", 1)):
        status, events = post(server, "uncertainty", run=str(runs / run), text=text, passes="6", seed="21")
        (scores,) = events
        assert status == 200 and len(scores["top"]) == len(text) - 1 and "--top_tokens=5" in scores["command"]
        run_command(scores["command"], data_root, tmp_path)
        with open(tmp_path / "tokens.json") as f:
            assert json.load(f)["results"][str(runs / run)]["top"] == scores["top"]
        for token, nll, top in zip(scores["tokens"], scores["nll"], scores["top"]):
            p = np.array(top["passes"])  # (M, k)
            assert p.shape == (passes, 5) and np.allclose(p.mean(0), top["mean"], atol=1e-6)
            assert np.allclose(p.std(0), top["spread"], atol=1e-6) and top["mean"] == sorted(top["mean"])[::-1]
            if token in top["tokens"]:  # p̄ of the text's token is evaluate.py's exp(-nll)
                assert math.isclose(-math.log(top["mean"][top["tokens"].index(token)]), nll, abs_tol=1e-4)
        spread = max(max(top["spread"]) for top in scores["top"])
        assert spread > 0 if run == "eve" else spread == 0


def test_minds_mean_model_rows_spread_and_pinned_mind(server, runs, data_root, tmp_path):
    fields = dict(run=str(runs / "det"), prompt="K>", k="3", sigma="0.3", max_new_tokens="30", temperature="1.0",
                  latent_seed="2", seed="7")
    minds = post(server, "minds", **fields)[1][-1]
    assert printed_samples(run_command(minds["mean_command"], data_root, tmp_path)) == \
        [t + "\n" for t in minds["mean_texts"]]
    assert minds["differ"] == [sum(a != b for a, b in zip(t, m)) for t, m in zip(minds["texts"], minds["mean_texts"])]
    assert minds["nll_std"] == float(np.std(minds["nll"]))
    assert minds["nll_range"] == max(minds["nll"]) - min(minds["nll"])
    # greedy: a pinned mind writes its own text in every row, the text it wrote among the K
    greedy = post(server, "minds", **dict(fields, temperature="0"))[1][-1]
    pinned = post(server, "minds", **dict(fields, temperature="0", pin="1", seed="8"))[1][-1]
    assert pinned["pin"] == 1 and pinned["texts"] == [greedy["texts"][1]] * 3
    assert "--pin_mind=1" in pinned["command"]
    assert printed_samples(run_command(pinned["command"], data_root, tmp_path)) == [t + "\n" for t in pinned["texts"]]


def test_z_kl_per_position_and_a_flipped_bit_are_sample_py_s(server, runs, data_root, tmp_path):
    reference = "K>____KKKKKKKK_______"
    fields = dict(run=str(runs / "free"), prompt="K>", reference=reference, k="2", max_new_tokens="20",
                  temperature="0.8", latent_seed="4", seed="9")
    z = post(server, "z", **fields)[1][-1]
    stdout = run_command(z["command"], data_root, tmp_path)
    assert stdout.splitlines()[-1] == "KL bits: " + " ".join(z["kl_bits"]) and len(z["kl_bits"]) == len(reference)
    assert all(0 <= float(kl) <= 8 for kl in z["kl_bits"])  # KL from the uniform prior over 2^8 codes
    bits = z["bits"][:]
    bits[3] = bits[3][:2] + "10"[int(bits[3][2])] + bits[3][3:]
    flipped = post(server, "z", **fields, z=" ".join(bits))[1][-1]
    assert flipped["bits"] == bits and f"--z={' '.join(bits)}" in shlex.split(flipped["command"])
    assert printed_samples(run_command(flipped["command"], data_root, tmp_path)) == \
        [f"{t}\nZ: {' '.join(bits)}\n" for t in flipped["texts"]]


BAD = [  # (view, fields, what the message names)
    ("groups", dict(GROUP, run="no/such/run"), "no checkpoint at no/such/run"),
    ("groups", dict(GROUP, prompt="K>" + "_" * 70), "the prompt has 72 tokens, more than the context"),
    ("groups", dict(GROUP, max_new_tokens="60", prompt="K>" + "_" * 10), "exceed the context (block_size=66)"),
    ("groups", dict(GROUP, k="10000"), "K=10000 is outside 1..64"),
    ("groups", dict(GROUP, temperature="warm"), "temperature must be a number, got 'warm'"),
    ("uncertainty", dict(text="K>__", passes="many", seed="1"), "passes M must be a whole number, got 'many'"),
    ("uncertainty", dict(text="K>_?", passes="2", seed="1"), "not in this dataset's vocabulary"),
    ("minds", dict(GROUP, sigma="0.1"), "is a free run"),
]


def test_bad_input_is_one_message_in_the_answer_and_the_log_and_writes_nothing(server, runs):
    before = run_files(runs)
    broken = runs / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "ckpt.pt").write_bytes(b"not a checkpoint")
    for view, fields, phrase in BAD + [("uncertainty", dict(run=str(broken), text="K>__", passes="2", seed="1"),
                                        "is unreadable")]:
        fields.setdefault("run", str(runs / "free"))
        status, events = post(server, view, **fields)
        assert status == 400 and len(events) == 1 and phrase in events[0]["error"], (view, fields, events)
        with open(server[1]) as f:
            assert f.read().count(f"error: {events[0]['error']}\n") == 1
    status, events = post(server, "uncertainty", run=str(runs / "free"), text="K>__", passes="2", seed="1")
    assert status == 200 and len(events[0]["mi"]) == 3  # the server is still up
    assert run_files(runs) == before


def read_until(s, marker):
    """What the socket s receives up to marker; a failure showing what came if the server closes before it."""
    received = b""
    while marker not in received:
        chunk = s.recv(65536)
        assert chunk, received.decode(errors="replace")[-2000:]
        received += chunk
    return received


def test_a_browser_closing_mid_generation_stops_it_and_the_server_goes_on(server, runs):
    host, port = server[0].split(":")
    body = json.dumps(dict(GROUP, run=str(runs / "free"), k="64", groups="16", max_new_tokens="60")).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST /api/groups HTTP/1.1\r\nHost: " + server[0].encode() + b"\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        read_until(s, b'"partial": 0')  # the headers, the first line, then the first tokens: close then
    deadline = time.time() + TIMEOUT
    while "the browser closed the connection during /api/groups" not in open(server[1]).read():
        assert time.time() < deadline
        time.sleep(0.2)
    status, events = post(server, "uncertainty", run=str(runs / "free"), text="K>__", passes="2", seed="1")
    assert status == 200 and len(events[0]["nll"]) == 3


def raw(server, request, wait=None):
    """Send raw request bytes to the server and read its answer to the end: (seconds taken, status code, the body's
    lines). wait: a socket the server is busy with meanwhile, closed after."""
    host, port = server[0].split(":")
    started = time.time()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    return time.time() - started, int(head.split()[1]), body.decode().splitlines()


def headers(server, length):
    return (f"POST /api/uncertainty HTTP/1.1\r\nHost: {server[0]}\r\n"
            + (f"Content-Length: {length}\r\n" if length is not None else "") + "\r\n").encode()


FIELDS = json.dumps(dict(text="K>__", passes="2", seed="1")).encode()


@pytest.mark.parametrize("length, body, phrase", [
    ("-1", FIELDS, "Content-Length=-1 is outside 1..1048576"),
    ("-5", FIELDS, "Content-Length=-5 is outside"),
    ("0", b"", "Content-Length=0 is outside"),
    ("abc", FIELDS, "Content-Length must be a whole number of bytes, got 'abc'"),
    (None, FIELDS, "Content-Length must be a whole number of bytes, got ''"),
    ("100", b'{"text": "K>_', "the request's body ended after 13 of its Content-Length 100 bytes"),
])
def test_a_bad_content_length_is_one_line_400_within_seconds(server, length, body, phrase):
    seconds, status, lines = raw(server, headers(server, length) + body)
    assert seconds < 5 and status == 400 and len(lines) == 1 and phrase in json.loads(lines[0])["error"], lines


@pytest.mark.parametrize("field, value", [("seed", "9" * 5000), ("run", "x" * 5000), ("prompt", ["K>"] * 2000)],
                         ids=["seed", "run", "prompt"])
def test_a_huge_value_is_echoed_as_a_short_prefix(server, runs, field, value):
    status, events = post(server, "groups", **{**GROUP, "run": str(runs / "free"), field: value})
    assert status == 400 and len(events[0]["error"]) < 120 and "characters)" in events[0]["error"], events


def test_a_request_while_the_server_computes_is_answered_busy_at_once(server, runs):
    host, port = server[0].split(":")
    body = json.dumps(dict(GROUP, run=str(runs / "free"), k="64", groups="16", max_new_tokens="60")).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(headers(server, len(body)).replace(b"uncertainty", b"groups") + body)
        read_until(s, b'"partial": 0')  # the first generation is under way
        fields = dict(run=str(runs / "free"), text="K>__", passes="2", seed="1")
        started = time.time()
        status, events = post(server, "uncertainty", **fields)
        assert time.time() - started < 5 and status == 503 and len(events) == 1
        assert events[0]["error"].startswith("busy:")
    deadline = time.time() + TIMEOUT  # the closed connection ends the generation; then the server computes again
    while post(server, "uncertainty", **fields)[0] == 503:
        assert time.time() < deadline
        time.sleep(0.2)


def test_fifty_clients_at_once_each_get_an_answer(server, runs):
    host, port = server[0].split(":")
    body = json.dumps(dict(GROUP, run=str(runs / "free"), k="64", groups="16", max_new_tokens="60")).encode()
    fields = dict(run=str(runs / "free"), text="K>__", passes="2", seed="1")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(headers(server, len(body)).replace(b"uncertainty", b"groups") + body)
        read_until(s, b'"partial": 0')  # the server computes: each of the 50 is answered busy
        answers = []

        def ask():
            try:
                answers.append(post(server, "uncertainty", **fields)[0])
            except OSError as e:  # a connection reset: no answer at all
                answers.append(repr(e))
        clients = [threading.Thread(target=ask) for _ in range(50)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
    assert answers == [503] * 50
    deadline = time.time() + TIMEOUT
    while post(server, "uncertainty", **fields)[0] == 503:
        assert time.time() < deadline
        time.sleep(0.2)


def test_a_json_number_of_5000_digits_is_a_400_not_a_500(server, runs):
    fields = json.dumps(dict(run=str(runs / "free"), text="K>__", passes="2")).encode()
    body = fields[:-1] + b', "seed": ' + b"9" * 5000 + b"}"  # json.dumps cannot write it: Python's int limit
    seconds, status, lines = raw(server, headers(server, len(body)) + body)
    assert status == 400 and len(lines) == 1
    assert json.loads(lines[0])["error"].startswith("a number in the request has more than 4,300 digits")


@pytest.mark.parametrize("moment", ["loading", "idle", "computing"])
def test_ctrl_c_at_any_moment_ends_the_server_cleanly(runs, data_root, moment):
    """A process of its own, as a user starts it (a fork of the suite's launcher never runs Python's exit, where a
    thread inside torch aborted the process)."""
    proc = subprocess.Popen([sys.executable, "-m", "scripts.explore", f"--out_dir={runs / 'free'}", "--port=0",
                             "--stream_every=0"],  # a partial answer at the first token: the view is computing then
                            cwd=ROOT, env=script_env(data_root), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        if moment == "loading":  # torch importing or the run loading: before the server listens
            time.sleep(1)
        else:
            url = proc.stdout.readline().split("http://")[1].split()[0]
        if moment == "computing":
            body = json.dumps(dict(GROUP, run=str(runs / "free"), k="64", groups="16", max_new_tokens="60")).encode()
            host, port = url.split(":")
            s = socket.create_connection((host, int(port)), timeout=TIMEOUT)
            s.sendall(headers((url,), len(body)).replace(b"uncertainty", b"groups") + body)
            read_until(s, b'"partial": 0')  # the view's first partial answer: it is computing
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.endswith("stopped\n"), (proc.returncode, out, err[-2000:])
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]


def test_only_pages_of_the_server_itself_may_ask_it(server):
    request = urllib.request.Request(f"http://{server[0]}/api/run", headers={"Origin": "http://example.com"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=TIMEOUT)
    assert refused.value.code == 403


@pytest.fixture(scope="module")
def chromium():
    """Headless Chromium through selenium and Debian's chromedriver; skipped where either is missing (.ci/run
    installs both)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    driver_path = shutil.which("chromedriver")
    if driver_path is None:
        pytest.skip("no chromedriver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000"):
        options.add_argument(flag)
    profile = __import__("tempfile").mkdtemp(prefix="chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.add_experimental_option("prefs", {"download.default_directory": os.path.join(profile, "downloads"),
                                              "download.prompt_for_download": False})
    browser = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
    browser.set_page_load_timeout(TIMEOUT)
    browser.downloads = os.path.join(profile, "downloads")  # where "export JSON" saves
    yield browser
    browser.quit()
    shutil.rmtree(profile, ignore_errors=True)


def test_the_page_in_chromium_shows_sample_py_groups_and_evaluate_py_token_values(server, runs, chromium, data_root,
                                                                                  tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(chromium, TIMEOUT)
    chromium.get(f"http://{server[0]}/")
    wait.until(lambda b: b.find_element(By.ID, "run").get_attribute("value") == str(runs / "free"))

    def fill(fields):
        for key, value in fields.items():
            box = chromium.find_element(By.ID, key)
            box.clear()
            box.send_keys(value)

    # Groups on the Free run: one shared-Z group of 4 and 4 independent samples, as sample.py prints them
    fill({"groups-k": "4", "groups-groups": "1", "groups-max_new_tokens": "30", "groups-latent_seed": "5",
          "groups-seed": "11"})
    chromium.find_element(By.ID, "groups-go").click()
    wait.until(lambda b: b.find_element(By.ID, "status").text == "done")
    for block in chromium.find_elements(By.CSS_SELECTOR, "#groups-out .block"):
        texts = [s.get_property("textContent") for s in block.find_elements(By.CSS_SELECTOR, ".sample")]
        command = block.find_element(By.CSS_SELECTOR, "pre.command").get_property("textContent")
        assert printed_samples(run_command(command, data_root, tmp_path)) == [t + "\n" for t in texts]
    assert "--latents=shared" in chromium.find_elements(By.CSS_SELECTOR, "pre.command")[0].text

    # K = 10000: one message in the page and in the log
    logged = lambda: open(server[1]).read().count("error: K=10000 is outside 1..64 samples a group\n")
    before = logged()
    fill({"groups-k": "10000"})
    chromium.find_element(By.ID, "groups-go").click()
    wait.until(lambda b: b.find_element(By.ID, "message").text)
    assert chromium.find_element(By.ID, "message").text == "K=10000 is outside 1..64 samples a group"
    assert logged() == before + 1

    # Uncertainty on the EVE run: every token's values are evaluate.py's, to the last bit
    chromium.find_element(By.CSS_SELECTOR, "nav button[data-view=uncertainty]").click()
    fill({"run": str(runs / "eve"), "uncertainty-text": "K>___KKKKKKKK___!__", "uncertainty-passes": "6",
          "uncertainty-seed": "21"})
    chromium.find_element(By.ID, "uncertainty-go").click()
    wait.until(lambda b: b.find_element(By.ID, "status").text == "done")
    command = chromium.find_element(By.CSS_SELECTOR, "#uncertainty-out pre.command").get_property("textContent")
    run_command(command, data_root, tmp_path)
    with open(tmp_path / "tokens.json") as f:
        expected = json.load(f)["results"][str(runs / "eve")]
    spans = chromium.find_elements(By.CSS_SELECTOR, "#uncertainty-out .tok")
    assert [s.get_property("textContent") for s in spans] == expected["tokens"]
    for key in ("nll", "entropy", "expected_entropy", "mi"):
        assert [float(s.get_attribute(f"data-{key}")) for s in spans] == expected[key]
    assert max(expected["mi"]) > 0  # EVE's noise moves the predictions


def page(chromium, server):
    """(wait, fill, go) for driving the page: fill sets text fields by id, go clicks a view's button and waits for
    "done" or a message."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(chromium, TIMEOUT)

    def fill(fields):
        for key, value in fields.items():
            box = chromium.find_element(By.ID, key)
            box.clear()
            box.send_keys(value)

    def go(view):
        chromium.find_element(By.ID, f"{view}-go").click()
        wait.until(lambda b: b.find_element(By.ID, "status").text == "done" or b.find_element(By.ID, "message").text)
        assert chromium.find_element(By.ID, "message").text == ""
    return wait, fill, go


def test_the_page_in_chromium_shows_the_groups_numbers_of_sample_py_summary_and_the_warning(server, runs, chromium,
                                                                                             data_root, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    wait, fill, go = page(chromium, server)
    chromium.get(f"http://{server[0]}/")
    wait.until(lambda b: b.find_element(By.ID, "run").get_attribute("value") == str(runs / "free"))
    assert chromium.find_element(By.ID, "runinfo").text == "a free run, trained on synthetic"
    fill({"run": str(runs / "eve"), "groups-k": "4", "groups-groups": "2", "groups-max_new_tokens": "30",
          "groups-latent_seed": "5", "groups-seed": "11"})
    ActionChains(chromium).double_click(chromium.find_element(By.ID, "groups-go")).perform()  # one request
    wait.until(lambda b: b.find_element(By.ID, "status").text == "done")
    assert chromium.find_element(By.ID, "message").text == "" and chromium.find_element(By.ID, "runinfo").text == \
        "an eve run"
    lines = chromium.find_element(By.CSS_SELECTOR, "#groups-out pre.summary").get_property("textContent")
    command = chromium.find_elements(By.CSS_SELECTOR, "#groups-out pre.command")[-1].get_property("textContent")
    assert "--summary=True" in command
    assert run_command(command, data_root, tmp_path).split("---------------\n")[-1] == lines + "\n"
    # marked: the new tokens that differ from their block's most common one at that position
    for block in chromium.find_elements(By.CSS_SELECTOR, "#groups-out .block"):
        rows = [s.get_property("textContent")[len("K>"):] for s in block.find_elements(By.CSS_SELECTOR, ".sample")]
        marked = [[(d.get_property("textContent"), d.location["x"]) for d in s.find_elements(By.CSS_SELECTOR, ".diff")]
                  for s in block.find_elements(By.CSS_SELECTOR, ".sample")]
        counts = [sum(c for c in [sum(r[i] != m for m in [max(set(col), key=col.count)]) for r in rows])
                  for i, col in enumerate(map(list, zip(*rows)))]
        assert sum(map(len, marked)) == sum(counts)
    assert not chromium.find_elements(By.CSS_SELECTOR, "#groups-out .warning")
    fill({"run": str(runs / "free_z_ignored")})
    go("groups")
    warning = chromium.find_element(By.CSS_SELECTOR, "#groups-out p.warning").text
    assert warning.startswith("warning: every group is identical to the samples with a draw each")
    assert chromium.find_element(By.CSS_SELECTOR, "#groups-out p.verdict").text == \
        "no measurable effect of the latents on the agreement of pairs (d = 0 exactly at each of the 30 new positions)"
    # each character in a cell of its own width, apart: a run of "_" is counted by eye, not seen as one line
    sample = chromium.find_element(By.CSS_SELECTOR, "#groups-out .sample")
    assert float(sample.value_of_css_property("letter-spacing").rstrip("px")) > 0


def test_the_page_in_chromium_colours_on_a_fixed_scale_and_shows_each_pass_top_tokens(server, runs, chromium,
                                                                                     data_root, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    wait, fill, go = page(chromium, server)
    chromium.get(f"http://{server[0]}/")
    wait.until(lambda b: b.find_element(By.ID, "run").get_attribute("value"))
    chromium.find_element(By.CSS_SELECTOR, "nav button[data-view=uncertainty]").click()
    fill({"run": str(runs / "eve"), "uncertainty-text": "K>___KKKKKKKK___!__", "uncertainty-passes": "4",
          "uncertainty-seed": "21"})
    go("uncertainty")
    answer = chromium.execute_script("return answers.uncertainty.answer[0]")
    for scale in ("0.1", "0.001"):
        Select(chromium.find_element(By.ID, "uncertainty-scale")).select_by_value(scale)
        spans = chromium.find_elements(By.CSS_SELECTOR, "#uncertainty-out .tok")
        alphas = [float(s.value_of_css_property("background-color").split(",")[-1].rstrip(")")) if
                  s.value_of_css_property("background-color").startswith("rgba") else 1.0 for s in spans]
        assert np.allclose(alphas, [min(abs(v) / float(scale), 1) for v in answer["mi"]], atol=0.01)
    command = chromium.find_element(By.CSS_SELECTOR, "#uncertainty-out pre.command").get_property("textContent")
    (mean_row,) = [line.split()[1:] for line in run_command(command, data_root, tmp_path).splitlines()
                   if line.split()[:1] == ["mean"]]  # evaluate.py's means: nll, entropy, expected entropy, mi
    assert chromium.find_element(By.CSS_SELECTOR, "#uncertainty-out p.means").text == \
        "means over the tokens: nll {}, entropy {}, expected entropy {}, mi {} nats (the command's mean row)".format(
            *mean_row)
    ActionChains(chromium).move_to_element(spans[5]).click().perform()
    rows = chromium.find_elements(By.CSS_SELECTOR, "#uncertainty-panel tr.topk-row")
    top = answer["top"][5]
    assert [r.find_elements(By.TAG_NAME, "td")[0].text for r in rows] == [json.dumps(t) for t in top["tokens"]]
    assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows] == [f"{p:.4f}" for p in top["mean"]]
    assert [[c.text for c in r.find_elements(By.TAG_NAME, "td")[3:]] for r in rows] == \
        [[f"{p:.4f}" for p in ps] for ps in zip(*top["passes"])]  # (M, k) -> a row per token


def test_the_page_in_chromium_pins_a_mind_beside_the_mean_model(server, runs, chromium, data_root, tmp_path):
    from selenium.webdriver.common.by import By

    wait, fill, go = page(chromium, server)
    chromium.get(f"http://{server[0]}/")
    wait.until(lambda b: b.find_element(By.ID, "run").get_attribute("value"))
    chromium.find_element(By.CSS_SELECTOR, "nav button[data-view=minds]").click()
    fill({"run": str(runs / "det"), "minds-k": "3", "minds-sigma": "0.3", "minds-max_new_tokens": "30",
          "minds-temperature": "0", "minds-latent_seed": "2", "minds-seed": "7"})
    go("minds")
    texts = [s.get_property("textContent") for s in chromium.find_elements(By.CSS_SELECTOR, "tr.mind .sample")]
    means = [s.get_property("textContent") for s in chromium.find_elements(By.CSS_SELECTOR, ".mean-text")]
    command = chromium.find_elements(By.CSS_SELECTOR, "#minds-out pre.command")[1].get_property("textContent")
    assert "--noise_mode=mean" in command
    assert printed_samples(run_command(command, data_root, tmp_path)) == [t + "\n" for t in means]
    nll = [float(c.get_attribute("data-value")) for c in chromium.find_elements(By.CSS_SELECTOR, "td.nll")]
    assert f"std {np.std(nll):.4f}, range {max(nll) - min(nll):.4f} nats" in \
        chromium.find_element(By.CSS_SELECTOR, "p.spread").text
    chromium.find_elements(By.CSS_SELECTOR, "button.pin")[2].click()
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#minds-out p.warning"))
    pinned = [s.get_property("textContent") for s in chromium.find_elements(By.CSS_SELECTOR, "tr.mind .sample")]
    assert pinned == [texts[2]] * 3  # greedy: mind 2's text in every row
    command = chromium.find_elements(By.CSS_SELECTOR, "#minds-out pre.command")[0].get_property("textContent")
    assert printed_samples(run_command(command, data_root, tmp_path)) == [t + "\n" for t in pinned]


def test_the_page_in_chromium_flips_a_bit_of_z_and_keeps_its_state_in_the_url(server, runs, chromium, data_root,
                                                                              tmp_path):
    from selenium.webdriver.common.by import By

    wait, fill, go = page(chromium, server)
    chromium.get(f"http://{server[0]}/")
    wait.until(lambda b: b.find_element(By.ID, "run").get_attribute("value"))
    chromium.find_element(By.CSS_SELECTOR, "nav button[data-view=z]").click()
    fill({"run": str(runs / "free"), "z-reference": "K>____KKKKKKKK_______", "z-k": "2", "z-max_new_tokens": "20",
          "z-latent_seed": "4", "z-seed": "9"})
    go("z")
    kl = [c.text for c in chromium.find_elements(By.CSS_SELECTOR, "tr.klrow td.kl")]
    command = chromium.find_elements(By.CSS_SELECTOR, "#z-out pre.command")[-1].get_property("textContent")
    assert run_command(command, data_root, tmp_path).splitlines()[-1] == "KL bits: " + " ".join(kl)
    # beside the grid: the mean KL per position, large, and the verdict, as the evaluate.py command prints them
    answer = chromium.execute_script("return answers.z.answer[1]")
    assert chromium.find_element(By.CSS_SELECTOR, "#z-out .zview .headline").text == \
        f"{answer['kl_mean']:.4f} bits per position"
    lines = run_command(chromium.find_element(By.CSS_SELECTOR, "#z-out .side pre.command").get_property(
        "textContent"), data_root, tmp_path).splitlines()[-2:]
    assert lines == answer["lines"] and chromium.find_element(By.CSS_SELECTOR, "#z-out p.verdict").text == lines[1]
    bits = chromium.execute_script("return answers.z.answer[1].bits")
    chromium.find_element(By.CSS_SELECTOR, "td.flip[data-position='3'][data-bit='2']").click()
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#z-out p.warning")
               and b.find_element(By.ID, "status").text == "done")
    flipped = chromium.execute_script("return answers.z.answer[1].bits")
    assert [i for i, (a, b) in enumerate(zip(bits, flipped)) if a != b] == [3] and \
        [i for i, (a, b) in enumerate(zip(bits[3], flipped[3])) if a != b] == [2]
    texts = [r.get_attribute("data-text") for r in chromium.find_elements(By.CSS_SELECTOR, "tr.zsample")]
    command = chromium.find_elements(By.CSS_SELECTOR, "#z-out pre.command")[-1].get_property("textContent")
    assert printed_samples(run_command(command, data_root, tmp_path)) == \
        [f"{t}\nZ: {' '.join(flipped)}\n" for t in texts]
    # the URL holds the view and its fields: opened afresh, it computes the same view again
    url = chromium.current_url
    assert "view=z" in url and "z=" in url
    chromium.get("about:blank")
    chromium.get(url)
    wait.until(lambda b: b.find_element(By.ID, "status").text == "done")
    assert [r.get_attribute("data-text") for r in chromium.find_elements(By.CSS_SELECTOR, "tr.zsample")] == texts
    # export: the answer shown, with its request, as a JSON file
    chromium.find_element(By.CSS_SELECTOR, "button.export[data-view=z]").click()
    path = os.path.join(chromium.downloads, "nanolatent-z.json")
    deadline = time.time() + TIMEOUT
    while not os.path.exists(path):
        assert time.time() < deadline
        time.sleep(0.2)
    time.sleep(0.5)
    with open(path) as f:
        exported = json.load(f)
    assert exported["view"] == "z" and exported["request"]["z"] == " ".join(flipped)
    assert exported["answer"][1]["texts"] == texts and exported["answer"][1]["bits"] == flipped
