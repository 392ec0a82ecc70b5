"""The Stable-Diffusion-shaped fixture pipeline and a UNet LoRA for it (random weights: tests compare the served image
with the in-process pipeline's, pixel for pixel)."""

from __future__ import annotations

from pathlib import Path

def _clip_tokenizer(max_length: int = 77):
    """A CLIPTokenizer from a locally made vocabulary: every byte-level character (alone and word-final) and a
    few merges of common letters, so that prompts tokenize into more than characters."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())
    merges = [("t", "h"), ("h", "e</w>"), ("a", "n"), ("o", "n"), ("e", "r</w>"), ("i", "n"), ("r", "e"), ("s", "t")]
    vocab = ["<|startoftext|>", "<|endoftext|>", *chars, *(c + "</w>" for c in chars), *(a + b for a, b in merges)]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(dict.fromkeys(vocab))}, merges=merges,
                         model_max_length=max_length)


def write_diffusion_pipeline(out: str | Path, *, seed: int = 0, channels: tuple[int, int] = (32, 64)) -> Path:
    """A Stable-Diffusion-shaped pipeline with tiny random components (the shapes of diffusers' own tests: UNet
    (32, 64) with cross-attention 32, VAE (32, 64), a 2-layer CLIP text encoder, DDIM), saved with
    `save_pretrained` as a fine-tune is; 64x64 images in a few steps take about a second on CPU."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    out = Path(out)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(block_out_channels=channels, layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                                norm_num_groups=32)
    vae = AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
                        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], norm_num_groups=32, sample_size=64)
    tokenizer = _clip_tokenizer()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=77, projection_dim=32))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(out, safe_serialization=True)
    (out / "README.md").write_text("# tiny-sd (rtxserve fixture)\n\nRandom weights, 64x64. For tests only.\n")
    return out


def write_diffusion_lora(pipeline: str | Path, out: str | Path, *, seed: int = 1, rank: int = 4) -> Path:
    """A UNet LoRA for the pipeline at `pipeline`, made with peft and saved with `save_lora_weights` as
    diffusers' training scripts do; its weights are random (not zero) so that it changes the image."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    unet = UNet2DConditionModel.from_pretrained(pipeline, subfolder="unet")
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    StableDiffusionPipeline.save_lora_weights(out, unet_lora_layers=get_peft_model_state_dict(unet), safe_serialization=True)
    return Path(out)
