"""A tiny random Llama with a word-level tokenizer and a chat template, built in-process (no
download), saved as a plain HF folder so the CLI and the loaders run end to end in seconds."""
from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("the a of and to in is it that for on with as was at by an be this are from or have not "
         "python class def return import module function value list dict string object type name").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def tiny_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", additional_special_tokens=specials[1:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(vocab: int = 64, *, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
               tie: bool = True, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=tie, bos_token_id=None, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def tiny_hf_folder(path: Path) -> Path:
    """Write config + safetensors + tokenizer of the tiny model into ``path``; returns it."""
    path = Path(path)
    tok = tiny_tokenizer()
    model = tiny_llama(vocab=len(tok))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_text(n_words: int = 400, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(WORDS), (n_words,), generator=g).tolist()
    return " ".join(WORDS[i] for i in idx)
