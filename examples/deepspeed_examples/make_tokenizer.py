"""A RoBERTa-style byte-level BPE tokenizer trained on zerospeed's bundled corpus, saved where
``AutoTokenizer.from_pretrained(DIR)`` finds it (HelloDeepSpeed's ``--tokenizer DIR``; no download)."""

import sys

from tokenizers import ByteLevelBPETokenizer
from transformers import RobertaTokenizerFast

from zerospeed.data import load_corpus

out = sys.argv[1]
special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
bpe = ByteLevelBPETokenizer()
bpe.train_from_iterator(load_corpus().decode("utf-8", errors="replace").splitlines(), vocab_size=2000,
                        special_tokens=special)
tok = RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                           cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
tok.save_pretrained(out)
print(f"tokenizer with {len(tok)} tokens in {out}")
