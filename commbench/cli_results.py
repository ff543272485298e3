"""The verbs that read results files and judge them: compare, check, baseline
promote, import nccl-tests. Their parsers and thin handlers; cli.py wires them in."""
import json
import os
import sys

VERBS = ("compare", "check", "baseline", "import")


def add_parsers(sub):
    c = sub.add_parser("compare", help="systems side by side: p50, busbw, ratio and verdict per common Case")
    c.add_argument("files", nargs="+", metavar="RESULTS", help="two or more results files; the first is the reference")
    c.add_argument("--labels", default=None, help="comma-separated names of the systems (default: their hosts)")
    c.add_argument("--factor", type=float, default=1.05,
                   help="practical threshold: a verdict needs p50 ratio > F or < 1/F (default 1.05)")
    c.add_argument("--alpha", type=float, default=0.05, help="significance level after Holm (default 0.05)")
    c.add_argument("--plot", default=None, help="write busbw vs size per system and collective to this "
                                                ".png/.pdf/.svg")
    c.add_argument("--force", action="store_true", help="replace an existing --plot file")
    c.add_argument("--compute", nargs="+", default=None, metavar="FILE",
                   help="kernel times (commbench compute), one file per system in order: adds the predicted "
                        "step time of the plans in the headers")
    c.add_argument("--json", action="store_true", help="one JSON document on stdout")
    k = sub.add_parser("check", help="regression gate: exit 1 when a Case got significantly slower than the baseline")
    k.add_argument("--baseline", required=True, help="baseline results file (e.g. baselines/NAME.jsonl)")
    k.add_argument("new", help="results file to check")
    k.add_argument("--factor", type=float, default=1.05, help="slower means p50 ratio > F (default 1.05)")
    k.add_argument("--alpha", type=float, default=0.05, help="significance level after Holm (default 0.05)")
    k.add_argument("--summary", default=None,
                   help="also write the markdown summary here (default: $GITHUB_STEP_SUMMARY when set, appended)")
    k.add_argument("--force", action="store_true", help="replace an existing --summary file")
    k.add_argument("--json", action="store_true", help="print the report as one JSON document instead of markdown")
    b = sub.add_parser("baseline", help="manage reference results under baselines/")
    bs = b.add_subparsers(dest="baseline_verb", metavar="ACTION")
    bs.required = True
    p = bs.add_parser("promote", help="file RESULT as baselines/NAME.jsonl with its provenance")
    p.add_argument("result")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="replace an existing baseline")
    p.add_argument("--dir", default="baselines", help="baselines directory (default baselines)")
    i = sub.add_parser("import", help="convert other tools' output into a commbench results file")
    isub = i.add_subparsers(dest="import_format", metavar="FORMAT")
    isub.required = True
    n = isub.add_parser("nccl-tests", help="an nccl-tests text log or JSON output file")
    n.add_argument("log")
    n.add_argument("--out", default=None, help="results file (default results/nccl-tests-LOGNAME.jsonl)")
    n.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    n.add_argument("--op", default=None, help="the collective, when neither the log nor its file name says it")
    n.add_argument("--json", action="store_true", help="print the imported file as one JSON document")


def dispatch(a) -> int:
    return {"compare": cmd_compare, "check": cmd_check, "baseline": cmd_baseline, "import": cmd_import}[a.verb](a)


def cmd_compare(a) -> int:
    from commbench import compare, outputs, results
    if a.plot is not None:
        outputs.check_plot(a.plot, a.force)
    files = compare.load_all(a.files)
    for path in a.compute or []:
        results.load(path)                  # a missing or broken --compute file is bad input, not a note
    labels = compare.labels_for(files, [s.strip() for s in a.labels.split(",")] if a.labels else None)
    doc = compare.compare(files, labels, a.factor, a.alpha)
    doc["predictions"], notes = compare.predictions(files, labels, a.compute)
    doc["notes"] += notes
    if not doc["cases"] and not doc["predictions"]:
        raise ValueError(f"{', '.join(a.files)}: no Case is common to all files and no plan is predicted: "
                         "nothing to compare")
    if a.plot is not None:
        compare.plot(files, labels, a.plot)
        doc["plot"] = a.plot
    if a.json:
        print(json.dumps(doc))
        return 0
    from rich.console import Console
    from commbench import compare_console
    compare_console.print_compare(doc, Console(width=200))
    return 0


def cmd_check(a) -> int:
    from commbench import check, outputs
    if a.summary is not None:
        outputs.check_new(a.summary, a.force, "--summary")
    doc = check.check(a.baseline, a.new, a.factor, a.alpha)
    md = check.markdown(doc)
    target, mode = a.summary, "w"
    if target is None and os.environ.get("GITHUB_STEP_SUMMARY"):
        target, mode = os.environ["GITHUB_STEP_SUMMARY"], "a"
    if target:
        try:
            with open(target, mode, encoding="utf-8") as f:
                f.write(md)
        except OSError as e:
            raise ValueError(f"cannot write the summary to {target}: {e.strerror}") from None
    print(json.dumps(doc) if a.json else md, end="\n" if a.json else "")
    return check.exit_code(doc)


def cmd_baseline(a) -> int:
    from commbench import baseline
    out = baseline.promote(a.result, a.name, a.force, a.dir)
    print(f"promoted {a.result} to {out}")
    return 0


def cmd_import(a) -> int:
    from commbench import import_nccl
    rf = import_nccl.convert(a.log, a.op)
    out = import_nccl.write(rf, a.out or import_nccl.default_out(a.log), a.force)
    if a.json:
        print(json.dumps(rf.to_json()))
    else:
        ops = sorted({m.case.op for m in rf.measurements})
        print(f"imported {len(rf.measurements)} measurements ({', '.join(ops)}; {rf.header['cluster']['num_ranks']} "
              f"ranks) from {a.log} into {out}", file=sys.stdout)
    return 0
