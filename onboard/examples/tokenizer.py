"""The tokenizer of the tiny example releases: a real BPE tokenizer trained with `tokenizers` on bundled
text (onboard/data/tokenizer_corpus.txt) and saved by transformers' `save_pretrained`, with a chat
template, so the data path of a tiny release is the one a real release takes.

Its vocabulary stays below 250: the multimodal example reserves ids 250..253 for image/video tokens.
"""
from __future__ import annotations

from pathlib import Path

import onboard

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 240
# onboard/data/ found by the package, not by this file's place, so the module can move
CORPUS = Path(onboard.__file__).resolve().parent / "data" / "tokenizer_corpus.txt"
# ChatML; the assistant's content and end marker are in a generation block, so transformers'
# return_assistant_tokens_mask can say which tokens the model is trained on.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{%- else -%}{{ message['content'] + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def write_example_tokenizer(out_dir: Path) -> None:
    """Train the BPE tokenizer on the bundled corpus and save it (tokenizer.json + config) into out_dir."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    # newlines split apart so that a chat turn's header never merges into its content
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.Metaspace()])
    tokenizer.decoder = decoders.Metaspace()
    # every printable ASCII character is in the vocabulary, whether the corpus has it or not
    alphabet = [chr(c) for c in range(33, 127)] + ["\n", "\u2581"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train([str(CORPUS)], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                      eos_token="</s>", unk_token="<unk>")
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(out_dir)
