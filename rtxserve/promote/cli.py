"""`rtxserve promote BOX --model NAME --to CANDIDATE`: load the candidate beside the model serving NAME, hold it to
what it was trained to answer (the eval gate), shadow it, move NAME's traffic to it in canary steps, switch, keep the
old model warm for a rollback window, then retire it; at the first breach, back to the old model. `--rollback` takes a
running promotion back by hand.

Exit status: 0 promoted, 1 rolled back, 2 refused before anything changed (a candidate of another task, labels or
tokenizer; no reference set; another promotion running), 3 the box did not answer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from core.reference import ReferenceError, ReferenceSet

from ..eval_cli import add_eval_options, limits


def _differences(current: ReferenceSet, candidate: ReferenceSet, allow_tokenizer: bool) -> list[str]:
    """What makes `candidate` no replacement for `current`, from their reference sets, before anything loads."""
    found = []
    if current.task != candidate.task:
        found.append(f"the task: {candidate.task}, not {current.task}")
    if current.labels and candidate.labels and current.labels != candidate.labels:
        if sorted(current.labels) == sorted(candidate.labels):
            found.append(f"the label map: the same labels in another order ({', '.join(candidate.labels)} against "
                         f"{', '.join(current.labels)})")
        else:
            gone, added = sorted(set(current.labels) - set(candidate.labels)), sorted(set(candidate.labels) - set(current.labels))
            found.append(f"the labels: {', '.join(gone) or 'none'} gone, {', '.join(added) or 'none'} added")
    if not allow_tokenizer and current.tokenizer and candidate.tokenizer and current.tokenizer != candidate.tokenizer:
        found.append("the tokenizer (its tokenizer.json differs: another base model?; --allow-new-tokenizer if meant)")
    return found


def _reference(target, name: str, given: Path | None, required: bool) -> ReferenceSet | None:
    folder = given or target.artifact(name)
    if folder is None:
        if required:
            raise ReferenceError(f"{name}: where its reference set is is not known here: pass --candidate-reference "
                                 "FOLDER (its entry or package folder)")
        return None
    try:
        return ReferenceSet.read(folder)
    except ReferenceError:
        if required:
            raise
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("box", help="the gateway's URL, or a box `serve up` runs: its deployment file, name or run folder")
    parser.add_argument("--model", required=True, help="the name clients call")
    parser.add_argument("--to", dest="candidate", help="the served model to put in front of it")
    parser.add_argument("--rollback", action="store_true", help="take the running promotion of --model back, now")
    parser.add_argument("--candidate-reference", type=Path, help="the candidate's entry or package folder (default: "
                        "where the deployment file puts it)")
    parser.add_argument("--current-reference", type=Path, help="the current model's, for the eval's comparison")
    parser.add_argument("--allow-new-tokenizer", action="store_true", help="a candidate whose tokenizer differs")
    parser.add_argument("--shadow-share", type=float, default=0.2, help="share of requests copied to the candidate")
    parser.add_argument("--shadow-seconds", type=float, default=20.0)
    parser.add_argument("--canary", default="10,25,50", help="the candidate's shares, percent, one step each")
    parser.add_argument("--step-seconds", type=float, default=15.0, help="how long each canary step is held")
    parser.add_argument("--rollback-window", type=float, default=30.0, help="seconds the old model stays warm after "
                        "the switch, while the candidate takes every request")
    parser.add_argument("--latency-margin", type=float, default=1.0, help="the candidate's P99 (P90 where a step has fewer "
                        "than 100 requests of either model; backend time) may be the "
                        "current's x (1 + this) + --latency-floor-ms, in the same step (after the switch: the current's "
                        "over the steps before)")
    parser.add_argument("--latency-floor-ms", type=float, default=10.0)
    parser.add_argument("--max-error-increase", type=float, default=0.01, help="the candidate's error rate may be the "
                        "current's + this")
    parser.add_argument("--min-requests", type=int, default=20, help="requests the candidate must answer in a step for "
                        "it to be judged (a step is held up to 3x longer to get them)")
    parser.add_argument("--lease-seconds", type=float, default=30.0, help="the gateway rolls the promotion back when "
                        "this command stops renewing it for this long")
    parser.add_argument("--out", type=Path, help="the report's folder (default: reports/promote-MODEL-TIME)")
    add_eval_options(parser)


def main(argv: list[str]) -> int:
    from deploy.box_target import resolve_box
    from deploy.spec import DeploymentError
    from loadtest.eval.run import family

    from .driver import Admin, Driver, PromoteError, PromoteOptions
    from .report import write

    parser = argparse.ArgumentParser(prog="rtxserve promote", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.rollback and not args.candidate:
        parser.error("--to CANDIDATE is required (or --rollback)")
    try:
        target = resolve_box(args.box)
        admin = Admin(target.url, args.api_key)
        if args.rollback:
            ended = admin.rollback(args.model, None, "rolled back by hand (rtxserve promote --rollback)")
            print(f"{args.model}: promotion {ended['id']} rolled back; {ended['current']} serves it")
            return 0
        current = _serving(admin.status(), args.model)
        refs = {"candidate": _reference(target, args.candidate, args.candidate_reference, True),
                "current": _reference(target, current, args.current_reference, False)}
        if refs["current"] is not None:
            differences = _differences(refs["current"], refs["candidate"], args.allow_new_tokenizer)
            if differences:
                raise ReferenceError(f"{args.candidate} is no replacement for {current}: " + "; ".join(differences))
        options = PromoteOptions(
            shadow_share=args.shadow_share, shadow_s=args.shadow_seconds,
            canary=tuple(int(w) for w in args.canary.split(",") if w.strip()), step_s=args.step_seconds,
            rollback_window_s=args.rollback_window, lease_s=args.lease_seconds, latency_margin=args.latency_margin,
            latency_floor_ms=args.latency_floor_ms, max_error_increase=args.max_error_increase,
            min_requests=args.min_requests, eval_limits=limits(args, family(refs["candidate"].task)),
            eval_settings={"tie_logprob": args.tie_logprob} if args.tie_logprob is not None else None)
    except (DeploymentError, ReferenceError, ValueError) as exc:
        print(f"rtxserve promote: error: {exc}", file=sys.stderr)
        return 2
    except PromoteError as exc:
        print(f"rtxserve promote: error: {exc}", file=sys.stderr)
        return 3 if "did not answer" in str(exc) else 2
    driver = Driver(admin, args.model, current, args.candidate, refs, options, args.api_key,
                    say=lambda m: print(m, file=sys.stderr, flush=True))
    try:
        outcome = driver.run()
    except PromoteError as exc:  # refused before it began (the load, another promotion running)
        print(f"rtxserve promote: error: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("reports") / f"promote-{args.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    page = write(outcome, out)
    print(f"{args.model}: {outcome.result}" + (f" ({outcome.reason})" if outcome.reason else "") + f"\nreport: {page}")
    return 0 if outcome.result == "promoted" else 1


def _serving(status: dict, model: str) -> str:
    """The model serving `model` now (its route's one target, or itself)."""
    targets = [t for t, w in status["routes"].get(model, {model: 100}).items() if w]
    if len(targets) != 1:
        raise ValueError(f"{model} is split between {', '.join(targets)}: promote from one model")
    return targets[0]
