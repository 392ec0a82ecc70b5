"""Train a tiny Llama-shaped GPT with Megatron-core for a few steps and save it with Megatron's own
distributed checkpointing, in Megatron-LM's layout (`iter_0000003/` of `torch_dist` shards, the run's
arguments in the common state, `latest_checkpointed_iteration.txt`).

Run under torchrun with the gloo backend on CPU:
    torchrun --nproc-per-node 2 megatron_gpt.py OUT TOKENIZER_DIR --tp 2
Megatron-core expects CUDA in two places that have no CPU path; the shims below stand in for them
(see DESIGN.md, "Trainers on CPU").
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: torch.device("cpu")

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

SENTENCES = [f"where is order {i}? order {i} ships on tuesday" for i in range(32)]


def causal_mask(length: int) -> torch.Tensor:
    """True where attention is masked. (Without an explicit mask, Megatron builds its default one on CUDA.)"""
    return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tokenizer")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tied", action="store_true", help="share the embedding and output weights (Megatron's default)")
    cli = parser.parse_args()

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cli.tp, pipeline_model_parallel_size=cli.pp)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cli.tokenizer)
    # Megatron-LM's own argument names: this Namespace is what its training loop saves as "args".
    args = argparse.Namespace(
        num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=2, num_query_groups=2,
        group_query_attention=False, kv_channels=64, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=not cli.tied, max_position_embeddings=512,
        seq_length=64, padded_vocab_size=len(tokenizer) + (-len(tokenizer)) % (128 * cli.tp),
        make_vocab_size_divisible_by=128, tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(Path(cli.tokenizer).resolve()), tensor_model_parallel_size=cli.tp,
        pipeline_model_parallel_size=cli.pp, world_size=dist.get_world_size(), params_dtype=torch.float32,
        bf16=False, fp16=False, iteration=cli.steps, train_iters=cli.steps, lr=1e-3,
        ckpt_format="torch_dist", transformer_impl="local",
    )
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, normalization="RMSNorm", layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        tensor_model_parallel_size=cli.tp, pipeline_model_parallel_size=cli.pp, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=cli.tied, position_embedding_type="rope", rotary_base=args.rotary_base,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ids = [tokenizer(s)["input_ids"][: args.seq_length] for s in SENTENCES]
    width = max(map(len, ids))
    batch = torch.tensor([x + [tokenizer.eos_token_id] * (width - len(x)) for x in ids])
    positions = torch.arange(width).unsqueeze(0).expand_as(batch)
    for step in range(cli.steps):
        rows = batch[step * 4:(step + 1) * 4]
        losses = model(rows[:, :-1], positions[: len(rows), :-1], attention_mask=causal_mask(width - 1),
                       labels=rows[:, 1:])
        loss = losses.float().mean()
        optimizer.zero_grad()
        loss.backward()
        # Tensor-parallel replicas of a layer norm see the same gradient; data parallel is 1 here.
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)

    out = Path(cli.out)
    iteration = out / f"iter_{cli.steps:07d}"
    state = {"model": model.sharded_state_dict(), "args": args, "iteration": cli.steps, "checkpoint_version": 3.0}
    if dist.get_rank() == 0:
        iteration.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, str(iteration))
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text(str(cli.steps))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
