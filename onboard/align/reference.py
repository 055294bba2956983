"""Both sides of layer and model alignment: the model's own transformers implementation and our runtime,
loaded from the same release files, plus hooks that record what each transformers layer saw."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from onboard.align.stored import quantized, reference_state_dict, without_quantizer
from onboard.errors import BadInput
from onboard.release.manifest import read_manifest
from onboard.release.transformers_classes import model_class
from runtime.model.own_modules import text_decoder, truncated_config
from runtime.spec import ModelSpec


def random_tokens(spec: ModelSpec, batch: int, T: int, seed: int) -> torch.Tensor:
    """Token ids both sides see: uniform over the vocabulary, from their own generator."""
    return torch.randint(0, spec.vocab_size, (batch, T), generator=torch.Generator().manual_seed(seed))


def load_reference(source: Path, family: str, dtype: torch.dtype, num_layers: int | None = None) -> nn.Module:
    """transformers' class for the family, from the release folder, eval mode; the first num_layers
    decoder layers only when given (large releases are aligned on a prefix)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # the release's own code (auto_map) never runs in this process: transformers' class of the family only
    config = truncated_config(AutoConfig.from_pretrained(source, trust_remote_code=False), num_layers)
    manifest = read_manifest(source) if quantized(config) else None
    if manifest is not None and manifest.stored:
        # built without the quantizer, loaded with the weights decoded by our fp64 decoders (onboard/align/stored.py)
        without_quantizer(config)
        state = reference_state_dict(manifest, dtype, num_layers)
        model = model_class(family).from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                                    trust_remote_code=False)
    else:
        model = model_class(family).from_pretrained(source, config=config, dtype=dtype, trust_remote_code=False)
    model.eval()
    _refresh_derived_buffers(model)
    return model


def _refresh_derived_buffers(model: nn.Module) -> None:
    """MiniMax stores decay tables derived from slope_rate; the release rounds them to bf16, which makes
    them disagree with their own slope at 1e-3. Rebuild them with the module's own function, in fp32."""
    for module in model.modules():
        if hasattr(module, "decay_factors") and hasattr(module, "slope_rate"):
            tables = module.decay_factors(module.slope_rate.float())
            for name, value in zip(("query_decay", "key_decay", "diagonal_decay"), tables):
                getattr(module, name).copy_(value)


def load_runtime(spec: ModelSpec | dict, weight_map: dict, source: Path, dtype: torch.dtype,
                 num_layers: int | None = None):
    """Our model with the release's weights; spec: a ModelSpec or spec.json's data (HybridDecoder reads it)."""
    from runtime.model.decoder import HybridDecoder
    from runtime.model.stored import build_stored_model, stored_targets
    from runtime.model.weights import load_release

    stored = stored_targets(weight_map)
    if stored:
        # the weights the release stores quantized stay so (codes and scales), as train holds them
        model = build_stored_model(spec, stored, torch.device("cpu"), dtype, num_layers)
    else:
        model = HybridDecoder(spec, num_layers).to(dtype)
    vision = model.config.naming.vision_prefix
    try:
        load_release(model, source, weight_map, skip_prefixes=(vision,) if vision else ())
    except KeyError as err:
        # the spec and the release's config are checked already: what is left to disagree is the map
        raise BadInput("weight_map.json", None, f"does not fit the release in {source}: {err.args[0]}")
    return model.eval()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(text_decoder(model).layers)


def attention_module(layer: nn.Module) -> nn.Module | None:
    """None for layers without one of the usual names (their own modules are aligned as whole layers)."""
    return getattr(layer, "linear_attn", None) or getattr(layer, "self_attn", None)


def ffn_module(layer: nn.Module) -> nn.Module | None:
    return getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)


def first_tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class Recorder:
    """Records (args, kwargs, output) of every decoder layer, attention and FFN module of a transformers model."""

    def __init__(self, model: nn.Module):
        self.calls: dict[tuple[str, int], tuple] = {}
        self.handles = []
        for i, layer in enumerate(decoder_layers(model)):
            for part, module in (("layer", layer), ("attention", attention_module(layer)), ("ffn", ffn_module(layer))):
                if module is None:
                    continue
                self.handles.append(module.register_forward_hook(self._hook(part, i), with_kwargs=True))

    def _hook(self, part: str, index: int):
        def record(module, args, kwargs, output):
            # a release's own layer may give something else than hidden states (a list of block sums): kept as is
            out = first_tensor(output)
            self.calls[(part, index)] = (args, kwargs, out.detach() if isinstance(out, torch.Tensor) else out)
        return record

    def input(self, part: str, index: int) -> torch.Tensor:
        args, kwargs, _ = self.calls[(part, index)]
        return (args[0] if args else kwargs["hidden_states"]).detach()

    def output(self, part: str, index: int) -> torch.Tensor:
        return self.calls[(part, index)][2]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
