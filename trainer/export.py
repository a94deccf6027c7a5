"""Export the swarm's global parameters θ from a node's checkpoint as a Hugging Face model directory.

The point is that a run's result leaves the swarm in the format every tool
reads: ``config.json``, safetensors weights (sharded with an index, named the
way transformers names them) and the run's tokenizer files, loadable with
``AutoModelForCausalLM.from_pretrained(out, local_files_only=True)``.

It runs next to a live node, so it reads ``latest.pt`` memory-mapped and
converts and writes one shard at a time: the resident set is θ's pages as they
are read plus one converted shard, never the checkpoint's optimizer state or a
second copy of the model. The node replaces ``latest.pt`` by rename while we
read; torch opens the path twice (once for the index, once for the mapping), so
the load is repeated until the path named one file throughout.

The output is built in a temporary directory beside ``out`` and renamed into
place at the end, so ``out`` is either complete or absent. The checkpoint is
input like any other: every problem is a one-line ``ValueError`` naming the file.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass

import torch

from trainer.checkpoint import HOST_LATEST, LATEST, host_part_path, load_error, load_tensors

# --dtype values and the torch dtype each writes.
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Default largest shard. Also the bound on the converted tensors held in memory at
# once, which is why it is not transformers' 50GB.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# What a Hugging Face tokenizer directory may hold; whatever of these exists is copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")
# How often to re-read a checkpoint replaced during the read before giving up.
LOAD_ATTEMPTS = 5


@dataclass(kw_only=True, slots=True, frozen=True)
class ExportResult:
    """What was written."""

    out: str
    run_id: str
    # Committed outer rounds of the exported θ.
    round: int
    dtype: str
    # Parameters written (a tied weight counts once, as it is stored once).
    parameters: int
    # Bytes of tensor data over all shards.
    bytes: int
    # File names inside ``out``, sorted.
    files: tuple[str, ...]


@dataclass(kw_only=True, slots=True)
class _Checkpoint:
    """The parts of a validated checkpoint that the export uses."""

    run_id: str
    round: int
    config: object  # transformers.PretrainedConfig
    names: list[str]
    tensors: list[torch.Tensor]
    tokenizer_dir: str | None


def export_checkpoint(checkpoint_dir: str, out: str, *, dtype: str = "bf16",
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> ExportResult:
    """Write θ of ``checkpoint_dir/latest.pt`` as a Hugging Face model directory ``out``."""
    if dtype not in DTYPES:
        raise ValueError(f"export: dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"export: max shard size must be a positive number of bytes (got {max_shard_bytes!r})")
    out = os.path.abspath(out)
    _check_out(out)
    if os.path.exists(os.path.join(checkpoint_dir, HOST_LATEST)):  # a multi-rank host's, one part per rank
        path, ckpt = _load_host(checkpoint_dir)
    else:
        path = os.path.join(checkpoint_dir, LATEST)
        ckpt = _validate(path, _load_pinned(path))
    tokenizer_files = [] if ckpt.tokenizer_dir is None else _tokenizer_files(path, ckpt.tokenizer_dir)

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = _make_temp_dir(parent, os.path.basename(out))
    try:
        parameters, size = _write_weights(tmp, ckpt, DTYPES[dtype], max_shard_bytes)
        ckpt.config.dtype = DTYPES[dtype]
        ckpt.config.save_pretrained(tmp)
        for name in tokenizer_files:
            shutil.copyfile(os.path.join(ckpt.tokenizer_dir, name), os.path.join(tmp, name))
        files = _make_durable(tmp)
        try:
            # Replaces an empty directory atomically; fails on anything else.
            os.rename(tmp, out)
        except OSError as e:
            raise ValueError(f"export: {out}: appeared while exporting and is not an empty directory "
                             f"({e.strerror})") from e
        _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out=out, run_id=ckpt.run_id, round=ckpt.round, dtype=dtype, parameters=parameters,
                        bytes=size, files=files)


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group names, in order, into shards of at most ``max_bytes``; a bigger tensor gets a shard
    of its own (huggingface_hub's rule, which transformers uses)."""
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not shards or used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_file_names(count: int) -> list[str]:
    """transformers' names: one file is model.safetensors, several model-0000i-of-0000n.safetensors."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write_weights(directory: str, ckpt: _Checkpoint, dtype: torch.dtype, max_bytes: int) -> tuple[int, int]:
    from safetensors.torch import save_file

    by_name = dict(zip(ckpt.names, ckpt.tensors))
    item = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards([(n, t.numel() * item) for n, t in by_name.items()], max_bytes)
    files = shard_file_names(len(shards))
    weight_map: dict[str, str] = {}
    for names, file in zip(shards, files):
        # Only this shard's converted tensors are alive; the mmap'd originals cost page cache.
        converted = {name: _converted(by_name[name], dtype) for name in names}
        save_file(converted, os.path.join(directory, file), metadata={"format": "pt"})
        del converted
        weight_map.update(dict.fromkeys(names, file))
    parameters = sum(t.numel() for t in ckpt.tensors)
    size = parameters * item
    if len(files) > 1:
        index = {"metadata": {"total_parameters": parameters, "total_size": size}, "weight_map": weight_map}
        with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return parameters, size


def _converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = tensor.to(dtype)
    # safetensors writes a tensor's own storage and refuses tensors sharing one; a view into
    # a bigger buffer (same dtype, so no copy was made) gets compact storage of its own.
    if not out.is_contiguous() or out.untyped_storage().nbytes() != out.nbytes:
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def _load_pinned(path: str) -> object:
    """``torch.load(path)`` memory-mapped, from one file even if ``path`` is replaced meanwhile."""
    for _ in range(LOAD_ATTEMPTS):
        try:
            # Holding the file open keeps its inode number from being reused by a newer file.
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ValueError(f"export: {path}: no such file (is {os.path.dirname(path) or '.'} "
                             "a node's --checkpoint-dir, with a checkpoint written?)") from None
        except OSError as e:
            raise ValueError(f"export: {path}: cannot open ({e.strerror})") from e
        try:
            before = os.fstat(fd)
            try:
                state = load_tensors(path, mmap=True)
            except FileNotFoundError:
                continue  # replaced between our open and torch's
            except Exception as e:
                raise ValueError(f"export: {path}: cannot load: {load_error(e)}") from e
            try:
                after = os.stat(path)
            except FileNotFoundError:
                continue
            if (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino):
                return state
            del state
        finally:
            os.close(fd)
    raise ValueError(f"export: {path}: replaced {LOAD_ATTEMPTS} times while being read; try again")


class _Joined:
    """A parameter of a multi-rank host's checkpoint: its ranks' shards (FSDP2's dim-0 chunks, in
    rank order), joined only when its safetensors shard is written."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        assert parts and all(p.dim() >= 1 for p in parts)
        self.parts = parts
        self.shape = torch.Size([sum(p.shape[0] for p in parts), *parts[0].shape[1:]])
        self.dtype = parts[0].dtype

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return all(p.is_floating_point() for p in self.parts)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.to(dtype) for p in self.parts])


def _load_host(directory: str) -> tuple[str, _Checkpoint]:
    """Every rank's part of the host's latest complete checkpoint, memory-mapped, as one
    checkpoint whose parameters are joined tensor by tensor as they are written. A newer
    checkpoint that replaces it meanwhile removes its files; the maps stay valid, and a part
    removed before it was opened makes the load start over."""
    import json

    pointer_path = os.path.join(directory, HOST_LATEST)
    for _ in range(LOAD_ATTEMPTS):
        try:
            with open(pointer_path, "rb") as f:
                pointer = json.loads(f.read(4096))
            seq, world = int(pointer["seq"]), int(pointer["world"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"export: {pointer_path}: cannot read ({e})") from None
        parts = []
        try:
            for rank in range(world):
                part = host_part_path(directory, seq, rank)
                try:
                    parts.append(load_tensors(part, mmap=True))
                except FileNotFoundError:
                    raise
                except Exception as e:
                    raise ValueError(f"export: {part}: cannot load: {load_error(e)}") from e
        except FileNotFoundError:
            continue
        path = host_part_path(directory, seq, 0)
        first = parts[0]
        if not isinstance(first, dict):
            raise ValueError(f"export: {path}: not a checkpoint part")
        shards = []
        for rank, part in enumerate(parts):
            tensors = part.get("worker", {}).get("global_params") if isinstance(part, dict) else None
            if not isinstance(tensors, list) or not all(isinstance(t, torch.Tensor) for t in tensors):
                raise ValueError(f"export: {host_part_path(directory, seq, rank)}: worker.global_params must be "
                                 f"a list of tensors")
            if part.get("rank") != rank or part.get("seq") != seq:
                raise ValueError(f"export: {host_part_path(directory, seq, rank)}: not rank {rank}'s part of "
                                 f"checkpoint {seq}")
            shards.append(tensors)
        if len({len(t) for t in shards}) != 1:
            raise ValueError(f"export: {directory}: the ranks' parts hold different numbers of parameters")
        for i, pieces in enumerate(zip(*shards)):
            if any(p.dim() == 0 for p in pieces) or len({tuple(p.shape[1:]) for p in pieces}) != 1:
                raise ValueError(f"export: {directory}: the ranks' shards of parameter {i} do not fit together")
        joined = [_Joined(list(pieces)) for pieces in zip(*shards)]
        worker = dict(first["worker"], global_params=joined)
        return path, _validate(path, dict(first, worker=worker))
    raise ValueError(f"export: {directory}: replaced {LOAD_ATTEMPTS} times while being read; try again")


def _validate(path: str, state: object) -> _Checkpoint:
    def fail(what: str) -> ValueError:
        return ValueError(f"export: {path}: {what}")

    if not isinstance(state, dict):
        raise fail(f"not a checkpoint (got {type(state).__name__})")
    run_id, worker, model = state.get("run_id"), state.get("worker"), state.get("model")
    if not isinstance(run_id, str):
        raise fail("run_id is missing or not a string")
    if not isinstance(worker, dict):
        raise fail("worker is missing or not a dict")
    rounds, tensors = worker.get("round"), worker.get("global_params")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise fail(f"worker.round must be a non-negative int (got {rounds!r})")
    if not isinstance(tensors, list):
        raise fail(f"worker.global_params must be a list of tensors (got {type(tensors).__name__})")
    if not isinstance(model, dict):
        raise fail("no model entry (written by a node without export support?)")
    config_dict, names, tokenizer_dir = model.get("config"), model.get("param_names"), model.get("tokenizer_dir")
    if not isinstance(config_dict, dict) or not isinstance(config_dict.get("model_type"), str):
        raise fail("model.config must be a Hugging Face config dict with a model_type")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise fail("model.param_names must be a list of strings")
    if tokenizer_dir is not None and not isinstance(tokenizer_dir, str):
        raise fail(f"model.tokenizer_dir must be a path or None (got {type(tokenizer_dir).__name__})")
    if len(names) != len(tensors):
        raise fail(f"{len(names)} model.param_names but {len(tensors)} worker.global_params")
    if len(set(names)) != len(names):
        raise fail("model.param_names has duplicates")
    for name, tensor in zip(names, tensors):
        if not isinstance(tensor, (torch.Tensor, _Joined)):
            raise fail(f"global parameter {name} is not a tensor (got {type(tensor).__name__})")
        if not tensor.is_floating_point():
            raise fail(f"global parameter {name} is not floating point (got {tensor.dtype})")

    config, expected = _expected_shapes(fail, config_dict)
    given = set(names)
    missing = [n for n in expected if n not in given]
    unexpected = [n for n in names if n not in expected]
    if missing or unexpected:
        raise fail(f"parameters do not match the {config_dict['model_type']} config: "
                   f"missing {_few(missing)}, unexpected {_few(unexpected)}")
    for name, tensor in zip(names, tensors):
        if tensor.shape != expected[name]:
            raise fail(f"global parameter {name} has shape {list(tensor.shape)}, "
                       f"the config expects {list(expected[name])}")
    return _Checkpoint(run_id=run_id, round=rounds, config=config, names=names, tensors=tensors,
                       tokenizer_dir=tokenizer_dir)


def _expected_shapes(fail, config_dict: dict) -> tuple[object, dict[str, torch.Size]]:
    """The config object and the parameter shapes of the model it describes, built on the
    meta device (no memory, no init). Names are named_parameters()'s: tied weights once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config_dict)
    model_type = fields.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception as e:
        raise fail(f"model.config: transformers cannot build a {model_type!r} config ({_first_line(e)})") from e
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise fail(f"model.config: not a causal LM transformers can build ({_first_line(e)})") from e
    # The class the weights were checked against is the one from_pretrained should build.
    config.architectures = [type(model).__name__]
    return config, {name: p.shape for name, p in model.named_parameters()}


def _tokenizer_files(path: str, tokenizer_dir: str) -> list[str]:
    if not os.path.isdir(tokenizer_dir):
        raise ValueError(f"export: {path}: model.tokenizer_dir {tokenizer_dir} is not a directory")
    found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, n))]
    if not found:
        raise ValueError(f"export: {path}: model.tokenizer_dir {tokenizer_dir} holds no tokenizer files "
                         f"({', '.join(TOKENIZER_FILES[:3])}, ...)")
    return found


def _check_out(out: str) -> None:
    if os.path.isdir(out):
        if os.listdir(out):
            raise ValueError(f"export: {out}: exists and is not empty; choose a new directory")
    elif os.path.lexists(out):
        raise ValueError(f"export: {out}: exists and is not a directory")


def _make_temp_dir(parent: str, name: str) -> str:
    # Not tempfile.mkdtemp: its 0700 would become the exported directory's mode.
    while True:
        path = os.path.join(parent, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _make_durable(directory: str) -> tuple[str, ...]:
    """Fsync every file and the directory, so the rename publishes complete files; returns the names."""
    files = tuple(sorted(os.listdir(directory)))
    # safetensors creates its files 0600; give them the mode the umask gave config.json.
    mode = os.stat(os.path.join(directory, "config.json")).st_mode & 0o777
    for name in files:
        if name.endswith(".safetensors"):
            os.chmod(os.path.join(directory, name), mode)
        _fsync(os.path.join(directory, name))
    _fsync(directory)
    return files


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
