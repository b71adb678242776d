"""The parity table of docs/parity.md from the parity suite's JSON rows.

    python -m megatron_pg_agg.parity --json parity.json      # run the suite (both launches)
    python benchmarks/parity_table.py parity.json             # print the markdown table
    python benchmarks/parity_table.py parity.json --doc docs/parity.md   # replace the table there

tests/distributed/test_parity.py checks docs/parity.md's table against the JSON of the suite it runs,
in what is stable across machines (rows, verdicts, errors within their tolerances, reference J to
1e-5).
"""
import argparse
import json

from megatron_pg_agg.parity import find_markdown_table, markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="rows written by python -m megatron_pg_agg.parity --json")
    parser.add_argument("--doc", "--readme", dest="doc", metavar="FILE",
                        help="replace the parity table in this markdown file (docs/parity.md)")
    args = parser.parse_args()
    with open(args.json) as f:
        table = markdown_table(json.load(f))
    if not args.doc:
        print(table, end="")
        return
    with open(args.doc) as f:
        text = f.read()
    start, end = find_markdown_table(text)
    with open(args.doc, "w") as f:
        f.write(text[:start] + table + text[end:])
    print(f"{args.doc}: parity table replaced ({table.count(chr(10)) - 2} rows)")


if __name__ == "__main__":
    main()
