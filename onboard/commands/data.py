"""`onboard data PKG --data F [--n 3]`: samples as the release's tokenizer and chat template render them for
training, the trained tokens marked (green on a terminal, else between [[ and ]]), and token counts.

Reads the data exactly as `onboard train` does (runtime/data/, runtime/train/data.py) and, of the package, only the
release folder it names (for the tokenizer): no weights, no model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onboard.commands.args import positive_int
from onboard.exit_codes import Exit
from runtime.data.formats import FORMATS

GREEN, RESET = "\033[32m", "\033[0m"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pkg")
    p.add_argument("--data", required=True, help="a jsonl, JSON-array, parquet or Arrow file, or a folder of them")
    p.add_argument("--data-format", choices=("auto", *FORMATS), default="auto",
                   help="the records' format (default: detected per record from its keys)")
    p.add_argument("--n", type=positive_int, default=3, help="samples to print (default 3)")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="rows of this length counted (default 2048)")
    p.add_argument("--model-dir", default=None, help="the release folder, if it moved since new-model")


def marked(tokenizer, ids: list[int], trained: list[bool], colour: bool) -> str:
    """The decoded sample, each run of trained tokens marked. Runs are cut from decodes of growing prefixes, so
    the text reads as one decode does (a run decoded alone can lose a leading space)."""
    bounds = [0] + [i for i in range(1, len(ids)) if trained[i] != trained[i - 1]] + [len(ids)]
    prefixes = [tokenizer.decode(ids[:b], skip_special_tokens=False) for b in bounds]
    if not all(b.startswith(a) for a, b in zip(prefixes, prefixes[1:])):
        prefixes = [""] + [tokenizer.decode(ids[:b], skip_special_tokens=False) for b in bounds[1:]]
        pieces = [tokenizer.decode(ids[a:b], skip_special_tokens=False) for a, b in zip(bounds, bounds[1:])]
    else:
        pieces = [b[len(a):] for a, b in zip(prefixes, prefixes[1:])]
    open_, close = (GREEN, RESET) if colour else ("[[", "]]")
    return "".join(f"{open_}{piece}{close}" if trained[start] else piece for piece, start in zip(pieces, bounds))


def run(args) -> Exit:
    from onboard.package.files import read_manifest_file, release_folder
    from onboard.package.trainer_build import load_tokenizer
    from runtime.data.files import read_rows
    from runtime.data.formats import samples
    from runtime.train.data import ChatTemplateError, pack, tokenize

    # the records first: a malformed line is refused before the tokenizer loads
    records = samples(read_rows(Path(args.data)), args.data_format)
    pkg = Path(args.pkg)
    release = release_folder(pkg, read_manifest_file(pkg).source, Path(args.model_dir) if args.model_dir else None)
    tokenizer = load_tokenizer(release)
    try:
        documents = tokenize(records, tokenizer)
    except ChatTemplateError as err:
        print(f"onboard: gap: {release}: chat template: {err}", file=sys.stderr)
        return Exit.GAPS
    colour = sys.stdout.isatty()
    for record, doc in list(zip(records, documents))[:args.n]:
        print(f"--- {record.origin} ({record.format}): {len(doc.ids)} tokens, {sum(doc.trained)} trained")
        print(marked(tokenizer, doc.ids, doc.trained, colour))
    formats = ", ".join(f"{f} {n}" for f in FORMATS if (n := sum(r.format == f for r in records)))
    tokens, trained = sum(len(d.ids) for d in documents), sum(sum(d.trained) for d in documents)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = len(pack(documents, args.seq_len, pad)) if documents else 0
    print(f"{len(records)} records ({formats}): {tokens} tokens, {trained} trained ({100 * trained / max(1, tokens):.0f}%); "
          f"{rows} row{'' if rows == 1 else 's'} of {args.seq_len} tokens")
    return Exit.OK
