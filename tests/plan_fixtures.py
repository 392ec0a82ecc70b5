"""Planning stand-ins for real-sized models: the files `rtxserve plan` reads, at full size, with no weights.

A Llama-3-8B folder (and a Whisper large-v3 one) whose model.safetensors has the real header (every tensor's name, dtype and shape) and
a hole where the 16 GB of data would be (a sparse file: it takes no disk); LoRA adapters with their
config; BERT-base Triton entries as `rtxserve export onnx --target gpu --precision fp16` writes them,
with a sparse graph of the fp16 size. The planner reads headers, configs and file sizes only, so it
plans these exactly as it would the real ones.

    python -m tests.plan_fixtures OUT    # writes OUT/one-4090.yaml and OUT/four-4090.yaml with their artifacts
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import yaml

WIDTH = {"F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8, "I8": 1, "F8_E4M3": 1}
LLAMA_3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=131072, torch_dtype="bfloat16", tie_word_embeddings=False)
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=512)


def sparse_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with these tensors' real header and no data written (a hole of the data's size)."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = WIDTH[dtype]
        for s in shape:
            size *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


# meta-llama/Llama-2-13b-hf's config.json (no grouped-query attention: 40 KV heads), float16 as published
LLAMA_2_13B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=5120, intermediate_size=13824,
                   num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                   max_position_embeddings=4096, torch_dtype="float16", tie_word_embeddings=False)
# What llm-compressor 0.14 writes for each scheme (compressed-tensors 0.19, read off its output for the tiny Llama
# here): every Linear but lm_head quantised; the quantization_config's fields vLLM picks its kernels by.
QUANTIZED = {
    "w4a16": {"format": "pack-quantized", "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 128}, "input_activations": None},
    "w8a8-int8": {"format": "int-quantized", "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                         "strategy": "channel"},
                  "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                        "dynamic": True}},
    "w8a8-fp8": {"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                          "strategy": "channel"},
                 "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                       "dynamic": True}},
}


def _quantized_linear(name: str, out: int, fan_in: int, scheme: str, dt: str) -> dict:
    """A Linear as compressed-tensors stores it: int4 packed eight to an int32 with a scale per group of 128 inputs;
    int8 or fp8 with a scale per output channel."""
    if scheme == "w4a16":
        return {f"{name}.weight_packed": ("I32", [out, fan_in // 8]), f"{name}.weight_scale": (dt, [out, fan_in // 128]),
                f"{name}.weight_shape": ("I64", [2])}
    return {f"{name}.weight": ("I8" if scheme == "w8a8-int8" else "F8_E4M3", [out, fan_in]),
            f"{name}.weight_scale": (dt, [out, 1])}


def write_llama(folder: Path, config: dict = LLAMA_3_8B, quantization: str | None = None) -> Path:
    """A Llama folder with its real header for `config`, as published or as llm-compressor quantises it."""
    folder.mkdir(parents=True, exist_ok=True)
    h, i, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]
    head = h // config["num_attention_heads"]
    dt = {"float16": "F16", "float32": "F32"}.get(config.get("torch_dtype"), "BF16")
    written = dict(config)
    if quantization:
        group = QUANTIZED[quantization]
        written["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": group["format"], "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": group["weights"],
                                                                 "input_activations": group["input_activations"]}}}
    (folder / "config.json").write_text(json.dumps(written))

    def linear(name: str, out: int, fan_in: int) -> dict:
        if quantization:
            return _quantized_linear(name, out, fan_in, quantization, dt)
        return {f"{name}.weight": (dt, [out, fan_in])}

    tensors = {"model.embed_tokens.weight": (dt, [config["vocab_size"], h]), "lm_head.weight": (dt, [config["vocab_size"], h]),
               "model.norm.weight": (dt, [h])}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= (linear(p + "self_attn.q_proj", h, h) | linear(p + "self_attn.k_proj", kv * head, h)
                    | linear(p + "self_attn.v_proj", kv * head, h) | linear(p + "self_attn.o_proj", h, h)
                    | linear(p + "mlp.gate_proj", i, h) | linear(p + "mlp.up_proj", i, h) | linear(p + "mlp.down_proj", h, i)
                    | {p + "input_layernorm.weight": (dt, [h]), p + "post_attention_layernorm.weight": (dt, [h])})
    sparse_safetensors(folder / "model.safetensors", tensors)
    return folder


# openai/whisper-large-v3's config.json (the fields the planner and vLLM read), stored in float16 as published
WHISPER_LARGE_V3 = dict(architectures=["WhisperForConditionalGeneration"], model_type="whisper", d_model=1280,
                        encoder_layers=32, decoder_layers=32, encoder_attention_heads=20, decoder_attention_heads=20,
                        encoder_ffn_dim=5120, decoder_ffn_dim=5120, vocab_size=51866, num_mel_bins=128,
                        max_source_positions=1500, max_target_positions=448, torch_dtype="float16")
TINY_WHISPER = dict(WHISPER_LARGE_V3, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=256, decoder_ffn_dim=256, vocab_size=1960,
                    num_mel_bins=80, max_source_positions=500, torch_dtype="float32")


def write_whisper(folder: Path, config: dict = WHISPER_LARGE_V3) -> Path:
    """A Whisper folder with transformers' tensor names and shapes for `config` (no data) and its feature extractor."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": config["num_mel_bins"],
        "sampling_rate": 16000, "chunk_length": 30}))
    d, dt = config["d_model"], "F16" if config["torch_dtype"] == "float16" else "F32"

    def linear(name: str, fan_in: int, fan_out: int, bias: bool = True) -> dict:
        return {f"{name}.weight": (dt, [fan_out, fan_in])} | ({f"{name}.bias": (dt, [fan_out])} if bias else {})

    def norm(name: str) -> dict:
        return {f"{name}.weight": (dt, [d]), f"{name}.bias": (dt, [d])}

    def attention(name: str) -> dict:  # Whisper's k_proj has no bias
        return (linear(f"{name}.q_proj", d, d) | linear(f"{name}.k_proj", d, d, bias=False)
                | linear(f"{name}.v_proj", d, d) | linear(f"{name}.out_proj", d, d))

    tensors = {"model.encoder.conv1.weight": (dt, [d, config["num_mel_bins"], 3]), "model.encoder.conv1.bias": (dt, [d]),
               "model.encoder.conv2.weight": (dt, [d, d, 3]), "model.encoder.conv2.bias": (dt, [d]),
               "model.encoder.embed_positions.weight": (dt, [config["max_source_positions"], d]),
               "model.decoder.embed_tokens.weight": (dt, [config["vocab_size"], d]),
               "model.decoder.embed_positions.weight": (dt, [config["max_target_positions"], d])}
    for side, layers, ffn in (("encoder", config["encoder_layers"], config["encoder_ffn_dim"]),
                              ("decoder", config["decoder_layers"], config["decoder_ffn_dim"])):
        for n in range(layers):
            p = f"model.{side}.layers.{n}."
            tensors |= (attention(p + "self_attn") | norm(p + "self_attn_layer_norm") | linear(p + "fc1", d, ffn)
                        | linear(p + "fc2", ffn, d) | norm(p + "final_layer_norm"))
            if side == "decoder":
                tensors |= attention(p + "encoder_attn") | norm(p + "encoder_attn_layer_norm")
        tensors |= norm(f"model.{side}.layer_norm")
    sparse_safetensors(folder / "model.safetensors", tensors)  # proj_out is tied to embed_tokens: not stored
    return folder


def write_adapter(folder: Path, rank: int = 16, config: dict = LLAMA_3_8B) -> Path:
    """A PEFT LoRA adapter for `config` on every linear layer, its real header and no weights."""
    folder.mkdir(parents=True, exist_ok=True)
    modules = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv", "self_attn.o_proj": "o",
               "mlp.gate_proj": "up", "mlp.up_proj": "up", "mlp.down_proj": "down"}
    h, i = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    fans = {"q": (h, h), "kv": (h, kv), "o": (h, h), "up": (h, i), "down": (i, h)}  # (in, out)
    tensors = {}
    for n in range(config["num_hidden_layers"]):
        for module, kind in modules.items():
            fan_in, fan_out = fans[kind]
            key = f"base_model.model.model.layers.{n}.{module}"
            tensors |= {f"{key}.lora_A.weight": ("BF16", [rank, fan_in]), f"{key}.lora_B.weight": ("BF16", [fan_out, rank])}
    sparse_safetensors(folder / "adapter_model.safetensors", tensors)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "task_type": "CAUSAL_LM",
        "target_modules": sorted({m.split(".")[1] for m in modules})}))
    return folder


def write_entry(repository: Path, name: str, *, target: str = "gpu", precision: str = "fp16", dims: dict = BERT_BASE,
                params: int = 109_482_240, max_batch_size: int = 32, max_length: int = 128,
                task: str = "text-classification", meta: dict | None = None) -> Path:
    """An encoder entry (text-classification unless `task` says otherwise) laid out as export writes it, with a
    sparse graph of the right size; `meta` adds to (or replaces fields of) its rtxserve.json."""
    steps = [f"{name}_tokenizer", f"{name}_model", f"{name}_postprocess"]
    entry = repository / name
    (entry / "1").mkdir(parents=True, exist_ok=True)
    (entry / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {max_batch_size}\nensemble_scheduling {{\n'
        + "".join(f'  step {{ model_name: "{s}" model_version: -1 }}\n' for s in steps) + "}\n")
    (entry / "rtxserve.json").write_text(json.dumps({
        "task": task, "architecture": "BertForSequenceClassification", "target": target,
        "max_batch_size": max_batch_size, "max_length": max_length, "precision": precision, "model_dimensions": dims}
        | (meta or {})))
    kinds = {steps[0]: 'backend: "python"', steps[1]: 'platform: "onnxruntime_onnx"', steps[2]: 'backend: "python"'}
    for step in steps:  # as export writes them: the tokenizer and the model dynamically batched, one instance each
        (repository / step / "1").mkdir(parents=True, exist_ok=True)
        batched = step != steps[2]
        (repository / step / "config.pbtxt").write_text(
            f'name: "{step}"\n{kinds[step]}\nmax_batch_size: {max_batch_size}\n'
            f'instance_group {{ count: 1 kind: {"KIND_GPU" if step == steps[1] and target == "gpu" else "KIND_CPU"} }}\n'
            + ("dynamic_batching { max_queue_delay_microseconds: 500 }\n" if batched else ""))
    with open(repository / f"{name}_model" / "1" / "model.onnx", "wb") as f:
        f.truncate(params * (2 if precision == "fp16" else 4))
    return entry


# Stable Diffusion 1.5's components: parameters (one tensor each: the planner sums headers) and the configs it reads
SD_15 = {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480}
TINY_LLAMA = dict(LLAMA_3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048)


def write_diffusion_entry(repository: Path, name: str, *, target: str = "gpu", size: int = 512) -> Path:
    """A diffusion entry as `rtxserve export diffusion` writes it, with SD-1.5-sized sparse weights."""
    entry = repository / name
    pipeline = entry / "1" / "pipeline"
    (entry / "config.pbtxt").parent.mkdir(parents=True, exist_ok=True)
    (entry / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n')
    (entry / "rtxserve.json").write_text(json.dumps({"task": "text-to-image", "target": target, "native_size": 512,
                                                     "default_size": size, "vae_scale": 8}))
    configs = {"unet": {"block_out_channels": [320, 640, 1280, 1280], "sample_size": 64, "cross_attention_dim": 768},
               "vae": {"block_out_channels": [128, 256, 512, 512]}, "text_encoder": {"hidden_size": 768}}
    for component, params in SD_15.items():
        folder = pipeline / component
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(configs[component]))
        weights = "model.safetensors" if component == "text_encoder" else "diffusion_pytorch_model.safetensors"
        sparse_safetensors(folder / weights, {"weight": ("F16", [params])})
    return entry


def write_artifacts(deployment: Path) -> Path:
    """Everything a deployment file names, at the paths it names (relative to the file): planning stand-ins of
    the kind each model is (an 8B Llama on a GPU box, a small one on CPU), and a keys file. For the examples in
    deploy/examples/, which name their artifacts as a user's box holds them."""
    from serve.gateway.access.keys import ApiKey, hash_key, write_keys

    spec = yaml.safe_load(deployment.read_text())
    base = deployment.parent
    gpu = (spec.get("gpus") or {}).get("count", 0) > 0
    llama = LLAMA_3_8B if gpu else TINY_LLAMA
    for m in spec["models"]:
        path = base / m["path"]
        if m["kind"] == "encoder":
            write_entry(path.parent, path.name, target="gpu" if gpu else "cpu", precision="fp16" if gpu else "fp32")
        elif m["kind"] == "llm":
            write_llama(path, llama)
            for adapter in (m.get("adapters") or {}).values():
                write_adapter(base / adapter, config=llama)
        elif m["kind"] == "diffusion":
            write_diffusion_entry(path.parent, path.name, target="gpu" if gpu else "cpu")
        elif m["kind"] == "speech":
            write_whisper(path, WHISPER_LARGE_V3 if gpu else TINY_WHISPER)
        else:
            raise ValueError(f"no planning stand-in for kind {m['kind']!r}: add one here")
    if (spec.get("gateway") or {}).get("keys_file"):
        write_keys(base / spec["gateway"]["keys_file"], {"ops": ApiKey(name="ops", hash=hash_key("secret"))})
    return deployment


def write_boxes(out: Path) -> tuple[Path, Path]:
    """The two boxes of the deploy issue: one 4090 with an 8B LLM (FP16, two adapters) and four BERT-base
    instances; four 4090s with one engine of that LLM on each."""
    llm = write_llama(out / "llama-3-8b")
    adapters = {"support": write_adapter(out / "adapter-support"), "sales": write_adapter(out / "adapter-sales")}
    write_entry(out / "model_repository", "bert_classifier")
    llm_model = {"name": "llama-3-8b", "kind": "llm", "path": str(llm), "max_model_len": 4096, "max_num_seqs": 8,
                 "max_num_batched_tokens": 2048, "dtype": "float16"}
    bert = {"name": "bert_classifier", "kind": "encoder", "path": str(out / "model_repository" / "bert_classifier"),
            "instances": 4}
    one = {"name": "one-4090", "gpus": {"count": 1},
           "models": [bert, {**llm_model, "adapters": {k: str(v) for k, v in adapters.items()}}]}
    four = {"name": "four-4090", "gpus": {"count": 4},
            "models": [{**bert, "instances": "auto"}, {**llm_model, "replicas": 4}]}
    paths = (out / "one-4090.yaml", out / "four-4090.yaml")
    for path, data in zip(paths, (one, four)):
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return paths


if __name__ == "__main__":
    for p in write_boxes(Path(sys.argv[1])):
        print(p)
