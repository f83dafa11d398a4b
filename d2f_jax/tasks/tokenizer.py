"""The arithmetic task's tokenizer: whole words, numbers as digits, saved as a real HF fast tokenizer.

Numbers are split into a leading digit and `##d` continuation pieces (WordPiece), so 10 digit tokens
cover every number and decoding glues them back ("1 ##2" -> "12"). Being a `PreTrainedTokenizerFast`,
it is saved beside checkpoints and read back by `d2f_jax.load_model` like any HF tokenizer.
"""

from __future__ import annotations

import tokenizers
import transformers

from d2f_jax.tasks import arithmetic

# Special tokens first, at fixed ids the model config refers to.
MASK, EOS, BOS, EOT, UNK = "<|mask|>", "<|eos|>", "<|bos|>", "<|eot|>", "[UNK]"
SPECIALS = (UNK, MASK, EOS, BOS, EOT)
PUNCTUATION = (".", "?", "+", "-", "*", "/", "=", ",")
EXTRA_WORDS = ("Question", "Answer", "Then", "How", "many", "does", "have", "now", "has", "gets", "more", "gives",
               "away", "buys", "boxes", "with", "each", "the", "number", "doubles", "half", "of", "So", "answer", "is")


def vocabulary() -> dict[str, int]:
  words = [*SPECIALS, *PUNCTUATION, *(str(d) for d in range(10)), *(f"##{d}" for d in range(10))]
  words += [w for w in (*arithmetic.NAMES, *arithmetic.ITEMS, *EXTRA_WORDS) if w not in words]
  return {w: i for i, w in enumerate(words)}


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
  core = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocabulary(), unk_token=UNK, max_input_chars_per_word=32))
  core.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
  core.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=True)
  return transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token=UNK, mask_token=MASK,
                                              eos_token=EOS, pad_token=EOS, bos_token=BOS,
                                              additional_special_tokens=[EOT])


def special_ids() -> dict[str, int]:
  """Token ids for ModelConfig: mask, eos (= pad), bos, end of turn."""
  vocab = vocabulary()
  return {"mask_token_id": vocab[MASK], "eos_token_id": vocab[EOS], "pad_token_id": vocab[EOS],
          "bos_token_id": vocab[BOS], "eot_token_id": vocab[EOT]}
