"""Config keys that describe no architecture: generation settings a release's config.json may carry.

transformers 4 wrote its sampling and search defaults into every config's to_dict (nested text configs too), so a
release saved then carries `do_sample`, `top_k`, `temperature`... beside its architecture keys. They are the
parameters of transformers' GenerationConfig, which is where generation reads them from; recognition never uses
them, and reports list them apart from the architecture keys they did not understand.
"""
from __future__ import annotations

# transformers' GenerationConfig parameters that PretrainedConfig once carried (its to_dict wrote these)
GENERATION_KEYS = frozenset({
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "max_new_tokens",
    "min_new_tokens", "epsilon_cutoff", "eta_cutoff", "guidance_scale", "renormalize_logits",
    "decoder_start_token_id",
})


def generation_keys(config: dict, text_key: str | None) -> list[str]:
    """Dotted names of the generation settings config.json sets (top level and the text config), values not null."""
    found = [k for k, v in config.items() if k in GENERATION_KEYS and v is not None]
    text = config.get(text_key) if text_key else None
    if isinstance(text, dict):
        found += [f"{text_key}.{k}" for k, v in text.items() if k in GENERATION_KEYS and v is not None]
    return found
