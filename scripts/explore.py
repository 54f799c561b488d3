"""A local page that shows what the latents do, and how much: groups of samples sharing one draw against a draw each
(with their agreement per position), B-Trans minds beside the mean model, per-token uncertainty with each pass's top
tokens, and the Free Transformer's Z with its KL per position, each with the sample.py or evaluate.py command that
prints the same texts and numbers.

    python -m scripts.explore --out_dir=out --port=8000      # then open http://127.0.0.1:8000

Python's http.server on 127.0.0.1 only, and one HTML file beside this one (plain JavaScript, nothing fetched from the
internet). The run it opens with is loaded before it serves; another run or model type on first use (the last four are
kept), each under a progress line (common.phase). Every number comes from sampling.py, the functions sample.py and
evaluate.py call; the server writes no file. A request is a JSON object of the page's fields; the answer streams as
JSON lines: the tokens so far while a generation runs, then each block of samples or the scores, or one {"error": ...}
line, which the log also prints. One view computes at a time: a request meanwhile is answered "busy" (503) at once,
and a request that is malformed or not sent whole within READ_TIMEOUT seconds is answered 400, both in one line; up
to Server.request_queue_size clients at once each get their answer. Ctrl-C ends the server at once, whatever it does.
"""

import http.server
import json
import os
import shlex
import signal
import sys
import threading
import time

# Ctrl-C, at any moment (torch loading, a run loading, a view computing in its thread): the process ends at once. The
# server writes no file, so nothing is lost; Python's own exit would abort the process while a thread is inside torch.
signal.signal(signal.SIGINT, lambda signum, frame: (os.write(sys.stdout.fileno(), b"stopped\n"), os._exit(0)))

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np
import torch

from nanolatent import ckpt, common, metrics, sampling, tasks, tokendata

out_dir = "out"  # the run the page opens with (its folder or a ckpt.pt); the page can name another
port = 8000  # on 127.0.0.1; 0 picks a free port (the first line printed names it)
device = "cpu"
stream_every = 0.2  # seconds between two lines of a generation's tokens so far (0: a line every token)
# ----------------------------------------------------------------------------------------------------------------
configurator.apply(globals())
MAX_SAMPLES, MAX_GROUPS, MAX_PASSES = 64, 16, 64  # per request: a page answers in seconds, not hours
Z_PASSES = 8  # Z's verdict: draws of Z from the encoder and from the prior, each (evaluate.py's --mc_samples)
TOP_TOKENS = 5  # Uncertainty's panel: the most likely tokens of p̄ at a position, with each pass's probability of them
READ_TIMEOUT = 3  # seconds a client may take to send its request: a body shorter than its Content-Length ends there
SHOWN = 40  # characters of a bad value an error echoes (a 5,000-digit seed is not echoed whole)
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "explore.html")
ANSWER_PARSERS = {"synthetic": tasks.letters_answer, "arith": tasks.arith_answer}  # a dataset's answer, if it has one

compute = threading.Lock()  # one model computation at a time; another request meanwhile is answered "busy"
loaded = {}  # (run, model type, overrides) -> (model, checkpoint without its weights): the last few asked for


class ClientGone(Exception):
    """The browser closed the connection: nothing more to compute for it."""


LABELS = {"k": "K", "groups": "G", "max_new_tokens": "new tokens", "latent_seed": "latent seed", "seed": "seed",
          "passes": "passes M", "sigma": "σ", "temperature": "temperature", "pin": "pinned mind"}  # the page's names


def shown(value):
    """A value as an error echoes it: its repr, cut to its first SHOWN characters."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text):,} characters)"


def number(params, key, kind, low, high, why=""):
    """params[key] as an int or a float within [low, high], or one message naming the field and the value."""
    text = str(params.get(key, "")).strip()
    try:
        value = kind(text)
    except ValueError:  # also a whole number of more than 4,300 digits (Python's limit)
        common.die(f"{LABELS[key]} must be {'a whole number' if kind is int else 'a number'}, got {shown(text)}")
    if not low <= value <= high:  # NaN fails both comparisons
        common.die(f"{LABELS[key]}={text if len(text) <= SHOWN else shown(text)} is outside {low}..{high}{why}")
    return value


def text(params, key, required=True):
    value = params.get(key, "")
    if not isinstance(value, str) or required and not value:
        common.die(f"{key} must be {'a non-empty ' if required else 'a '}text, got {shown(value)}")
    return value


def load(params, model_type=None, **overrides):
    """The run the request names (the page's run field) as a model in eval mode, into model_type when given."""
    run = text(params, "run")
    if len(run) > 4096:  # longer than any path (PATH_MAX): not echoed whole by the messages that name the run
        common.die(f"run must be the path of a run's folder or ckpt.pt, got {shown(run)}")
    path = ckpt.checkpoint_path(run)  # a run trained again since is loaded again
    key = (run, os.path.getmtime(path) if os.path.exists(path) else None, model_type, tuple(sorted(overrides.items())))
    if key not in loaded:
        with common.phase(f"loading {run}" + (f" as {model_type}" if model_type else "")):  # 10 s for SmolLM2-135M
            checkpoint = ckpt.load_checkpoint(run)
            model, _ = ckpt.load_model(run, device, model_type, checkpoint=checkpoint, **overrides)
        checkpoint.pop("model")
        while len(loaded) >= 4:
            loaded.pop(next(iter(loaded)))
        loaded[key] = model.eval(), checkpoint
    return loaded[key]


def article(model_type):
    """'an eve', 'a free': the model type with its article."""
    return f"{'an' if model_type[0] in 'aeiou' else 'a'} {model_type}"


def command(script, params, **args):
    """The shell command that prints what a view shows: the same run, seeds and thread count (the products' rounding
    depends on it)."""
    words = [f"OMP_NUM_THREADS={torch.get_num_threads()}", "python", script, f"--out_dir={params['run']}"]
    words += [f"--{k}={v}" for k, v in args.items()]
    if torch.cuda.is_available():  # where the scripts would default to the GPU (and evaluate.py to 16 bits)
        words += [f"--device={device}", "--dtype=float32"]
    return " ".join(shlex.quote(w) for w in words)


def prompt_ids(model, encode, params, n_new):
    ids = encode(text(params, "prompt"))
    sampling.check_length(ids, model.config.block_size)
    if len(ids) + n_new > model.config.block_size:
        common.die(f"the prompt's {len(ids)} tokens + {n_new} new tokens exceed the context "
                   f"(block_size={model.config.block_size}): shorten the prompt or ask for fewer tokens")
    return ids


def generation(params, model):
    """The fields every sampling view shares, checked."""
    return dict(max_new_tokens=number(params, "max_new_tokens", int, 1, model.config.block_size),
                temperature=number(params, "temperature", float, 0, 100), seed=number(params, "seed", int, 0, 2**62),
                latent_seed=number(params, "latent_seed", int, 0, 2**62))


def streamed(send, decode, block, ids):
    """on_token for sampling.sample: the block's texts so far (the prompt `ids` and the new tokens), one line every
    stream_every seconds."""
    columns, last = [], [time.time()]

    def on_token(idx_next):
        columns.append(idx_next[:, 0].tolist())
        if time.time() - last[0] >= stream_every:
            send({"partial": block, "texts": [decode(ids + list(row)) for row in zip(*columns)]})
            last[0] = time.time()
    return on_token


def view_groups(params, send):
    """Free Fig. 3 live: G groups of K samples, each group one draw of the latents (latent seed, +1, ...), then K
    samples with a draw each; every block the same token seed."""
    model, checkpoint = load(params)
    encode, decode = tokendata.tokenizer(checkpoint["meta"])
    k = number(params, "k", int, 1, MAX_SAMPLES, " samples a group")
    groups = number(params, "groups", int, 1, MAX_GROUPS, " groups")
    gen = generation(params, model)
    ids = prompt_ids(model, encode, params, gen["max_new_tokens"])
    blocks = [("shared", gen["latent_seed"] + g) for g in range(groups)] + [("independent", gen["latent_seed"])]
    yield {"model_type": checkpoint["model_type"], "latent_kind": model.latent_kind, "blocks": len(blocks)}
    rows = []
    for b, (how, latent_seed) in enumerate(blocks):
        args = {**gen, "latent_seed": latent_seed}
        out, _ = sampling.sample(model, ids, k, latents=how, on_token=streamed(send, decode, b, ids), **args)
        rows.append(out.tolist())
        yield {"block": b, "latents": how, "latent_seed": latent_seed, "texts": [decode(r) for r in rows[-1]],
               "tokens": [[decode([t]) for t in r] for r in rows[-1]], "prompt_tokens": len(ids),
               "command": command("sample.py", params, start=params["prompt"], num_samples=k, latents=how, **args)}
    summary = sampling.group_summary(rows[:-1], rows[-1], len(ids), decode, checkpoint.get("config", {}).get("dataset"))
    yield {"summary": summary, "lines": sampling.summary_lines(summary),
           "command": command("sample.py", params, start=params["prompt"], num_samples=k, groups=groups, summary=True,
                              **gen)}


def view_minds(params, send):
    """K B-Trans minds for one prompt (a det run loads as B-Trans), each one's answer where the dataset has one and
    its NLL per token of one text, the mean model's first row (noise_mode='mean': mu, no eps), so that the NLLs
    differ by the minds alone; beside each mind's text, the mean model's with the same token draws (σ = 0), so what
    differs is the mind's. pin: every sample with that one mind's draw."""
    _, checkpoint = load(params)
    if checkpoint["model_type"] not in ("det", "btrans"):
        common.die(f"Minds shows B-Trans minds, from a det or btrans run; {params['run']} is "
                   f"{article(checkpoint['model_type'])} run")
    sigma = number(params, "sigma", float, 0, 10)
    model, _ = load(params, "btrans", sigma=sigma)
    mean_net, _ = load(params, "btrans", noise_mode="mean")
    encode, decode = tokendata.tokenizer(checkpoint["meta"])
    k = number(params, "k", int, 1, MAX_SAMPLES, " minds")
    pin = number(params, "pin", int, -1, k - 1, ": a mind of the K shown, or -1") if params.get("pin", "") != "" else -1
    gen = generation(params, model)
    ids = prompt_ids(model, encode, params, gen["max_new_tokens"])
    yield {"model_type": checkpoint["model_type"], "latent_kind": model.latent_kind, "blocks": 1}
    out, minds = sampling.sample(model, ids, k, latents="independent", on_token=streamed(send, decode, 0, ids),
                                 pin=pin, **gen)
    mean_out, _ = sampling.sample(mean_net, ids, k, latents="independent", **gen)
    rows, mean_rows = out.tolist(), mean_out.tolist()
    texts = [decode(r) for r in rows]
    answer = ANSWER_PARSERS.get(checkpoint.get("config", {}).get("dataset"))
    answers = [answer(decode(r[len(ids):])) if answer else None for r in rows]
    nll = sampling.minds_nll(model, mean_rows[0], minds)  # one text for all: the mean model's first row
    pinned = {"pin_mind": pin} if pin >= 0 else {}
    yield {"block": 0, "texts": texts, "tokens": [[decode([t]) for t in r] for r in rows], "prompt_tokens": len(ids),
           "mean_texts": [decode(r) for r in mean_rows], "mean_tokens": [[decode([t]) for t in r] for r in mean_rows],
           "differ": [sum(a != b for a, b in zip(r, m)) for r, m in zip(rows, mean_rows)], "pin": pin, "nll": nll,
           "nll_text": decode(mean_rows[0]), "nll_std": float(np.std(nll)), "nll_range": max(nll) - min(nll),
           "headline": sampling.minds_line(nll, sigma), "answers": answers,
           "majority": metrics.majority_answer(answers) if answer else None,
           "command": command("sample.py", params, model_type="btrans", sigma=sigma, minds=k, **pinned,
                              start=params["prompt"], **gen),
           "mean_command": command("sample.py", params, model_type="btrans", noise_mode="mean", num_samples=k,
                                   start=params["prompt"], **gen)}


def view_uncertainty(params, send):
    """Each token of a text over M passes with fresh latents: nll, H(p̄), mean H(p_m) and the mutual information;
    and at each position the top-k tokens of p̄ with each pass's probability of them."""
    model, checkpoint = load(params)
    encode, decode = tokendata.tokenizer(checkpoint["meta"])
    body = text(params, "text")
    passes = number(params, "passes", int, 1, MAX_PASSES, " passes")
    seed = number(params, "seed", int, 0, 2**62)
    ids = encode(body)
    torch.manual_seed(seed)  # as evaluate.py's load_net: the same draws
    scores = sampling.token_uncertainty(model, ids, passes, torch.Generator(device).manual_seed(seed))
    torch.manual_seed(seed)
    top = sampling.top_predictions(model, ids, passes, torch.Generator(device).manual_seed(seed), decode, TOP_TOKENS)
    yield {"model_type": checkpoint["model_type"], "latent_kind": model.latent_kind, "context": decode(ids[:1]),
           "tokens": [decode([t]) for t in ids[1:]], **scores, "top": top,
           "command": command("evaluate.py", params, task="tokens", text=body, mc_samples=passes, seed=seed,
                              top_tokens=TOP_TOKENS, out_json="tokens.json")}


def view_z(params, send):
    """The Free Transformer's Z, H bits per position, inferred by the encoder from a reference text (with each
    position's KL in bits) or drawn once (the prompt's from the encoder, the rest uniform), or as the page sends it
    (a bit flipped), and the texts the same Z gives with the token draws of N samples. Its headline: the KL of the
    encoder reading the reference (else the first sample) per position and in total, and the verdict on what Z
    changes in that text's NLL (sampling.z_lines), as evaluate.py --task=tokens prints them."""
    model, checkpoint = load(params)
    if model.latent_kind != "code":
        common.die(f"Z shows the Free Transformer's codes; {params['run']} is {article(checkpoint['model_type'])} run")
    encode, decode = tokendata.tokenizer(checkpoint["meta"])
    k = number(params, "k", int, 1, MAX_SAMPLES, " samples")
    reference = text(params, "reference", required=False)
    z = text(params, "z", required=False)
    codes = sampling.parse_bits(z, model.config.latent_bits) if z else None
    gen = generation(params, model)
    ids = prompt_ids(model, encode, params, gen["max_new_tokens"])
    how = "posterior" if reference else "shared"
    reference_ids = encode(reference) if reference else None
    yield {"model_type": checkpoint["model_type"], "latent_kind": model.latent_kind, "blocks": 1}
    out, pinned = sampling.sample(model, ids, k, latents=how, reference=reference_ids, codes=codes,
                                  on_token=streamed(send, decode, 0, ids), **gen)
    rows = out.tolist()
    args = {"reference": reference} if reference else {}
    read = reference_ids or rows[0]  # the text whose Z the headline measures: the reference, else the first sample
    kl, effect = (sampling.posterior_kl_bits(model, read),
                  sampling.z_effect_bits(model, read, Z_PASSES, gen["seed"]))
    yield {"block": 0, "texts": [decode(r) for r in rows], "tokens": [[decode([t]) for t in r] for r in rows],
           "bits": sampling.code_bits(pinned[0, :out.size(1)].tolist(), model.config.latent_bits),
           "reference_tokens": [decode([t]) for t in reference_ids] if reference else [],
           "kl_bits": [f"{v:.3f}" for v in kl] if reference else [],  # the grid's row: the reference's positions
           "kl_mean": sum(kl) / len(kl), "kl_total": sum(kl), "read": "the reference" if reference else "sample 0",
           "lines": sampling.z_lines(kl, effect),
           "command": command("sample.py", params, start=params["prompt"], num_samples=k, latents=how, **args,
                              show_latents=True, **({"z": z} if z else {}), **gen),
           "lines_command": command("evaluate.py", params, task="tokens", text=decode(read), mc_samples=Z_PASSES,
                                    seed=gen["seed"])}


VIEWS = {"/api/groups": view_groups, "/api/minds": view_minds, "/api/uncertainty": view_uncertainty,
         "/api/z": view_z}


BUSY = "busy: the server computes one view at a time; ask again when the current one is done"


class Server(http.server.ThreadingHTTPServer):
    """Each request in a thread of its own, as http.server's."""

    request_queue_size = 128  # connections waiting to be accepted: a burst of clients beyond it is reset by the OS,
    # answered by nobody; below it each one gets its answer (the page's, or "busy" at once)


class Page(http.server.BaseHTTPRequestHandler):
    """GET / is the page, GET /api/run what it opens with; POST /api/<view> computes a view."""

    timeout = READ_TIMEOUT  # on the socket until the request is read: a client that stops sending is let go

    def local(self):
        """Only pages of this server may ask it (a page elsewhere could name 127.0.0.1 through DNS)."""
        host = self.headers.get("Host", "")
        origin = self.headers.get("Origin")
        ours = {f"127.0.0.1:{self.server.server_port}", f"localhost:{self.server.server_port}"}
        if host in ours and (origin is None or origin.split("//", 1)[-1] in ours):
            return True
        self.reply(403, {"error": f"this server answers pages of http://127.0.0.1:{self.server.server_port} only"})
        return False

    def reply(self, status, payload, kind="application/json"):
        body = payload if isinstance(payload, bytes) else (json.dumps(payload) + "\n").encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client left before its answer: nothing to say to it
            pass

    def do_GET(self):
        if not self.local():
            return
        if self.path in ("/", "/index.html"):
            with open(PAGE, "rb") as f:
                self.reply(200, f.read(), "text/html; charset=utf-8")
        elif self.path == "/api/run":
            self.reply(200, {"run": out_dir, "model_type": opened["model_type"], "dataset": opened["dataset"]})
        else:
            self.reply(404, {"error": f"no page {shown(self.path)}"})

    def do_POST(self):
        if not self.local():
            return
        view = VIEWS.get(self.path)
        if view is None:
            self.reply(404, {"error": f"no view {shown(self.path)}: one of {', '.join(VIEWS)}"})
            return
        started = False

        def send(event):
            try:
                self.wfile.write((json.dumps(event) + "\n").encode())
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError) as e:
                raise ClientGone() from e

        try:
            params = self.request_fields()
            if not compute.acquire(blocking=False):  # a queue the page cannot see would look like a hang
                print(f"error: {BUSY}", file=sys.stderr, flush=True)
                self.reply(503, {"error": BUSY})
                return
            try:
                events = view(params, send)
                first = next(events)  # everything checked that can be before a token is drawn
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.end_headers()
                started = True
                send(first)
                for event in events:
                    send(event)
            finally:
                compute.release()
        except common.Refused as e:  # die printed the message to the log already
            if started:
                self.close_quietly(send, {"error": e.message})
            else:
                self.reply(400, {"error": e.message})
        except ClientGone:
            print(f"the browser closed the connection during {self.path}: stopped there; the server goes on",
                  file=sys.stderr, flush=True)
        except Exception as e:  # a fault of ours, not of the input: said in one line, and the server goes on
            message = f"{self.path} failed: {type(e).__name__}: {e}"
            print(f"error: {message}", file=sys.stderr, flush=True)
            if started:
                self.close_quietly(send, {"error": message})
            else:
                self.reply(500, {"error": message})

    def request_fields(self):
        """The request's JSON object, read within READ_TIMEOUT seconds, or one message: a Content-Length that is
        missing, not a positive whole number, over 1 MiB or longer than the body sent."""
        given = self.headers.get("Content-Length", "")
        try:
            length = int(given)
        except ValueError:
            common.die(f"Content-Length must be a whole number of bytes, got {shown(given)}")
        if not 0 < length <= 2**20:
            common.die(f"Content-Length={length} is outside 1..{2**20} bytes: the page sends its fields as JSON")
        body = b""
        try:
            while len(body) < length and (chunk := self.rfile.read1(length - len(body))):
                body += chunk
        except TimeoutError:
            pass
        self.connection.settimeout(None)  # the request is read: a generation's answer may take minutes to stream
        if len(body) < length:
            common.die(f"the request's body ended after {len(body)} of its Content-Length {length} bytes")
        try:
            params = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            common.die("the request is not JSON: the page sends its fields as a JSON object")
        except ValueError:  # a whole number of more than 4,300 digits, which Python will not read as an int
            common.die("a number in the request has more than 4,300 digits: the page sends its fields as texts")
        if not isinstance(params, dict):
            common.die("the request is not a JSON object of the view's fields")
        return params

    def close_quietly(self, send, event):
        try:
            send(event)
        except ClientGone:
            pass


if __name__ == "__main__":
    common.check_device(device)
    if not 0 <= port <= 65535:
        common.die(f"--port must be 0..65535, got {port}")
    # the run the page opens with, loaded before serving: a missing or unreadable run is one line, and the first view
    # answers without the model's loading
    _, checkpoint = load({"run": out_dir})
    opened = {"model_type": checkpoint["model_type"], "dataset": checkpoint.get("config", {}).get("dataset")}
    try:
        server = Server(("127.0.0.1", port), Page)
    except OSError as e:
        common.die(f"cannot listen on 127.0.0.1:{port}: {e.strerror or e}; choose another --port (0: any free one)")
    print(f"serving {out_dir} on http://127.0.0.1:{server.server_port} (Ctrl-C stops)", flush=True)
    server.serve_forever()
