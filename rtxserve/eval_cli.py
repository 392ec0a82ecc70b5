"""`rtxserve eval BOX MODEL`: is what the box serves what was trained? The model's reference set (written beside it by
`rtxserve export`) sent through the box's gateway and compared (loadtest/eval/); a report, and exit status 1 on drift.

Exit status: 0 passed, 1 drifted, 2 bad input (no reference set, an unknown box, a flag the model's family does not
read), 3 the box did not answer.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from core.reference import FILE, Item, ReferenceError, ReferenceSet, read_eval_set

# The drift flags, each read by the families whose `drift_flag` it is (loadtest/eval/families.py).
DRIFT_FLAGS = {
    "--max-logit-diff": "classifiers: the largest |Δlogit| of an input (logits centred: the served probabilities' logs)",
    "--max-score-diff": "NER and detection: the largest |Δscore| of an entity or matched detection",
    "--max-cosine-distance": "embeddings: the largest 1 - cosine of a served vector to the framework's",
    "--max-logprob-diff": "LLMs: the largest mean |Δlogprob| of an input's greedy continuation",
    "--max-wer": "speech: the largest word error rate of a served transcript against the framework's",
    "--max-pixel-diff": "image generation: the largest mean |Δpixel| (0-255) of a fixed-seed image",
}


def add_eval_options(parser: argparse.ArgumentParser) -> None:
    """The thresholds and the key, shared with `rtxserve promote` (its eval gate)."""
    parser.add_argument("--api-key", default=os.environ.get("RTXSERVE_API_KEY", ""),
                        help="the gateway key, sent as Authorization: Bearer (env RTXSERVE_API_KEY)")
    parser.add_argument("--min-agreement", type=float, help="the least share of inputs whose answer must agree with "
                        "the framework's (label, entities, detections, greedy continuation, transcript); default: "
                        "1.0 for an exact artifact, less for int8 / fp16 (see docs)")
    for flag, text in DRIFT_FLAGS.items():
        parser.add_argument(flag, type=float, help=text + " (default: the family's; see docs)")
    parser.add_argument("--tie-logprob", type=float, help="LLMs: how much less likely (log-probability, to the "
                        "framework) a served token may be where the continuations part, for a near tie (default 0.5)")


def limits(args, family) -> dict:
    """The thresholds given on the command line for `family`; ValueError for a drift flag another family reads."""
    given = {f: getattr(args, f.lstrip("-").replace("-", "_")) for f in DRIFT_FLAGS}
    wrong = [f for f, v in given.items() if v is not None and f != family.drift_flag]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} does not apply to {family.task[0]} models; their drift is "
                         f"{family.drift_name} ({family.drift_flag})")
    return {"agreement": args.min_agreement, "drift": given[family.drift_flag]}


def reference_for(target, model: str, reference: Path | None, eval_set: Path | None, task: str | None) -> ReferenceSet:
    """The reference set to send: the one beside the model (or at --reference), or, for a model exported before
    reference sets, the eval set's inputs with their right answers only."""
    folder = reference or target.artifact(model)
    if folder is None and eval_set is None:
        raise ReferenceError(f"{model}: where its reference set is is not known here (a box given by URL, or a model "
                             "its deployment file does not name): pass --reference FOLDER (the entry or package "
                             f"folder, or its {FILE})")
    try:
        if folder is None:
            raise ReferenceError("no reference folder")
        return ReferenceSet.read(folder)
    except ReferenceError:
        if eval_set is None:
            raise
        if task is None:
            raise ReferenceError(f"{model} has no reference set; with --eval-set only, give its --task") from None
        items: list[Item] = read_eval_set(eval_set, task)
        if all(i.gold is None for i in items):
            raise ReferenceError(f"{model} has no reference set and {eval_set} gives no right answers: nothing to "
                                 "compare the served answers with. Export the model again to write its reference set")
        return ReferenceSet(task=task, framework="(none: the right answers of the eval set only)", made_from=str(eval_set),
                            items=items)


def main(argv: list[str]) -> int:
    from deploy.box_target import resolve_box
    from deploy.spec import DeploymentError
    from loadtest.eval.report import write
    from loadtest.eval.run import evaluate, family

    parser = argparse.ArgumentParser(prog="rtxserve eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("box", help="the gateway's URL, or a box `serve up` runs: its deployment file, name or run folder")
    parser.add_argument("model", help="the served model to check (a name the gateway serves)")
    parser.add_argument("--reference", type=Path, help=f"the model's entry or package folder, or its {FILE} (default: "
                        "where the deployment file puts the model)")
    parser.add_argument("--eval-set", type=Path, help="for a model exported before reference sets: JSON lines of inputs "
                        "with their right answers (as export's --eval-set); the served answers are held to those only")
    parser.add_argument("--task", help="with --eval-set and no reference set: the model's task")
    parser.add_argument("--out", type=Path, help="the report's folder (default: reports/eval-MODEL)")
    add_eval_options(parser)
    args = parser.parse_args(argv)
    try:
        target = resolve_box(args.box)
        ref = reference_for(target, args.model, args.reference, args.eval_set, args.task)
        fam = family(ref.task)
        given = limits(args, fam)
    except (DeploymentError, ReferenceError, ValueError, OSError) as exc:
        print(f"rtxserve eval: error: {exc}", file=sys.stderr)
        return 2
    print(f"sending {len(ref.items)} inputs of {args.model}'s reference set ({ref.made_from}) to {target.url}",
          file=sys.stderr)
    result = evaluate(target.url, args.model, ref, limits=given, api_key=args.api_key,
                      settings={"tie_logprob": args.tie_logprob} if args.tie_logprob is not None else None,
                      progress=lambda done, total: print(f"\r  {done}/{total}", end="", file=sys.stderr, flush=True))
    print(file=sys.stderr)
    page = write(result, args.out or Path("reports") / f"eval-{args.model}")
    print(f"{args.model}: {result.verdict()}\nreport: {page} (and eval.html, eval.png, eval.json beside it)")
    if all(a.served.startswith(("(no answer)",)) for a in result.answers):
        return 3
    return 0 if result.passed else 1
