"""`reap corpora list | show NAME | build [NAMES...]`: inspect and regenerate corpora."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from reap.corpora import corpus_info, list_corpora, load_documents
from reap.corpora.mix import seeded_order
from reap.corpora.store import SPLITS, corpora_root, local_root
from reap.errors import ReapError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.add_parser("list", help="table of corpora with documents and MB per split")
    show = sub.add_parser("show", help="print sample documents of a corpus")
    show.add_argument("name", help="corpus name, local .txt/.jsonl/.parquet path or hf:NAME")
    show.add_argument("--split", default="calibration", choices=SPLITS)
    show.add_argument("-n", type=int, default=3, help="documents to show (default 3)")
    show.add_argument("--seed", type=int, default=0, help="which documents (seeded order)")
    show.add_argument("--chars", type=int, default=800, help="characters per document")
    build = sub.add_parser("build", help="regenerate corpora from Debian packages")
    build.add_argument("names", nargs="*", help="corpora to build (default: all)")
    build.add_argument("--cache", type=Path, default=None,
                       help="download/unpack cache (default ~/.cache/reap)")
    build.add_argument("--out", type=Path, default=None,
                       help="output directory (default: the shipped corpora/, or the local-only "
                            "directory with --local-only-sources)")
    build.add_argument("--local-only-sources", action="store_true",
                       help="also build corpora whose text has unclear provenance (never commit)")


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def cmd_list() -> int:
    rows = [("corpus", "languages", "train docs/MB", "calib docs/MB", "eval docs/MB", "sha256")]
    for info in list_corpora():
        cells = []
        for s in SPLITS:
            si = info.splits.get(s)
            cells.append(f"{si.docs}/{_mb(si.bytes)}" if si else "not built")
        tag = " (mix)" if info.mix else " (local-only)" if info.local_only else ""
        rows.append((info.name + tag, ",".join(info.languages), *cells, info.sha256[:12] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print("MB = 10^6 UTF-8 bytes (= tokens of the byte-level tokenizer); train is the shipped part")
    return 0


def cmd_show(args) -> int:
    docs = seeded_order(load_documents(args.name, args.split), args.seed)
    if not docs:
        raise ReapError(f"{args.name}: the {args.split} split is empty")
    print(f"{args.name} / {args.split}: {len(docs)} documents")
    for d in docs[: max(args.n, 0)]:
        text = d.text if len(d.text) <= args.chars else d.text[: args.chars] + " ..."
        print(f"\n--- {d.id}  [{d.source}, {len(d.text.encode())} bytes]")
        print(textwrap.indent(text, "  "))
    return 0


def cmd_build(args) -> int:
    from reap.corpora.builder.pipeline import build
    from reap.fileio import check_out_dir
    out = args.out or (local_root() if args.local_only_sources else corpora_root())
    for name in args.names:
        corpus_info(name)  # unknown name -> ReapError before any download
    check_out_dir(out)
    paths = build(args.names or None, out=out, cache=args.cache,
                  local_only=args.local_only_sources, log=lambda m: print(m, flush=True))
    print(f"wrote {len(paths)} manifests under {out}")
    return 0


def run(args) -> int:
    if args.action == "list":
        return cmd_list()
    if args.action == "show":
        return cmd_show(args)
    if args.action == "build":
        return cmd_build(args)
    raise ReapError("choose an action: list, show or build")
