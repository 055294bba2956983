"""Components no registry op computes, run through the model's own transformers modules (day-0, slow).

A spec part of kind "own_module" (attention, FFN, or the whole decoder layer) becomes an OwnModule
here: an empty slot until `load_own_modules` builds transformers' model of the release (truncated
to the runtime's layers), lets transformers load the release's weights into it by name, and moves
the needed submodules into the slots; of the rest only its text decoder is kept (its embedding too),
whose own forward is run to record what it passes its layers. The moved modules are ordinary
submodules: their nn.Linear layers take LoRA and they train with the rest. A model whose glue
(embedding, head, anything between the layers) is not understood is an OwnModel: transformers' whole
model, its text path run end to end. Packed segments run one at a time (transformers' modules take
no cu_seqlens). Slow because nothing is fused and the truncated release passes through memory once
when loading. Shape legend: B batch, T tokens, D model width.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from runtime.model.segments import per_segment

# Per-layer context transformers' decoders pass their layers; given where a module's forward accepts it.
CONTEXT_ARGS = ("attention_mask", "position_ids", "position_embeddings")


def transformers_class_names() -> dict[str, str]:
    """family -> the transformers class a release of it loads with (image-text-to-text over causal LM)."""
    from transformers.models.auto import modeling_auto as auto

    return {**auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, **auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}


def transformers_class(family: str):
    """The class, or None when transformers does not know the family."""
    name = transformers_class_names().get(family)
    return getattr(__import__("transformers"), name) if name else None


def truncated_config(config, num_layers: int | None):
    """The config with its text model cut to num_layers, per-layer lists cut alike."""
    text = config.get_text_config()
    count_key = _layer_count_key(text)
    total = getattr(text, count_key)
    if num_layers is None or num_layers >= total:
        return config
    for key, value in list(vars(text).items()):
        if isinstance(value, list) and len(value) == total:
            setattr(text, key, value[:num_layers])
    setattr(text, count_key, num_layers)
    return config


def _layer_count_key(text) -> str:
    """The key counting the decoder's layers: num_hidden_layers, unless the config derives that (a property,
    e.g. two attention sublayers per decoder layer) from a stored count of decoder layers."""
    if isinstance(getattr(type(text), "num_hidden_layers", None), property):
        return next((k for k in ("num_layers", "n_layers", "n_layer") if type(vars(text).get(k)) is int),
                    "num_hidden_layers")
    return "num_hidden_layers"


class _Context:
    """What the release's decoder passes each layer (rotary tables, masks, any per-layer-type extra), found by
    running the decoder's own forward with every layer's forward swapped for one that records its arguments
    and passes the hidden states through: the decoder decides them, not a rule of ours. Recorded once per
    input shape and positions. A plain object (not a Module), so the decoder is not registered once per slot."""

    def __init__(self, decoder: nn.Module):
        self.decoder = decoder
        self._key, self._calls = None, []

    def kwargs(self, index: int, x_BTD: torch.Tensor, positions: torch.Tensor) -> dict:
        key = (x_BTD.shape, x_BTD.dtype, x_BTD.device, tuple(positions.flatten().tolist()))
        if key != self._key:
            self._calls, self._key = self._record(x_BTD, positions), key
        return self._calls[index]

    def _record(self, x_BTD: torch.Tensor, positions: torch.Tensor) -> list[dict]:
        calls: list[dict] = []
        layers = list(self.decoder.layers)
        for layer in layers:  # an instance attribute shadows the class's forward
            layer.forward = _recorder(layer.forward, calls, len(layers))
        try:
            # no gradient: what a decoder passes its layers is made of positions and buffers, not weights
            with torch.no_grad():
                self.decoder(inputs_embeds=x_BTD.detach(), position_ids=positions, use_cache=False)
        except _AllRecorded:
            pass
        finally:
            for layer in layers:
                del layer.forward
        return calls


class _AllRecorded(Exception):
    """Raised by the last layer's recorder: what follows the layers (the final norm, maybe left on another
    device than the moved layers) is not needed."""


def _recorder(forward, calls: list[dict], total: int):
    """A layer forward that appends its arguments but the hidden states, by name, and returns them unchanged."""
    signature = inspect.signature(forward)
    first = next(iter(signature.parameters))
    extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def record(*args, **kwargs):
        named = dict(signature.bind(*args, **kwargs).arguments)
        hidden, passed = named.pop(first), named.pop(extra, {}) if extra else {}
        calls.append({**named, **passed})
        if len(calls) == total:
            raise _AllRecorded
        return hidden

    return record


def _first_tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class OwnModule(nn.Module):
    """A slot for transformers' module of one layer part ("attn", "ffn" or "layer"), filled by load_own_modules.

    `path` is the module's attribute path inside transformers' decoder layer ("" for the layer itself)."""

    def __init__(self, index: int, part: str, path: str):
        super().__init__()
        self.index, self.part, self.path = index, part, path
        self.module: nn.Module | None = None
        self._context: list[_Context] = []  # a list, so the context is not registered as a submodule
        self._accepts: set[str] = set()

    def bind(self, module: nn.Module, context: _Context) -> None:
        self.module, self._context = module, [context]
        params = inspect.signature(module.forward).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        self._accepts = None if self.part == "layer" else named | set(CONTEXT_ARGS if takes_any else ())

    def forward(self, x_BTD: torch.Tensor, rotary=None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """cu_seqlens (batch 1): packed segments; transformers' modules take no such argument, so a module
        that mixes tokens runs once per segment, on that segment's positions."""
        if self.module is None:
            raise RuntimeError(f"layer {self.index} {self.part}: own module {self.path or 'decoder layer'} was not loaded")
        if self.part == "ffn":
            return _first_tensor(self.module(x_BTD))
        positions = rotary.positions if rotary is not None else torch.arange(x_BTD.shape[1])[None]
        return per_segment(self._mixing, cu_seqlens, x_BTD, positions)

    def _mixing(self, x_BTD: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        context = self._context[0].kwargs(self.index, x_BTD, positions)
        if self._accepts is not None:  # a part of the layer takes what the layer is given, where it names it
            context = {k: v for k, v in context.items() if k in self._accepts}
        return _first_tensor(self.module(x_BTD, **context))


def own_slots(model: nn.Module) -> list[OwnModule]:
    return [m for m in model.modules() if isinstance(m, OwnModule)]


def runs_own_code(model: nn.Module) -> bool:
    """Whether any part of the runtime model is transformers' module (a slot, or the whole model)."""
    return any(isinstance(m, (OwnModule, OwnModel)) for m in model.modules())


def text_decoder(model: nn.Module) -> nn.Module:
    """transformers' text decoder inside a model: the module holding both its layers and its token embedding."""
    return next(m for m in model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleList)
                and any(isinstance(c, nn.Embedding) for c in m.children()))


class _HeadReached(Exception):
    """Raised at the head's input to stop transformers' forward there (OwnModel._head_input)."""

    def __init__(self, h_BTD: torch.Tensor):
        super().__init__("head reached")
        self.h_BTD = h_BTD


class OwnModel(nn.Module):
    """A slot for transformers' whole model of the release, filled by load_own_modules: its text model runs
    end to end (embedding, layers and whatever glue sits between them, final norm), its LM head gives the
    head weight. `num_layers` truncates it like the runtime model (None: all layers)."""

    def __init__(self, num_layers: int | None):
        super().__init__()
        self.num_layers = num_layers
        self.module: nn.Module | None = None
        # empty, so `.to()` on the runtime model leaves here the dtype and device to load transformers' model in
        self.register_buffer("placement", torch.zeros(0), persistent=False)

    def decoder_layers(self) -> list[nn.Module]:
        return list(text_decoder(self.module).layers)

    def hidden_states(self, input_ids_BT, positions, inputs_embeds_BTD, cu_seqlens) -> torch.Tensor:
        """h_BTD as the head takes it; packed segments (cu_seqlens, batch 1) run one at a time."""
        if self.module is None:
            raise RuntimeError("the model runs as transformers' own, which was not loaded")
        given = input_ids_BT if inputs_embeds_BTD is None else inputs_embeds_BTD
        if positions is None:
            positions = torch.arange(given.shape[1], device=given.device).expand(given.shape[0], -1)
        key = "input_ids" if inputs_embeds_BTD is None else "inputs_embeds"
        run = lambda x, pos: self._head_input(**{key: x}, position_ids=pos)  # noqa: E731
        # in the head's dtype: transformers keeps some heads in fp32 and feeds them fp32 hidden states
        return per_segment(run, cu_seqlens, given, positions).to(self.head().weight.dtype)

    def head(self) -> nn.Module:
        """The LM head: the model's output embeddings, or those of the causal LM inside it (a multimodal model
        that holds a whole causal LM and does not pass its head on)."""
        return next(head for m in self.module.modules() if hasattr(m, "get_output_embeddings")
                    and (head := m.get_output_embeddings()) is not None)

    def _head_input(self, **inputs) -> torch.Tensor:
        """What transformers' causal-LM forward feeds its head (after the final norm and any scaling before the
        head): its forward run up to the head, where a hook takes the head's input and stops it (the head and
        anything after it, a logit cap, are the runtime's)."""
        def stop(head, args):
            raise _HeadReached(args[0])

        hook = self.head().register_forward_pre_hook(stop)
        try:
            self.module(**inputs, use_cache=False)
        except _HeadReached as reached:
            return reached.h_BTD
        finally:
            hook.remove()
        raise RuntimeError(f"{type(self.module).__name__} computed its logits without calling its head module")


def _reference(model_dir: Path, num_layers: int | None, dtype: torch.dtype) -> nn.Module:
    """transformers' model of the release, truncated to num_layers, the release's weights loaded by name."""
    from transformers import AutoConfig

    # the release's own code (auto_map) never runs in this process: transformers' class of the family only
    config = truncated_config(AutoConfig.from_pretrained(model_dir, trust_remote_code=False), num_layers)
    cls = transformers_class(config.model_type)
    if cls is None:
        raise RuntimeError(f"{model_dir}: transformers has no model for {config.model_type!r}, whose own modules "
                           "the runtime model needs")
    return cls.from_pretrained(model_dir, config=config, dtype=dtype, trust_remote_code=False)


def load_own_modules(model: nn.Module, model_dir: Path) -> None:
    """Fill every OwnModule slot (or the OwnModel) of `model` with transformers' module, the release's weights in it."""
    whole = next((m for m in model.modules() if isinstance(m, OwnModel)), None)
    if whole is not None:
        reference = _reference(Path(model_dir), whole.num_layers, whole.placement.dtype)
        whole.module = reference.to(whole.placement.device).train(model.training)
        return
    slots = own_slots(model)
    if not slots:
        return
    dtype = next(p.dtype for p in model.parameters())
    reference = _reference(Path(model_dir), max(s.index for s in slots) + 1, dtype)
    decoder = text_decoder(reference)
    context = _Context(decoder)
    for slot in slots:
        module = decoder.layers[slot.index]
        module = module.get_submodule(slot.path) if slot.path else module
        slot.bind(module.train(model.training), context)
