"""The speech fixture: a tiny Whisper that learnt to transcribe a few sentences spoken by espeak-ng (Debian's
package), trained until it transcribes each of them, in every form the tests send it, with a margin (training.py)."""

from __future__ import annotations

import json
from pathlib import Path

from .training import FixtureError, Property, save, train_until

SPEECH_SENTENCES = [
    " The red box is on the left.",
    " Ship the order on Tuesday.",
    " Hello, how can I help you today?",
    " The invoice is attached.",
    " Turn the lights off.",
    " Seven blue boxes arrived.",
]
SPEECH_RATE = 16_000  # Whisper's feature extractor's sampling rate
WINDOW_S = 10  # the fixture's audio window (Whisper's own is 30 s): 50 encoder positions a second


def speak(text: str, *, voice: str = "en", speed: int = 160, rate: int = SPEECH_RATE):
    """`text` spoken by espeak-ng, as float32 mono samples at `rate` Hz."""
    import io
    import shutil
    import subprocess
    from math import gcd

    import soundfile
    from scipy.signal import resample_poly

    if shutil.which("espeak-ng") is None:
        raise FixtureError("the speech fixtures need espeak-ng: `make setup-speech` (apt-get install espeak-ng)")
    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "--stdout", text], check=True,
                         capture_output=True).stdout
    samples, native = soundfile.read(io.BytesIO(wav), dtype="float32")
    divisor = gcd(rate, native)
    return resample_poly(samples, rate // divisor, native // divisor).astype("float32")


def _whisper_tokenizer():
    """A byte-level BPE trained on the sentences, with Whisper's special tokens after it in Whisper's order
    (<|endoftext|>, <|startoftranscript|>, the languages, the tasks, <|notimestamps|>, then the timestamps)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizerFast
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(SPEECH_SENTENCES * 20 + [s.lower() for s in SPEECH_SENTENCES] * 5, trainer)
    vocab = bpe.get_vocab()
    merges = [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    tokenizer = WhisperTokenizerFast(vocab=vocab, merges=merges, model_max_length=448)
    specials = (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{code}|>" for code in LANGUAGES]
                + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                   "<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    tokenizer.add_tokens(specials, special_tokens=True)
    return tokenizer


# What the Whisper's build checks, and tests read: each sentence's clip (the first voice), and the same clip as a lossy
# OGG, resampled to 44.1 kHz and back, and after 0.1 s of silence with an inaudible hiss to the end of its window (how
# vLLM cuts long audio), is transcribed as the sentence, each token ahead of the runner-up by TOKEN_MARGIN (log-prob).
# Asked for timestamps (the prompt's <|notimestamps|> as <|0.00|>, as vLLM's verbose_json asks), each clip is the
# sentence, then the timestamp of its end as the first voice says it (one segment: what subtitles are written from).
TOKEN_MARGIN = 1.0


def _probe_clips(clip):
    """The forms of one clip the tests send: (name, samples at SPEECH_RATE)."""
    import io

    import soundfile
    from scipy.signal import resample_poly

    buffer = io.BytesIO()
    soundfile.write(buffer, clip, SPEECH_RATE, format="OGG")
    ogg, _ = soundfile.read(io.BytesIO(buffer.getvalue()), dtype="float32")
    resampled = resample_poly(resample_poly(clip, 441, 160), 160, 441).astype("float32")
    return [("wav", clip), ("ogg", ogg), ("44.1 kHz and back", resampled), ("after 0.1 s", _after_silence(clip, 0))]


def _after_silence(clip, seed: int):
    """`clip` after 0.1 s of silence, then an inaudible hiss to the end of the window: a window as vLLM cuts long
    audio at its quietest 0.1 s."""
    import numpy as np

    window = np.random.RandomState(seed).normal(0, 1e-4, SPEECH_RATE * WINDOW_S).astype("float32")
    window[:SPEECH_RATE // 10] = 0
    window[SPEECH_RATE // 10:SPEECH_RATE // 10 + len(clip)] = clip
    return window


def _transcribes(extractor, tokenizer, clips, labels, timed) -> Property:
    """Teacher-forced on each probe's sentence: every token after the forced prompt (language, task, no timestamps
    or <|0.00|>) is the model's first choice by TOKEN_MARGIN, so greedy decoding writes the sentence (and, asked for
    timestamps, its end's) whatever the engine."""
    import numpy as np
    import torch

    probes = [(f"{SPEECH_SENTENCES[i].strip()!r} ({form})", samples, labels[i])
              for i, clip in enumerate(clips) for form, samples in _probe_clips(clip)]
    probes += [(f"{SPEECH_SENTENCES[i].strip()!r} (wav, asked for timestamps)", clip, timed[i])
               for i, clip in enumerate(clips)]
    features = torch.tensor(np.stack(extractor([p[1] for p in probes], sampling_rate=SPEECH_RATE)["input_features"]))

    def shortfalls(model) -> list[str]:
        missing = []
        for (name, _, label), row in zip(probes, features):
            logp = model(input_features=row[None], labels=torch.tensor([label])).logits[0].log_softmax(-1)
            for pos in range(3, len(label)):  # after <|en|><|transcribe|> and <|notimestamps|> or <|0.00|>
                top2 = logp[pos].topk(2)
                want = logp[pos, label[pos]]
                lead = float(want - (top2.values[1] if int(top2.indices[0]) == label[pos] else top2.values[0]))
                if lead < TOKEN_MARGIN:
                    missing.append(f"{name}: token {pos - 3} {tokenizer.decode([label[pos]])!r} leads by {lead:.2f} "
                                   f"(needs {TOKEN_MARGIN})")
                    break
        return missing

    return Property(f"transcribes each sentence's clip in every form the tests send, and with its end's timestamp "
                    f"where asked, with a token lead of {TOKEN_MARGIN}", shortfalls)


def write_whisper(out: str | Path, *, seed: int = 0, train_steps: int = 150, rounds: int = 6) -> Path:
    """A Whisper (WhisperForConditionalGeneration: 2 encoder and 2 decoder layers, d_model 128, 80 mel bins) trained
    to transcribe SPEECH_SENTENCES spoken by espeak-ng, in rounds of `train_steps` until it transcribes each sentence's
    clip in every form the tests send with a margin (and, asked for timestamps, with the timestamp of the sentence's
    end after it), with its processor and generation config as a Whisper fine-tune saves them; the first voice's clips
    in `out`/audio/*.wav. Returns `out`."""
    import numpy as np
    import soundfile
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers import WhisperProcessor
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = _whisper_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>")}
    # 10 s windows, not Whisper's 30: a third of the encoder's positions and a ninth of its attention, so that the
    # fixture trains in seconds; vLLM cuts audio into the processor's chunk_length whatever it is.
    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=SPEECH_RATE, chunk_length=WINDOW_S)
    processor = WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=80, d_model=128, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=256, decoder_ffn_dim=256,
        max_source_positions=WINDOW_S * 50, max_target_positions=448, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=sot, suppress_tokens=None, begin_suppress_tokens=None,
        architectures=["WhisperForConditionalGeneration"])
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot, max_length=448,
        suppress_tokens=[], begin_suppress_tokens=[eot], no_timestamps_token_id=ids["<|notimestamps|>"],
        is_multilingual=True, lang_to_id={f"<|{c}|>": tokenizer.convert_tokens_to_ids(f"<|{c}|>") for c in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]})

    (out / "audio").mkdir(parents=True, exist_ok=True)
    voices = [("en", 160), ("en", 140), ("en-us", 175)]
    clips, labels, timed = [], [], []
    for i, sentence in enumerate(SPEECH_SENTENCES):
        spoken = [speak(sentence.strip(), voice=voice, speed=speed) for voice, speed in voices]
        text = tokenizer.encode(sentence, add_special_tokens=False)
        end = tokenizer.convert_tokens_to_ids(f"<|{min(round(len(spoken[0]) / SPEECH_RATE / 0.02), 1500) * 0.02:.2f}|>")
        labels.append([ids["<|en|>"], ids["<|transcribe|>"], ids["<|notimestamps|>"]] + text + [eot])
        timed.append([ids["<|en|>"], ids["<|transcribe|>"], tokenizer.convert_tokens_to_ids("<|0.00|>")] + text
                     + [end, eot])
        soundfile.write(out / "audio" / f"{i:02d}.wav", spoken[0], SPEECH_RATE)
        # each voice also as a window of long audio starts (see _after_silence): what vLLM sends of long audio
        clips += spoken + [_after_silence(clip, seed=1 + k) for k, clip in enumerate(spoken)]
    # the probes as the tests read them: the saved (16-bit) files
    saved = [soundfile.read(out / "audio" / f"{i:02d}.wav", dtype="float32")[0] for i in range(len(SPEECH_SENTENCES))]
    features = torch.tensor(np.stack(extractor(clips, sampling_rate=SPEECH_RATE)["input_features"]))
    per_clip = [label for label in labels for _ in range(2 * len(voices))]
    per_clip += [label for label in timed for _ in range(2 * len(voices))]  # the same clips, asked for timestamps
    width = max(map(len, per_clip))
    targets = torch.full((len(per_clip), width), -100)
    for row, label in enumerate(per_clip):
        targets[row, :len(label)] = torch.tensor(label)

    def batch_loss():
        pick = torch.randint(0, len(per_clip), (8,))
        return model(input_features=features[pick % len(features)], labels=targets[pick]).loss

    train_until(model, batch_loss, _transcribes(extractor, tokenizer, saved, labels, timed), name="Whisper",
                steps=train_steps, lr=1e-3, rounds=rounds)
    return save(out, model, processor, "# tiny-whisper (rtxserve fixture)\n\nTranscribes a few sentences spoken by "
                "espeak-ng (audio/). For tests only.\n")
