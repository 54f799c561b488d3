"""scripts/explore.py, the latent page, against the scripts it stands for: on tiny trained det, EVE and Free runs, its
server (on 127.0.0.1, a free port) answers each view with exactly the texts and numbers of the sample.py or
evaluate.py command it shows, the page in headless Chromium shows them, and bad input is one message in the page and
in the server's log, with the server still up and the run folders untouched."""

import json
import os
import shlex
import shutil
import socket
import time
import urllib.error
import urllib.request

import pytest

from conftest import TINY, run_script, start_script, wait_for_line
from nanolatent import tasks

pytestmark = pytest.mark.slow  # a server, the scripts and a browser, spawned
TIMEOUT = 120  # seconds for any one request or wait; every request goes to 127.0.0.1


@pytest.fixture(scope="module")
def runs(data_root, tmp_path_factory):
    """Tiny det, EVE and Free runs on the synthetic task (a few seconds each)."""
    root = tmp_path_factory.mktemp("explore")
    for model in ("det", "eve", "free"):
        run_script("train.py", f"--model_type={model}", f"--out_dir={root / model}", *TINY, "--max_iters=20",
                   "--eval_interval=20", data_dir=data_root)
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
    checkpoint became B-Trans minds, if any."""
    if stdout.startswith("loaded a det checkpoint into btrans;"):
        stdout = stdout.split("\n", 1)[1]
    return stdout.split("---------------\n")[:-1]


def run_files(runs):
    """Every file under the run folders with its size and modification time."""
    return {os.path.join(d, f): (os.path.getsize(os.path.join(d, f)), os.path.getmtime(os.path.join(d, f)))
            for model in ("det", "eve", "free") for d, _, files in os.walk(runs / model) for f in files}


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


def test_minds_of_a_det_run_are_sample_py_minds_with_evaluate_py_nll_under_the_mean_model(server, runs, data_root,
                                                                                         tmp_path):
    status, events = post(server, "minds", run=str(runs / "det"), prompt="K>", k="3", sigma="0.3",
                          max_new_tokens="64", temperature="1.0", latent_seed="2", seed="7")
    minds = events[-1]
    assert status == 200 and printed_samples(run_command(minds["command"], data_root, tmp_path)) == \
        [t + "\n" for t in minds["texts"]]
    for nll, command in zip(minds["nll"], minds["nll_commands"]):
        run_command(command + " --out_json=tokens.json", data_root, tmp_path)
        with open(tmp_path / "tokens.json") as f:
            per_token = json.load(f)["results"][str(runs / "det")]["nll"]
        assert nll == sum(per_token) / len(per_token)
    answers = [tasks.letters_answer(t[len("K>"):]) for t in minds["texts"]]  # the synthetic task's answers
    assert minds["answers"] == answers and minds["majority"] == tasks.majority_answer(answers)


def test_z_shows_the_bits_and_texts_of_sample_py_show_latents(server, runs, data_root, tmp_path):
    reference = "K>____KKKKKKKK_______"
    status, events = post(server, "z", run=str(runs / "free"), prompt="K>", reference=reference, k="3",
                          max_new_tokens="20", temperature="0.8", latent_seed="4", seed="9")
    z = events[-1]
    assert status == 200 and len(z["bits"]) == len(reference) and all(len(b) == 8 for b in z["bits"])
    expected = [f"{text}\nZ: {' '.join(z['bits'])}\n" for text in z["texts"]]
    assert printed_samples(run_command(z["command"], data_root, tmp_path)) == expected
    assert ["".join(row) for row in z["tokens"]] == z["texts"]


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


def test_a_browser_closing_mid_generation_stops_it_and_the_server_goes_on(server, runs):
    host, port = server[0].split(":")
    body = json.dumps(dict(GROUP, run=str(runs / "free"), k="64", groups="16", max_new_tokens="60")).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST /api/groups HTTP/1.1\r\nHost: " + server[0].encode() + b"\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b'"partial": 0' not in received:  # the headers, the first line, then the first tokens: close then
            chunk = s.recv(65536)
            assert chunk, received
            received += chunk
    deadline = time.time() + TIMEOUT
    while "the browser closed the connection during /api/groups" not in open(server[1]).read():
        assert time.time() < deadline
        time.sleep(0.2)
    status, events = post(server, "uncertainty", run=str(runs / "free"), text="K>__", passes="2", seed="1")
    assert status == 200 and len(events[0]["nll"]) == 3


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
    browser = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
    browser.set_page_load_timeout(TIMEOUT)
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
