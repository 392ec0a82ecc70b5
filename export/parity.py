"""Compare an exported model's outputs with the reference PyTorch model's on the same inputs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .exceptions import ExportError, ParityError


@dataclass
class OutputParity:
    name: str
    shape: list[int]
    max_abs_diff: float
    max_rel_diff: float
    top1_agreement: float  # fraction of rows whose argmax over the last axis agrees
    min_cosine: float = 1.0  # lowest cosine similarity between a row of PyTorch's output and the export's


def _min_cosine(ref: np.ndarray, got: np.ndarray) -> float:
    """Lowest cosine similarity over the rows (first axis) of two same-shaped arrays; 1.0 for two zero rows."""
    a, b = ref.reshape(len(ref), -1) if ref.ndim else ref.reshape(1, 1), got.reshape(len(got), -1) if got.ndim else got.reshape(1, 1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = np.einsum("ij,ij->i", a, b)
    cos = np.where(norms > 0, dots / np.where(norms > 0, norms, 1), 1.0)
    return float(cos.min())


@dataclass
class ParityReport:
    """Figures per output over every case. The gate is max abs diff <= atol, or, for lossy variants
    (INT8, FP16) where only direction matters, min cosine >= min_cosine when that is set."""

    atol: float
    cases: int = 0
    outputs: dict[str, OutputParity] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    min_cosine: float | None = None

    def _breached(self, o: OutputParity) -> bool:
        return o.min_cosine < self.min_cosine if self.min_cosine is not None else o.max_abs_diff > self.atol

    @property
    def passed(self) -> bool:
        return not any(self._breached(o) for o in self.outputs.values())

    def add(self, reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> None:
        """Fold one case (same inputs run through both models) into the report.

        A missing output or a shape mismatch is fatal: the export is wrong, not merely imprecise.
        """
        self.cases += 1
        for name, ref in reference.items():
            if name not in candidate:
                raise ExportError(f"exported model has no output {name!r} (has {sorted(candidate)})")
            got = candidate[name]
            if got.shape != ref.shape:
                raise ExportError(f"output {name!r}: exported shape {got.shape} != PyTorch shape {ref.shape}")
            ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
            abs_diff = np.abs(ref64 - got64)
            rel_diff = abs_diff / np.maximum(np.abs(ref64), 1e-6)
            agree = float(np.mean(ref64.argmax(-1) == got64.argmax(-1))) if ref.ndim >= 2 else 1.0
            cosine = _min_cosine(ref64, got64)
            prev = self.outputs.get(name)
            if prev is None:
                self.outputs[name] = OutputParity(name, list(ref.shape), float(abs_diff.max()), float(rel_diff.max()), agree, cosine)
            else:
                prev.max_abs_diff = max(prev.max_abs_diff, float(abs_diff.max()))
                prev.max_rel_diff = max(prev.max_rel_diff, float(rel_diff.max()))
                prev.top1_agreement = min(prev.top1_agreement, agree)
                prev.min_cosine = min(prev.min_cosine, cosine)

    def check(self, allow_drift: bool) -> None:
        """Raise ParityError on a tolerance breach unless drift is allowed (then it is only noted)."""
        breaches = [o for o in self.outputs.values() if self._breached(o)]
        if not breaches:
            return
        detail = "; ".join(
            f"output {o.name!r} max abs diff {o.max_abs_diff:.3g} (max rel {o.max_rel_diff:.3g}, min cosine {o.min_cosine:.6f})"
            for o in breaches
        )
        gate = f"min cosine {self.min_cosine:g}" if self.min_cosine is not None else f"atol={self.atol:g}"
        if allow_drift:
            self.notes.append(f"drift allowed by --allow-drift: {detail}")
            return
        raise ParityError(f"export drifted beyond {gate}: {detail}; rerun with --allow-drift to keep it")

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "atol": self.atol,
            "min_cosine": self.min_cosine,
            "cases": self.cases,
            "outputs": {k: asdict(v) for k, v in self.outputs.items()},
            "notes": self.notes,
        }


def first_outputs(model, ids: list[list[int]]) -> list[np.ndarray]:
    """A Hugging Face model's first output (logits, or a bare encoder's last hidden state) for each token list."""
    import torch

    outputs = []
    with torch.no_grad():
        for x in ids:
            out = model(input_ids=torch.tensor([x]))
            first = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
            outputs.append(first.float().numpy())
    return outputs


def compare_with_trainer(reference: list[np.ndarray], model_dir, ids: list[list[int]], *, auto_class: str, dtype: str,
                         atol: float, allow_drift: bool, reference_model: str, reference_command: str,
                         output: str = "logits") -> dict:
    """A converted checkpoint, reloaded from `model_dir`, against the trainer's own model's outputs on `ids`: the
    figures for parity.json (ParityError beyond `atol` unless drift is allowed)."""
    import torch
    import transformers

    model = getattr(transformers, auto_class).from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    report = ParityReport(atol=atol)
    for ref, got in zip(reference, first_outputs(model, ids)):
        report.add({output: ref}, {output: got})
    report.notes.append(f"reference: {reference_model}")
    report.check(allow_drift)
    return {**report.to_dict(), "reference": reference_model, "reference_command": reference_command}
