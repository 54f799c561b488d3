"""The regime check's no-model baselines (docs/reproductions.md, rule 3) for the language-model studies: the add-one
unigram and bigram models counted on a study's training tokens, scored on exactly the tokens its evaluate.py JSON
scored (its dataset, window length and number of windows), written to assets/regime_baselines.json, which
experiments/results.py reads.

    python -m experiments.baselines                                   # every evaluation named in `evals`
    python -m experiments.baselines --evals=eve_primary_m1.json,      # one more, joining the others in the file

Each dataset must be prepared as its study's section in docs/reproductions.md says (wp25_cpu, wp_sample_cpu)."""

import json
import os

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np

from experiments import stats
from nanolatent import tokendata

evals = ("eve_study_m1.json", "eve_paper_protocol_m1.json", "eve_paper_protocol_trained5_m1.json",
         "eve_paper_protocol_trained16_m1.json")  # evaluate.py JSON in assets/
out = "assets/regime_baselines.json"
configurator.apply(globals())

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
path = os.path.join(ROOT, out)
table = {}
if os.path.exists(path):
    with open(path) as f:
        table = json.load(f)
for name in evals:
    with open(os.path.join(ROOT, "assets", name)) as f:
        record = json.load(f)
    dataset, T, windows = record["dataset"], record["seq_len"], record["windows"]
    meta = tokendata.load_meta(dataset)
    train, val = (np.fromfile(os.path.join(tokendata.data_dir(dataset), f"{split}.bin"), dtype=meta["dtype"])
                  for split in ("train", "val"))
    starts = list(range(0, len(val) - T, T))[:windows]  # evaluate.py's non-overlapping windows, the first `windows`
    unigram, bigram, tokens = stats.ngram_baselines(train, val, starts, T, meta["vocab_size"])
    table[name] = {"dataset": dataset, "train_tokens": len(train), "seq_len": T, "windows": windows,
                   "tokens": tokens, "unigram": unigram, "bigram": bigram}
    print(f"{name}: {dataset}, {tokens:,} tokens in {windows} windows of {T}: add-one unigram {unigram:.3f}, "
          f"bigram {bigram:.3f} nats/token (counted on {len(train):,} training tokens)")
with open(path + ".tmp", "w") as f:
    json.dump(table, f, indent=1)
os.replace(path + ".tmp", path)
print(f"wrote {path}")
