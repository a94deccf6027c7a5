"""Where the model comes from: a built-in preset or a local Hugging Face directory.

Both are Hugging Face causal LMs: the presets are small Llama configs over a
byte vocabulary (a token is a byte, no tokenizer file needed), built as
transformers' ``LlamaForCausalLM`` with the same bits but without importing
transformers (``trainer/presets.py``: that import is most of a node's start-up);
``hf:PATH`` is any causal-LM architecture transformers knows, read from
``PATH/config.json`` and never from a hub.

Initial parameters must be bit-identical on every peer, whatever its device or
CPU: a random init is built on the CPU with transformers' own init scheme for
the architecture, but its normal draws come from a generator seeded by the run
seed through ``seeded_normal_`` (torch's float32 ``normal_`` gives other bits
under AVX2 than without), in the model's own traversal order. Pretrained
weights are loaded from safetensors only and must cover the config exactly.

A rank of a sharded host never holds the whole randomly initialised model: its
parameters are built on the meta device, sharded (``shard``), and each rank
fills only its rows of each parameter, drawing that one parameter whole (in the
same order, so the bits are those of the unsharded init) and dropping it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.config import ModelConfig
from trainer.parallel import local_tensor, own_rows
from trainer.presets import PRESETS, PresetLlama, preset_fields  # noqa: F401 (PRESETS: re-exported)

log = logging.getLogger(__name__)

@dataclass(slots=True)
class LoadedModel:
    """A causal LM on the CPU in fp32 and what the rest of the trainer needs to know about it."""

    module: nn.Module
    source: str
    # The Hugging Face config as a plain dict (config.to_dict()): what export writes back.
    config: dict
    vocab_size: int
    # Longest sequence the model is configured for (max_position_embeddings).
    context: int
    # Names of module.parameters() in order (tied weights once, as named_parameters yields them).
    param_names: list[str]
    # The directory holding the run's tokenizer files, if the source has one.
    tokenizer_dir: str | None
    # True for the presets, whose tokens are bytes.
    byte_level: bool
    # The safetensors files (and config.json) the parameters were read from; empty for a random init.
    weight_files: tuple[str, ...] = ()


def preset_config(name: str):
    """The preset as transformers' own config (tests and benchmarks build its LlamaForCausalLM)."""
    from transformers import LlamaConfig

    fields = preset_fields(name)
    del fields["model_type"], fields["architectures"]
    return LlamaConfig(**fields)


def _fail(path: str, what: str) -> ValueError:
    return ValueError(f"model.source: {path}: {what}")


def _one_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def read_hf_config(path: str):
    """The config of a local model directory; one-line ValueError naming what is wrong."""
    if not os.path.isdir(path):
        raise _fail(path, "not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise _fail(path, "no config.json (a Hugging Face model directory holds config.json and *.safetensors)")
    from transformers import AutoConfig, MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            json.load(f)
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise _fail(os.path.join(path, "config.json"), f"not a usable model config: {_one_line(e)}") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise _fail(os.path.join(path, "config.json"),
                    f"model_type {getattr(config, 'model_type', '?')!r} is not a causal language model transformers knows")
    return config


def _weight_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside keep their parameters on the meta device (no memory) and their
    buffers where they are computed (small, and the model's own values)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _rows_only(fill):
    """``fill(tensor, ...)`` for a sharded parameter too: the whole parameter drawn (the same
    draws as unsharded, in the same order), this rank's rows kept (FSDP2's dim-0 chunks)."""
    def sharded_fill(tensor, *args, **kwargs):
        if not hasattr(tensor, "to_local"):
            return fill(tensor, *args, **kwargs)
        whole = fill(torch.empty(tensor.shape, dtype=tensor.dtype), *args, **kwargs)
        tensor.to_local().copy_(whole[own_rows(tensor)])
        return tensor

    return sharded_fill


@contextlib.contextmanager
def _seeded_init(draw_from: torch.Generator, seed: int):
    """transformers' init functions, with normal and uniform draws from ``draw_from`` (bits
    independent of the CPU) and any other draw from the global RNG seeded by ``seed`` (restored
    afterwards)."""
    import transformers.initialization as init

    from trainer.determinism import seeded_normal_

    @_rows_only
    def draw_normal(tensor, mean, std):
        return seeded_normal_(tensor, std, draw_from, mean=mean)

    @_rows_only
    def draw_uniform(tensor, a, b):
        # float64 uniform_ is k * 2^-53 (integer arithmetic); one multiply and one add,
        # each rounded, then one rounding to the tensor's dtype.
        u = torch.empty(tensor.shape, dtype=torch.float64).uniform_(generator=draw_from)
        return tensor.copy_(torch.add(torch.mul(u, float(b) - float(a)), float(a)))

    # A tied pair is one parameter when the model was tied before its init (a sharded build):
    # its second draw is taken and dropped, as the unsharded init's tie drops the second copy.
    drawn: dict[int, torch.Tensor] = {}  # by id, each kept alive so that no id is reused

    def target(tensor):
        if id(tensor) not in drawn:
            drawn[id(tensor)] = tensor
            return tensor
        return torch.empty(tensor.shape, dtype=tensor.dtype)

    def normal_(tensor, mean=0.0, std=1.0, generator=None):
        if getattr(tensor, "_is_hf_initialized", False):
            return tensor
        with torch.no_grad():
            draw_normal(target(tensor), mean, std)
            return tensor

    def uniform_(tensor, a=0.0, b=1.0, generator=None):
        if getattr(tensor, "_is_hf_initialized", False):
            return tensor
        with torch.no_grad():
            draw_uniform(target(tensor), a, b)
            return tensor

    originals = init.normal_, init.uniform_
    init.normal_, init.uniform_ = normal_, uniform_
    try:
        # Other schemes (trunc_normal_, kaiming_*, ...) draw from the global RNG, seeded here;
        # their bits may depend on the CPU, which the run fingerprint's init hash would show.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        init.normal_, init.uniform_ = originals


def _empty_model(config, *, on_meta: bool) -> nn.Module:
    """The architecture allocated without initialising (buffers such as rotary frequencies are
    still computed by the modules); ``on_meta``: its parameters on the meta device, tied."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), (_parameters_on_meta() if on_meta else contextlib.nullcontext()):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if on_meta:
        model.tie_weights()  # a tied pair is one parameter before it is sharded
    return model


def _empty_preset(name: str, *, on_meta: bool) -> nn.Module:
    """A preset allocated without drawing its init (``on_meta``: parameters left on the meta
    device, to be sharded; buffers computed on the CPU either way)."""
    model = PresetLlama(name)
    if on_meta:
        model.model.rotary_emb.compute_buffers()
        return model
    return model.allocate()


def _initialise(model: nn.Module, seed: int, *, sharded: bool) -> None:
    """Random init, once, deterministically (on a sharded model: each rank its rows)."""
    with torch.no_grad():
        for p in model.parameters():
            local_tensor(p).fill_(float("nan"))  # whatever the init scheme misses must show, not be garbage memory
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    if isinstance(model, PresetLlama):
        from trainer.determinism import seeded_normal_

        model.initialize_weights(_rows_only(lambda t, mean, std: seeded_normal_(t, std, generator, mean=mean)))
    else:
        with _seeded_init(generator, seed):
            model.initialize_weights()
    if not sharded:
        model.tie_weights()
    missed = [name for name, p in model.named_parameters() if torch.isnan(local_tensor(p)).any()]
    if missed:
        raise ValueError(f"model.init: random init of {type(model).__name__} leaves {len(missed)} parameters "
                         f"uninitialised ({', '.join(missed[:3])}); use model.init = pretrained")


def _pretrained_model(path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if not _weight_files(path):
        raise _fail(path, "no *.safetensors weights (model.init = pretrained; use random to start from the config)")
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report repeats what is checked (and said in one line) below
    hf_logging.disable_progress_bar()  # a node's log is read line by line
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, use_safetensors=True, dtype=torch.float32, attn_implementation="sdpa",
            output_loading_info=True, trust_remote_code=False)
    except Exception as e:
        raise _fail(path, f"weights do not match config.json: {_shape_mismatches(path) or _one_line(e)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    problems = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"), ("mismatched_keys", "wrong shape"),
                      ("error_msgs", "error")):
        found = sorted(str(k) for k in info.get(key) or ())
        if found:
            problems.append(f"{len(found)} {what} ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})")
    if problems:
        raise _fail(path, "weights do not match config.json: " + "; ".join(problems))
    return model


def _weight_index(path: str, model: nn.Module) -> dict[str, str] | None:
    """Parameter name -> the safetensors file holding it, if the files hold exactly the (meta)
    model's parameters under its own names, with its shapes (a tied pair once or under both
    names); None otherwise: a checkpoint transformers renames or converts on load, or one that
    does not fit, which ``_pretrained_model`` loads whole (and refuses by name)."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    where: dict[str, str] = {}
    try:
        for file in _weight_files(path):
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    if key in aliases:
                        continue
                    p = params.get(key)
                    if p is None or p.dim() == 0 or tuple(f.get_slice(key).get_shape()) != tuple(p.shape):
                        return None
                    where[key] = file
    except Exception:
        return None
    return where if set(where) == set(params) else None


@torch.no_grad()
def _load_rows(model: nn.Module, where: dict[str, str]) -> None:
    """Each sharded parameter's rows of this rank, read from its safetensors file (a slice of
    the memory-mapped tensor: the rest of it is never read)."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, file in where.items():
        by_file.setdefault(file, []).append(name)
    params = dict(model.named_parameters())
    for file, names in by_file.items():
        with safe_open(file, "pt") as f:
            for name in names:
                local, rows = local_tensor(params[name]), own_rows(params[name])
                local.copy_(f.get_slice(name)[rows.start : rows.stop].to(local.dtype))


def check_source(cfg: ModelConfig) -> None:
    """The cheap checks of an hf: source (config, weights present), to fail before anything starts."""
    path = cfg.hf_path
    if path is None:
        return
    read_hf_config(path)
    if cfg.init in ("auto", "pretrained") and not _weight_files(path):
        raise _fail(path, "no *.safetensors weights (model.init = pretrained; use random to start from the config)")


def _shape_mismatches(path: str) -> str:
    """Which tensors of the safetensors files have another shape than the config's model
    (transformers only says that some did); empty if that cannot be told."""
    try:
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(read_hf_config(path)).state_dict().items()}
        wrong = []
        for file in _weight_files(path):
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    shape = tuple(f.get_slice(key).get_shape())
                    if key in expected and expected[key] != shape:
                        wrong.append(f"{key} is {list(shape)}, config.json needs {list(expected[key])}")
    except Exception:
        return ""
    return f"{len(wrong)} tensors of another shape ({'; '.join(wrong[:2])}{'; ...' if len(wrong) > 2 else ''})" if wrong else ""


def load_model(cfg: ModelConfig, seed: int, shard=None) -> LoadedModel:
    """The configured model on the CPU in fp32, in train mode. ``shard(module) -> module``: a
    multi-rank host's sharding (trainer/parallel.py), applied to the model built on the meta
    device, so that a rank only ever holds its own rows: of a random init, or read from the
    safetensors files (a checkpoint whose names transformers converts is still loaded whole)."""
    path = cfg.hf_path
    if path is None:  # a preset: built without transformers (trainer/presets.py)
        config, tokenizer_dir = None, None
    else:
        path = os.path.abspath(path)
        config = read_hf_config(path)
        tokenizer_dir = path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    random = path is None or cfg.init not in ("auto", "pretrained")
    rows_from = None  # a sharded pretrained model: where each parameter's rows are read from
    if path is None:
        module = _empty_preset(cfg.source, on_meta=shard is not None)
    elif random:
        module = _empty_model(config, on_meta=shard is not None)
    else:
        module = _empty_model(config, on_meta=True) if shard is not None else None
        rows_from = _weight_index(path, module) if module is not None else None
        if rows_from is None:
            module = _pretrained_model(path)
    module.train()
    if cfg.activation_checkpointing:
        if not getattr(module, "supports_gradient_checkpointing", False):
            raise ValueError(f"model.activation_checkpointing: {type(module).__name__} does not support it")
        if hasattr(module, "activation_checkpointing_enable"):  # the name since transformers 5.x
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if shard is not None:
        module = shard(module)
    if random:
        _initialise(module, seed, sharded=shard is not None)
    elif rows_from is not None:
        _load_rows(module, rows_from)
    if config is None:
        config_dict = preset_fields(cfg.source)
        context = config_dict["max_position_embeddings"]
    else:
        config_dict = config.to_dict()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        context = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        if not isinstance(context, int) or context < 2:
            raise _fail(path, "config.json has no usable max_position_embeddings")
    vocab = module.get_input_embeddings().weight.shape[0]
    return LoadedModel(module=module, source=cfg.source, config=config_dict, vocab_size=vocab, context=context,
                       param_names=[name for name, _ in module.named_parameters()], tokenizer_dir=tokenizer_dir,
                       byte_level=path is None,
                       weight_files=() if random else (*_weight_files(path), os.path.join(path, "config.json")))


def lm_loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``y`` is ``x`` shifted by one already (the sampler's windows).
    A model with a chunked loss head (trainer/loss.py) returns it from its own forward."""
    from trainer.loss import loss_head

    head = loss_head(module)
    if head is not None:
        head.targets = y
        try:
            return module(input_ids=x, use_cache=False).logits
        finally:
            head.targets = None
    logits = module(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def encode(text: str) -> list[int]:
    """Byte-level presets: text to tokens, its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(tokens) -> str:
    """Byte-level presets: tokens to text; a sampled model may emit invalid UTF-8, hence 'replace'."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def check_vocab(corpus, loaded: LoadedModel) -> None:
    """The data's tokens must be ids the model has: bytes for the presets, the tokenizer's for shards."""
    vocab = getattr(corpus, "vocab_size", None)
    if vocab is None:  # text read as bytes
        if not loaded.byte_level:
            raise ValueError(f"data.paths: text files are read as bytes, which only the built-in presets train on; "
                             f"tokenize them for {loaded.source} with `gonka-node prepare-data --tokenizer DIR`")
        return
    if vocab > loaded.vocab_size:
        raise ValueError(f"data.paths: {getattr(corpus, 'path', '?')}: its tokenizer has {vocab} tokens, more than "
                         f"the vocab_size {loaded.vocab_size} of {loaded.source}")
