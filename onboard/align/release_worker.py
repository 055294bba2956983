"""Inside the sandbox only (onboard/align/release_code.py starts it): load the release with its own code
(transformers' `trust_remote_code=True`, the one place onboard passes it) and compute what tiers 1 and 2 ask,
from the token ids in inputs.safetensors into outputs.safetensors beside the request, result.json saying which
module of each layer is its attention and its FFN; error.json with the reason when anything fails."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

from onboard.align.reference import Recorder, attention_module, decoder_layers, ffn_module
from onboard.align.release_code import ERROR, INPUTS, OUTPUTS, RESULT
from onboard.release.model_source import MODEL_ENTRIES
from runtime.model.own_modules import truncated_config


def load_release_model(source: str, dtype: torch.dtype, num_layers: int | None):
    """The release's own model class (auto_map), eval mode; the first num_layers decoder layers when given."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, trust_remote_code=True)
    auto_map = getattr(config, "auto_map", None) or {}
    entry = next(key for key in MODEL_ENTRIES if key in auto_map)
    config = truncated_config(config, num_layers)
    cls = getattr(transformers, entry)
    if getattr(config, "quantization_config", None) is None:
        return cls.from_pretrained(source, config=config, dtype=dtype, trust_remote_code=True).eval()
    # a quantized release: its own modules hold the stored tensors and decode them (their dequantization is the
    # reference), without the quantizer transformers would hand the config to
    del config.quantization_config
    model = cls.from_config(config, trust_remote_code=True).to(dtype)
    _load_stored(model, Path(source), dtype, truncated=num_layers is not None)
    return model.eval()


def _load_stored(model, source: Path, dtype: torch.dtype, truncated: bool) -> None:
    """The release's tensors as stored (floating ones in `dtype`) into its own model when its modules hold them
    (their dequantization is the reference); else, for a model of plain weights, the stored weights decoded by our
    fp64 decoders (onboard/align/stored.py) under their logical names. Every tensor the model has must come from the
    release, and (unless cut to fewer layers) every released tensor must have a place."""
    from safetensors.torch import load_file

    state = {k: v.to(dtype) if v.is_floating_point() else v
             for f in sorted(source.glob("*.safetensors")) for k, v in load_file(f).items()}
    own = model.state_dict()
    if not set(own) <= set(state):
        from onboard.align.stored import reference_state_dict
        from onboard.release.manifest import read_manifest

        state = reference_state_dict(read_manifest(source), dtype)
    result = model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    unexpected = [k for k in state if k not in own]
    if result.missing_keys or (unexpected and not truncated):
        raise KeyError(f"the release's own model and its tensors disagree: missing {result.missing_keys[:5]}, "
                       f"unexpected {unexpected[:5]}")


def run_logits(model, ids: torch.Tensor, tag: str, record: bool, out: dict) -> None:
    recorder = Recorder(model) if record else None
    with torch.no_grad():
        out[f"{tag}/logits"] = model(input_ids=ids, use_cache=False).logits.float()
    if recorder is None:
        return
    recorder.close()
    for (part, index), (args, kwargs, output) in recorder.calls.items():
        hidden = args[0] if args else kwargs.get("hidden_states")
        # a layer whose input is no tensor (a list of block sums) cannot be fed alone: left out, the parent says so
        if isinstance(hidden, torch.Tensor) and isinstance(output, torch.Tensor):
            out[f"{tag}/{part}/{index}/in"], out[f"{tag}/{part}/{index}/out"] = hidden.float(), output.float()


def run_layers(model, ids: torch.Tensor, tag: str, layers: list[int], seed: int, out: dict, info: dict) -> None:
    """Each layer rerun on the input the whole model fed it: output, input gradient, LoRA-target gradients."""
    from onboard.align.tiers.layer_grads import LORA_TARGETS, cotangent
    from onboard.align.tiers.tier1_layers import hf_rerun

    recorder = Recorder(model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    recorder.close()
    hf_layers = decoder_layers(model)
    for i in layers:
        args, kwargs, _ = recorder.calls[("layer", i)]
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            info[f"{tag}/{i}"] = {"unchecked": f"layer {i} of the release's code takes {type(hidden).__name__}, not "
                                               "hidden states: it cannot be rerun alone on them"}
            continue
        h = hidden.detach().clone().requires_grad_(True)
        layer_out = hf_rerun(hf_layers[i], recorder.calls[("layer", i)], h)
        (layer_out.double() * cotangent(layer_out.shape, seed)).sum().backward()
        out[f"{tag}/{i}/in"], out[f"{tag}/{i}/out"], out[f"{tag}/{i}/grad_input"] = (
            hidden.detach().float(), layer_out.detach().float(), h.grad.float())
        for name, p in hf_layers[i].named_parameters():
            if LORA_TARGETS.search(name) and p.grad is not None:
                out[f"{tag}/{i}/grad/{name}"] = p.grad.float()
        info[f"{tag}/{i}"] = _part_names(hf_layers[i])


def _part_names(layer) -> dict[str, str | None]:
    """The attribute names of the layer's attention and FFN modules (how their parameters are named in it)."""
    names = {id(module): name for name, module in layer.named_children()}
    return {part: names.get(id(module)) if module is not None else None
            for part, module in (("attention", attention_module(layer)), ("ffn", ffn_module(layer)))}


def worker_main(request_path: Path) -> int:
    work = request_path.parent
    try:
        from safetensors.torch import load_file, save_file

        request = json.loads(request_path.read_text())
        inputs, out, info, models = load_file(str(work / INPUTS)), {}, {}, {}
        for task in request["tasks"]:
            dtype = getattr(torch, task["dtype"])
            if dtype not in models:
                models[dtype] = load_release_model(request["source"], dtype, request["num_layers"])
            ids = inputs[task["ids"]]
            if task["kind"] == "logits":
                run_logits(models[dtype], ids, task["tag"], task["record"], out)
            else:
                run_layers(models[dtype], ids, task["tag"], task["layers"], task["seed"], out, info)
        # one tensor may be recorded twice (a layer's output is the next one's input): each saved as its own copy
        save_file({k: v.detach().clone().contiguous() for k, v in out.items()}, str(work / OUTPUTS))
        (work / RESULT).write_text(json.dumps(info))
        return 0
    except Exception as err:  # the parent reads the reason; the check fails, nothing crashes
        frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
        at = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
        (work / ERROR).write_text(json.dumps({"error": f"{type(err).__name__}: {str(err)[:300]}{at}"}))
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(worker_main(Path(sys.argv[1])))
