"""Everything in a .colibri file checked the way its use would check it: the full-read checks
of the format (checksums, padding, finite values), the typed config against the tensor table
and against the checkpoint's config.json it was derived from, and the embedded tokenizer
built and exercised (encode, decode, the chat template rendered once).

    problems = validate(colibri_file)        # [] when the file is healthy
    config_vs_tensors(colibri_file, config)  # what load() refuses (check_loadable)

Used by `colibri inspect --validate` (tools/inspect.py), by `colibri convert` on the finished
temporary file before it is renamed, and (check_loadable) by Model at load.
"""
from __future__ import annotations

import dataclasses
import warnings

from ..config import ConfigError, ModelConfig
from ..errors import ColibriError
from ..families import FAMILIES, canonical_tensors, get_family
from . import ColibriFile
from .tokenizer import tokenizer_from_files

PROBE_TEXT = "Hello, world! 123 éß 日本語"
PROBE_CHAT = [{"role": "user", "content": "Hello"}]


def config_vs_tensors(cf: ColibriFile, config: ModelConfig) -> list[str]:
    """Problems between the typed config and the tensor table: missing / extra tensors,
    shapes, the header's layer and expert counts; each names both sides."""
    try:
        expected = {t.name: t.shape for t in canonical_tensors(config)}
    except (KeyError, TypeError, ValueError) as e:     # ConfigError is a ValueError
        return [f"metadata arch is incomplete ({type(e).__name__}: {e})"]
    problems = []
    if cf.n_layers != config.num_hidden_layers:
        problems.append(f"metadata arch num_hidden_layers {config.num_hidden_layers} "
                        f"contradicts the tensors: they hold {cf.n_layers} layers (header "
                        f"n_layers)")
    if cf.n_experts != config.num_experts:
        problems.append(f"metadata arch num_experts {config.num_experts} contradicts the "
                        f"tensors: they hold {cf.n_experts} experts per layer (header "
                        f"n_experts)")
    for name, shape in expected.items():
        if name not in cf.tensors:
            problems.append(f"tensor {name!r} missing (the arch implies it, shape {shape})")
        elif cf.tensors[name].shape != shape:
            problems.append(f"tensor {name!r} has shape {cf.tensors[name].shape}, the arch "
                            f"implies {shape}")
    extra = [n for n in cf.tensors if n not in expected]
    problems += [f"tensor {n!r} is not part of a {config.family} model as the arch describes "
                 f"it" for n in extra[:10]]
    return problems


def check_loadable(cf: ColibriFile) -> ModelConfig:
    """The file's typed config, refused (ConfigError naming the file, the field and the
    tensors) when it contradicts the tensor table: what Model runs at load."""
    config = cf.model_config
    if config.family in FAMILIES:
        problems = config_vs_tensors(cf, config)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ConfigError(f"{cf.path}: {problems[0]}{more}")
    return config


def arch_vs_config_json(cf: ColibriFile, config: ModelConfig) -> list[str]:
    """The stored arch against the one the family derives from the stored config.json (the
    converter wrote the second from the first): a changed field is named with both values."""
    hf = cf.config
    if not hf or not isinstance(hf, dict) or hf.get("model_type") is None:
        return []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            derived = get_family(hf.get("model_type")).model_config(hf)
    except (ColibriError, KeyError, TypeError, ValueError) as e:
        return [f"metadata config (config.json) does not describe a model: {e}"]
    diffs = [f"metadata arch field {f.name!r} is {getattr(config, f.name)!r}, the stored "
             f"config.json implies {getattr(derived, f.name)!r}"
             for f in dataclasses.fields(ModelConfig)
             if getattr(config, f.name) != getattr(derived, f.name)]
    return diffs


def _fatal(e: BaseException) -> bool:
    return isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit))


def tokenizer_problems(files: dict[str, str] | None, vocab_size: int | None = None
                       ) -> list[str]:
    """Build the embedded tokenizer and use it once: encode and decode a probe text, render
    the chat template (when there is one); token ids must fit the embedding (vocab_size).
    Failures of any kind (tokenizers' Rust panics are BaseExceptions) become problems."""
    if not files:
        return []
    try:
        tok = tokenizer_from_files(files)
    except BaseException as e:                         # noqa: BLE001 - reported
        if _fatal(e):
            raise
        return [f"tokenizer: cannot be built ({type(e).__name__}: {e})"]
    if tok is None:                                    # no tokenizer.json: token ids only
        return []
    problems = []
    try:
        ids = tok.encode(PROBE_TEXT)
        tok.decode(ids)
        if vocab_size is not None and tok.vocab_size > vocab_size:
            problems.append(f"tokenizer: {tok.vocab_size} tokens, more than the model's "
                            f"vocab_size {vocab_size} (ids past the embedding)")
        bad = [i for i in ids + list(tok.eos_token_ids) if vocab_size is not None
               and not 0 <= i < vocab_size]
        if bad:
            problems.append(f"tokenizer: token ids {bad[:5]} outside the model's vocabulary "
                            f"[0, {vocab_size})")
    except BaseException as e:                         # noqa: BLE001
        if _fatal(e):
            raise
        problems.append(f"tokenizer: encoding a probe text fails ({type(e).__name__}: {e})")
    if tok.has_chat_template:
        try:
            tok.apply_chat_template(PROBE_CHAT)
        except BaseException as e:                     # noqa: BLE001
            if _fatal(e):
                raise
            problems.append(f"tokenizer: the chat template cannot be rendered "
                            f"({type(e).__name__}: {e})")
    return problems


def validate(cf: ColibriFile, progress: bool = False) -> list[str]:
    """Every problem a full read and a trial use find: the format's full-read checks
    (ColibriFile.validate: checksums, padding, finite values, the typed config), the config
    against the tensors and against config.json, the tokenizer and chat template."""
    problems = cf.validate(progress=progress)
    arch = cf.arch
    config = None
    if isinstance(arch, dict) and arch:
        family = arch.get("family")
        if not isinstance(family, str) or family not in FAMILIES:
            problems.append(f"metadata arch names unknown family {arch.get('family')!r}")
        else:
            try:
                config = cf.model_config
            except ConfigError:
                pass                                   # already among cf.validate()'s problems
    if config is not None:
        problems += config_vs_tensors(cf, config)
        problems += arch_vs_config_json(cf, config)
    problems += tokenizer_problems(cf.tokenizer_files,
                                   config.vocab_size if config is not None else None)
    return problems
