"""The tiny Hugging Face models the inference tests compare against ``generate`` (built from configs, seeded;
``initializer_range`` large enough that greedy decoding is not degenerate)."""

import torch

V = 97


def gpt2():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3,
                                  eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()
