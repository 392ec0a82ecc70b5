"""One real stack per session: the fixture classifier exported, tritonserver + gateway processes."""

import pytest

from export.classifier import export_text_classification
from export.triton_entry import EntryOptions
from serve.stack import start_stack

MODEL = "tiny_sentiment"


@pytest.fixture(scope="session")
def stack(classifier_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("stack")
    export_text_classification(classifier_checkpoint, EntryOptions(name=MODEL, instances=2), work / "repo")
    with start_stack(work / "repo", work / "logs") as running:
        yield running
