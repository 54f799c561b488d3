"""The regime check's no-model baselines (docs/reproductions.md, rule 3) for the language-model studies: the add-one
unigram and bigram, the interpolated Kneser–Ney bigram (discount 0.75, not tuned) and the unigram with the same
discount (experiments/stats.py), counted on a study's training tokens and scored on exactly the tokens its evaluate.py
JSON scored (its dataset, window length and number of windows), written to assets/regime_baselines.json, one entry
per study's evaluation, which experiments/results.py reads.

    python -m experiments.baselines                                   # every evaluation named in `evals`
    python -m experiments.baselines --evals=eve_primary_m1.json,      # one more, joining the others in the file

Each dataset must be prepared as its study's section in docs/reproductions.md (wp25_cpu, wp_sample_cpu, wp500_cpu) or
docs/free_text.md (shakespeare_char) says."""

import json
import os

import configurator  # before torch: it answers a bare --help from this file's source

import numpy as np

from experiments import stats
from nanolatent import common, tokendata

evals = ("eve_primary_m1.json", "eve_study_m1.json", "eve_paper_protocol_m1.json",
         "eve_paper_protocol_trained5_m1.json", "eve_paper_protocol_trained16_m1.json", "eve_second_pilot_m1.json",
         "free_text.json")
# evaluate.py JSON in assets/, or a study's: experiments/free_text.py calls evaluate.py on the first max_tokens of the
# split in windows of its runs' block_size (config/det_text.py), which its JSON does not record
BLOCK_SIZE = {"free_text.json": 128}
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
    dataset = record["dataset"]
    T = record.get("seq_len") or BLOCK_SIZE[name]
    windows = record.get("windows") or -(-record["max_tokens"] // T)  # evaluate.py's ceil(max_tokens / T)
    meta = tokendata.load_meta(dataset)
    train, val = (np.fromfile(os.path.join(tokendata.data_dir(dataset), f"{split}.bin"), dtype=meta["dtype"])
                  for split in ("train", "val"))
    starts = list(range(0, len(val) - T, T))[:windows]  # evaluate.py's non-overlapping windows, the first `windows`
    base = stats.ngram_baselines(train, val, starts, T, meta["vocab_size"])
    table[name] = {"dataset": dataset, "train_tokens": len(train), "seq_len": T, "windows": windows, **base}
    print(f"{name}: {dataset}, {base['tokens']:,} tokens in {windows} windows of {T}, counted on {len(train):,} "
          f"training tokens: add-one unigram {base['unigram']:.3f}, bigram {base['bigram']:.3f}; discounted unigram "
          f"{base['kn_unigram']:.3f}, Kneser–Ney bigram {base['kn_bigram']:.3f} nats/token")
with common.replacing(path) as tmp, open(tmp, "w") as f:
    json.dump(table, f, indent=1)
print(f"wrote {path}")
