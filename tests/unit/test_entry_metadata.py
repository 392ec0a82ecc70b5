"""rtxserve.json, typed (core/entry_metadata.py): what export writes is what deploy reads; entries written
before the schema load with what was assumed said; an unreadable one is one line naming the file and field."""

import json

import pytest

from core.entry_metadata import EntryMetadata, EntryMetadataError, entry_metadata_json


def test_an_embedders_old_dimensions_is_its_embedding_size_and_an_encoders_its_model_dimensions(tmp_path):
    (tmp_path / "rtxserve.json").write_text(json.dumps({"task": "feature-extraction", "dimensions": 384}))
    embedder = EntryMetadata.read(tmp_path)
    assert (embedder.embedding_size, embedder.model_dimensions) == (384, {})
    assert embedder.assumed == ["'dimensions' (written before the schema) read as the embedding size"]
    old = EntryMetadata.parse({"task": "text-classification", "dimensions": {"hidden_size": 768}})
    assert (old.model_dimensions, old.embedding_size) == ({"hidden_size": 768}, None)
    assert old.assumed == ["'dimensions' (written before the schema) read as the model's dimensions"]


def test_what_export_writes_reads_back_with_nothing_assumed_and_other_fields_kept():
    written = entry_metadata_json({"task": "feature-extraction", "embedding_size": 384, "pooling": "mean",
                                   "model_dimensions": {"hidden_size": 384}, "versions": {"torch": "2.13.0"}})
    back = EntryMetadata.parse(json.loads(written))
    assert back.assumed == [] and back.embedding_size == 384 and back.model_dimensions == {"hidden_size": 384}
    assert back.model_extra == {"pooling": "mean", "versions": {"torch": "2.13.0"}}
    assert "assumed" not in json.loads(written)


@pytest.mark.parametrize("data, field", [
    ({"task": "text-classification", "max_length": "long"}, "max_length"),
    ({"task": "text-classification", "model_dimensions": {"hidden_size": "big"}}, "model_dimensions.hidden_size"),
    ({"task": "feature-extraction", "dimensions": "384"}, "(the whole file)"),
    ({"target": "cpu"}, "task"),
    ({"task": "text-classification", "target": "tpu"}, "target"),
])
def test_a_field_it_cannot_read_is_one_line_naming_the_file_and_the_field(tmp_path, data, field):
    (tmp_path / "rtxserve.json").write_text(json.dumps(data))
    with pytest.raises(EntryMetadataError) as err:
        EntryMetadata.read(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'rtxserve.json'}: {field}: ") and "\n" not in str(err.value)


def test_a_file_that_is_not_a_json_object_says_so(tmp_path):
    (tmp_path / "rtxserve.json").write_text("[1, 2]")
    with pytest.raises(EntryMetadataError, match="not a JSON object"):
        EntryMetadata.read(tmp_path)
    (tmp_path / "rtxserve.json").write_text("{")
    with pytest.raises(EntryMetadataError, match="not JSON"):
        EntryMetadata.read(tmp_path)
