"""``veloxquant eval``: what a compressed KV cache does to a model's predictions.

For each cache (float16, mlx_lm's affine ``QuantizedKVCache`` at 8 and 4 bits,
and every veloxquant method x bit width) on real English text (the Python
language reference that ships with CPython in ``pydoc_data``):

- perplexity, with the text fed through the cache in chunks after a prefix,
  so that predictions attend to cached (compressed) keys and values;
- top-1 agreement with the float16 cache and the mean KL divergence
  KL(p_fp16 || p_cache) of next-token distributions, under teacher forcing;
- pass-key retrieval ("needle in a haystack") at several context lengths and
  depths, greedy decoding;
- KV bytes held and the bits per element they amount to.

Writes ``results.md``, ``results.json`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx


def english_text(topic: Optional[str] = None) -> str:
    """Real English prose on every CPython install: the language reference topics."""
    from pydoc_data.topics import topics

    if topic is not None:
        if topic not in topics:
            raise ValueError(f"topic must be one of pydoc_data's topics, got {topic!r}")
        return topics[topic]
    return "\n\n".join(topics[k] for k in sorted(topics))


def encode_text(tokenizer, text: str) -> List[int]:
    """Token ids of a long text that is cut into pieces before any reaches the
    model, without the tokenizer's warning that the whole is longer than the
    model's context (transformers warns unless ``verbose=False``)."""
    try:
        return tokenizer.encode(text, verbose=False)
    except TypeError:  # a tokenizer without transformers' verbose option
        return tokenizer.encode(text)


def _say(msg: str) -> None:
    print(f"[veloxquant eval] {msg}", file=sys.stderr, flush=True)


@dataclass
class CacheSpec:
    label: str
    kind: str  # fp16 | mlx-quantized | veloxquant
    bits: Optional[int] = None
    value_bits: Optional[int] = None
    method: Optional[str] = None
    value_method: Optional[str] = None  # None: the keys' method (or its default pairing)
    group_size: int = 64
    window: int = 0
    sinks: int = 0
    seed: int = 0
    key_group: int = 32  # tokens of a KIVI key group
    key_channel_bits: str = "uniform"  # KVConfig.key_channel_bits
    protect: Optional[str] = None  # "auto": KVConfig(protect="auto")
    bits_budget: Optional[float] = None  # KVConfig.auto over `calibration`, within this budget
    calibration: Optional[List[int]] = None
    context: Optional[int] = None  # bits_budget counts what the cache stores at this many tokens
    recipe: Optional[str] = None  # the KVConfig JSON that bits_budget's calibration chose
    recipe_summary: Optional[str] = None  # and what it chose per layer, in a line

    def make(self, model):
        from mlx_lm.models.cache import make_prompt_cache as mlx_make

        from ..cache import KVConfig, make_mlx_quantized_cache, make_prompt_cache

        if self.kind == "fp16":
            return mlx_make(model)
        if self.kind == "mlx-quantized":
            return make_mlx_quantized_cache(model, self.bits, self.group_size)
        cfg = KVConfig(key_method=self.method, key_bits=self.bits, value_method=self.value_method,
                       value_bits=self.value_bits, window=self.window, sinks=self.sinks, seed=self.seed,
                       key_group=self.key_group, key_channel_bits=self.key_channel_bits)
        import dataclasses

        if self.protect:
            cfg = dataclasses.replace(cfg, protect=self.protect)
        if self.bits_budget is not None:
            if self.recipe is None:  # one calibration per spec
                from ..recipe import auto_recipe

                chosen, recipe = auto_recipe(
                    model, self.calibration, self.bits_budget,
                    KVConfig(window=self.window, sinks=self.sinks, seed=self.seed), context=self.context,
                )
                self.recipe, self.recipe_summary = chosen.to_json(), recipe.summary()
            cfg = KVConfig.from_json(self.recipe)
        return make_prompt_cache(model, cfg)


@dataclass
class Result:
    spec: CacheSpec
    ppl: float = float("nan")
    top1: float = float("nan")
    kl: float = float("nan")
    kv_bytes: int = 0  # held: allocated capacity included
    data_bytes: int = 0  # stored for the tokens held
    bits_per_element: float = float("nan")  # from data_bytes
    held_bits_per_element: float = float("nan")  # from kv_bytes
    compressed_share: float = 0.0  # of the tokens attended, the share read from codes
    needle: dict = field(default_factory=dict)  # "len@depth" -> bool
    seconds: float = 0.0


def _kv_elements(cache) -> int:
    """Key and value elements held, from the fp16 KVCache layout."""
    n = 0
    for c in cache:
        k = getattr(c, "keys", None)
        if k is not None and hasattr(k, "shape"):
            B, H, _, D = k.shape
            n += 2 * B * H * c.offset * D
    return n


def _compressed_share(cache) -> tuple:
    """(tokens read from codes, tokens held) over a list of caches' layers."""
    comp = held = 0
    for c in cache:
        layer = getattr(c, "layer", None)
        if layer is not None and hasattr(layer, "compressed_tokens"):
            comp += layer.compressed_tokens
            held += layer.offset
        elif hasattr(c, "offset"):
            held += c.offset
            if isinstance(getattr(c, "keys", None), (tuple, list)):  # mlx_lm's quantized cache: every token
                comp += c.offset
    return comp, held


def _log_softmax(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def replaced_layers(cache) -> List[int]:
    """The layers of a model's own cache list that the compressed caches take:
    those mlx_lm gives a plain ``KVCache`` (not sliding windows or recurrent
    state). Bits per element and the share read from codes count these."""
    from mlx_lm.models.cache import KVCache

    return [i for i, c in enumerate(cache) if type(c) is KVCache]


def teacher_forced(
    model, ids: List[int], cache, prefix: int, chunk: int, on_tokens: Optional[Callable[[int], None]] = None,
    counted: Optional[list] = None,
):
    """Log-probabilities [T, V] predicting ids[prefix:], fed through ``cache``,
    and the share of the history the chunks' predictions read from codes
    (tokens compressed over tokens held, before each chunk, in the layers'
    caches ``counted``, by default all); ``on_tokens(n)`` after each forward,
    with the tokens fed so far."""
    counted = cache if counted is None else counted
    x = mx.array(ids)[None]
    outs = []
    logits = model(x[:, :prefix], cache=cache)
    outs.append(_log_softmax(logits[0, -1:]))
    mx.eval(outs[-1])
    pos = prefix
    comp = held = 0
    if on_tokens is not None:
        on_tokens(pos)
    while pos < len(ids) - 1:
        n = min(chunk, len(ids) - 1 - pos)
        # What the chunk's predictions will read of the history: held before
        # the chunk enters (the chunk itself is exact within its forward).
        c, h = _compressed_share(counted)
        comp, held = comp + c, held + h
        logits = model(x[:, pos : pos + n], cache=cache)
        outs.append(_log_softmax(logits[0]))
        mx.eval(outs[-1])
        pos += n
        if on_tokens is not None:
            on_tokens(pos)
    return mx.concatenate(outs, axis=0), (comp / held if held else 0.0)


PASSKEY_INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the pass key.\n\n"
)


def needle_prompt(tokenizer, filler_ids: List[int], length: int, depth: float, key: str) -> List[int]:
    needle = tokenizer.encode(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
    head = tokenizer.encode(PASSKEY_INTRO)
    tail = tokenizer.encode("\n\nWhat is the pass key? The pass key is")
    n_fill = max(0, length - len(head) - len(tail) - len(needle))
    cut = int(round(n_fill * depth))
    return head + filler_ids[:cut] + needle + filler_ids[cut:n_fill] + tail


def needle_run(
    model, tokenizer, spec: CacheSpec, prompt: List[int], key: str, max_tokens: int,
    on_tokens: Optional[Callable[[int], None]] = None,
) -> bool:
    """Whether greedy decoding after ``prompt`` writes ``key``; ``on_tokens(n)``
    with the prompt tokens processed, then prompt and generated tokens."""
    from mlx_lm.generate import generate_step

    cache = spec.make(model)
    out = []
    progress = (lambda done, total: on_tokens(done)) if on_tokens is not None else None
    for tok, _ in generate_step(
        mx.array(prompt), model, prompt_cache=cache, max_tokens=max_tokens, prompt_progress_callback=progress
    ):
        out.append(int(tok))
        if on_tokens is not None:
            on_tokens(len(prompt) + len(out))
    return key in tokenizer.decode(out).replace(" ", "")



def default_specs(methods: Sequence[str], bits: Sequence[int], window: int, sinks: int, mlx_bits: Sequence[int],
                  key_groups: Sequence[int] = (32,)):
    specs = [CacheSpec("fp16", "fp16")]
    specs += [CacheSpec(f"mlx-affine-{b}", "mlx-quantized", bits=b) for b in mlx_bits]
    for m in methods:
        key_method, _, value_method = m.partition("/")
        # "kivi-query": KIVI keys with bits per channel from the first queries.
        channel_bits = "query" if key_method == "kivi-query" else "uniform"
        key_method = "kivi" if key_method == "kivi-query" else key_method
        # KIVI keys: a row per key group (labelled when not the default 32 alone).
        groups = key_groups if key_method == "kivi" else (32,)
        for g in groups:
            named = f"{m}-g{g}" if key_method == "kivi" and tuple(key_groups) != (32,) else m
            specs += _method_specs(named, key_method, value_method, bits, window, sinks, g, channel_bits)
    return specs


def _method_specs(m: str, key_method: str, value_method: str, bits, window: int, sinks: int, key_group: int,
                  key_channel_bits: str = "uniform"):
    """The rows of one method pair (labelled ``m``) at each bit pair."""
    specs, seen = [], set()
    for kb, vb in bits:
        # One side alone compressed: the other side's bits say nothing.
        if value_method == "fp16" or key_method == "fp16":
            kb, vb = (kb, 16) if value_method == "fp16" else (16, vb)
            if (kb, vb) in seen:
                continue
            seen.add((kb, vb))
            label = f"{m}-{min(kb, vb)}"
        else:
            label = f"{m}-{kb}" if kb == vb else f"{m}-k{kb}v{vb}"
        specs.append(CacheSpec(label, "veloxquant", bits=kb, value_bits=vb, method=key_method,
                               value_method=value_method or None, window=window, sinks=sinks, key_group=key_group,
                               key_channel_bits=key_channel_bits))
    return specs


def evaluate(
    model, tokenizer, specs, tokens: int, prefix: int, chunk: int, needle_lengths, needle_depths, text_offset: int = 0,
    failed=None, progress: bool = False, layers: Optional[List[int]] = None,
):
    """One `Result` per spec. A baseline that MLX cannot run on this device
    (mlx_lm's quantized cache meets shapes MLX's CUDA back-end lacks, or a
    head size its 3-bit packing does not fit) is
    reported in `failed` with MLX's message when a list is given, and raises
    otherwise; the fp16 reference and veloxquant caches always raise.
    ``progress``: a bar on stderr within each spec, over the tokens it feeds
    (teacher forcing, then each needle prompt and its answer). Bits, bytes
    and the share read from codes count ``layers`` (default: those the
    compressed caches take, :func:`replaced_layers`)."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_make

    from .compare import Progress

    if layers is None:
        layers = replaced_layers(mlx_make(model))
    text_ids = encode_text(tokenizer, english_text())
    ids = text_ids[text_offset : text_offset + tokens]
    if len(ids) < tokens:
        raise ValueError(f"--tokens: the text has only {len(ids)} tokens after the offset")
    filler = text_ids[text_offset + tokens :]
    targets = mx.array(ids[prefix:])
    from ..cache import cache_data_nbytes, cache_nbytes

    needles = []  # (name, key, prompt, max_tokens), the same for every spec
    for n in needle_lengths:
        for d in needle_depths:
            key = str(10000 + (hash((n, d)) % 90000))
            needles.append((f"{n}@{d:g}", key, needle_prompt(tokenizer, filler, n, d, key), len(key) + 3))
    forced = len(ids) - 1
    total = forced + sum(len(p) + m for _, _, p, m in needles)

    results, ref = [], None
    for spec in specs:
        t0 = time.time()
        _say(f"{spec.label}: teacher forcing over {tokens} tokens ({prefix} prefix, chunks of {chunk})")
        bar = Progress(spec.label, total, progress)
        cache = spec.make(model)
        counted = [cache[i] for i in layers]
        try:
            lp, share = teacher_forced(
                model, ids, cache, prefix, chunk, on_tokens=lambda n: bar.to(n, "teacher forcing"), counted=counted
            )
        except (RuntimeError, ValueError) as e:
            # mlx_lm's QuantizedKVCache at 3 bits cannot hold head_dim 256
            # (a ValueError from its own slice update), MLX's CUDA back-end
            # lacks shapes (a RuntimeError).
            bar.close()
            if failed is None or spec.kind != "mlx-quantized":
                raise
            _say(f"{spec.label}: MLX cannot run it here: {e}")
            failed.append(f"{spec.label}: {e}")
            continue
        r = Result(spec)
        nll = -mx.take_along_axis(lp, targets[:, None], axis=-1).squeeze(-1)
        r.ppl = math.exp(nll.mean().item())
        r.kv_bytes = cache_nbytes(counted)
        r.data_bytes = cache_data_nbytes(counted)
        r.compressed_share = share
        if spec.kind == "fp16":
            ref = lp
            elements = _kv_elements(counted)
            r.top1, r.kl = 1.0, 0.0
        if ref is not None:
            r.top1 = (lp.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item()
            r.kl = (mx.exp(ref) * (ref - lp)).sum(-1).mean().item()
        # Elements of the keys and values held (float16's count, every cache
        # holds the same tokens): bits from the data stored, and from what is
        # held with the capacity allocated ahead (mlx_lm's KVCache grows by
        # 256 tokens).
        if ref is not None and elements:
            r.bits_per_element = 8 * r.data_bytes / elements
            r.held_bits_per_element = 8 * r.kv_bytes / elements
        done = forced
        for name, key, p, max_tokens in needles:
            r.needle[name] = needle_run(
                model, tokenizer, spec, p, key, max_tokens,
                on_tokens=lambda n, base=done, name=name: bar.to(base + n, f"needle {name}"),
            )
            done += len(p) + max_tokens
            bar.to(done, f"needle {name}")
        bar.close()
        r.seconds = time.time() - t0
        _say(
            f"{spec.label}: ppl {r.ppl:.3f}, top-1 {r.top1:.4f}, KL {r.kl:.5f}, {r.bits_per_element:.2f} bits/el "
            f"stored ({r.held_bits_per_element:.2f} held), {r.compressed_share:.0%} of the history from codes, "
            f"needle {sum(r.needle.values())}/{len(r.needle)} ({r.seconds:.0f}s)"
        )
        results.append(r)
    if ref is None:
        raise ValueError("the specs must include the fp16 cache (the reference)")
    return results


def targets_met(results: List[Result]) -> List[str]:
    """The quality targets, each line saying whether it was met."""
    fp = next(r for r in results if r.spec.kind == "fp16")
    lines = []
    for r in results:
        if r.spec.kind != "veloxquant":
            continue
        bpe = r.bits_per_element
        d_ppl = r.ppl / fp.ppl - 1
        needle_ok = r.needle == fp.needle
        if 3.0 <= bpe < 4.25:
            ok = d_ppl <= 0.01 and r.top1 >= 0.97 and needle_ok
            lines.append(
                f"{r.spec.label} ({bpe:.2f} bits/el, ~3.5 target: ppl within 1%, top-1 >= 97%, needle = fp16): "
                f"ppl {d_ppl:+.2%}, top-1 {r.top1:.2%}, needle {'=' if needle_ok else '!='} fp16 -> {'MET' if ok else 'NOT MET'}"
            )
        elif 2.0 <= bpe < 3.0:
            ok = d_ppl <= 0.03 and needle_ok
            lines.append(
                f"{r.spec.label} ({bpe:.2f} bits/el, ~2.5 target: ppl within 3%, needle = fp16): "
                f"ppl {d_ppl:+.2%}, needle {'=' if needle_ok else '!='} fp16 -> {'MET' if ok else 'NOT MET'}"
            )
    return lines


def _layers_note(layers) -> str:
    """Which layers the figures count, where a model keeps some of its own caches."""
    if not layers or layers[0] == layers[1]:
        return ""
    return (
        f"; both, and 'from codes', count the {layers[0]} of {layers[1]} layers that the compared caches take "
        "(those with a full-context KVCache; the others keep the model's sliding-window caches in every row)"
    )


def to_markdown(results: List[Result], meta: dict) -> str:
    fp = next(r for r in results if r.spec.kind == "fp16")
    needle_keys = list(fp.needle)
    lines = [
        "# KV-cache quality",
        "",
        f"Model `{meta['model']}`; text: Python language reference (pydoc_data), {meta['tokens']} tokens, "
        f"first {meta['prefix']} as prefix, then fed in chunks of {meta['chunk']} through the cache. "
        f"veloxquant window {meta['window']}, sinks {meta['sinks']} (tokens kept in float16). "
        "A chunk's predictions read the history as the cache holds it when the chunk arrives (the chunk's own "
        "tokens exactly); chunks are no longer than the window, and 'from codes' is the measured share of that "
        "history read from codes. Bits per element: 'stored' counts the data of the tokens held (codes, norms, "
        "scales, means, windows, rotations and codebooks), 'held' adds the capacity allocated ahead"
        + _layers_note(meta.get("layers"))
        + ". "
        f"Needle: pass-key retrieval, greedy, at length@depth {', '.join(needle_keys) or 'none'}. "
        f"Device: {meta['device']}.",
        "",
        "| cache | bits/el stored | bits/el held | from codes | perplexity | Δppl vs fp16 | top-1 agree | KL (nats) | needle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        needle = f"{sum(r.needle.values())}/{len(r.needle)}" if r.needle else "-"
        lines.append(
            f"| {r.spec.label} | {r.bits_per_element:.2f} | {r.held_bits_per_element:.2f} | {r.compressed_share:.0%} "
            f"| {r.ppl:.3f} | {r.ppl / fp.ppl - 1:+.2%} | {r.top1:.2%} | {r.kl:.5f} | {needle} |"
        )
    if needle_keys:
        lines += ["", "Needle retrieval per length@depth (1 = found):", ""]
        lines.append("| cache | " + " | ".join(needle_keys) + " |")
        lines.append("|---|" + "---|" * len(needle_keys))
        for r in results:
            lines.append(f"| {r.spec.label} | " + " | ".join(str(int(r.needle[k])) for k in needle_keys) + " |")
    recipes = [r for r in results if r.spec.recipe_summary]
    if recipes:
        lines += ["", "Recipes chosen (`KVConfig.auto` within the budget in the label; bits as the recipe counts them):", ""]
        lines += [f"- {r.spec.label}: {r.spec.recipe_summary}" for r in recipes]
    if meta.get("skipped"):
        lines += ["", "Skipped (width not offered by the method): " + "; ".join(meta["skipped"]) + "."]
    if meta.get("failed"):
        lines += ["", "Not run (MLX or mlx_lm cannot run it here): " + "; ".join(meta["failed"])]
    t = targets_met(results)
    lines += ["", "## Targets", ""] + ([f"- {x}" for x in t] or ["- no veloxquant configuration near 2.5 or 3.5 bits/element was run"])
    return "\n".join(lines) + "\n"


def json_rows(results: List[Result], meta: dict) -> List[dict]:
    """One JSON object per cache: what it is, its bits per element and its
    quality against float16."""
    fp = next(r for r in results if r.spec.kind == "fp16")
    rows = []
    for r in results:
        s = r.spec
        rows.append({
            "model": meta["model"], "device": meta["device"], "tokens": meta["tokens"], "prefix": meta["prefix"],
            "chunk": meta["chunk"], "recipe": s.label, "kind": s.kind, "method": s.method,
            "value_method": s.value_method or s.method, "key_bits": s.bits,
            "value_bits": s.value_bits if s.value_bits is not None else s.bits,
            "window": s.window if s.kind == "veloxquant" else None, "sinks": s.sinks if s.kind == "veloxquant" else None,
            "key_group": s.key_group if s.kind == "veloxquant" and s.method == "kivi" else None,
            "key_channel_bits": s.key_channel_bits if s.kind == "veloxquant" and s.method == "kivi" else None,
            "bits_per_element": r.bits_per_element, "held_bits_per_element": r.held_bits_per_element,
            "kv_bytes": r.kv_bytes, "data_bytes": r.data_bytes, "compressed_share": r.compressed_share,
            "ppl": r.ppl, "delta_ppl_pct": 100 * (r.ppl / fp.ppl - 1), "kl": r.kl, "top1": r.top1,
            "needle": r.needle, "seconds": r.seconds,
        })
    return rows


def family(spec: CacheSpec) -> str:
    """The line a cache belongs to in the plots: its method, or mlx-affine."""
    if spec.kind != "veloxquant":
        return "mlx-affine"
    if spec.bits_budget is not None:  # per-layer choices: not a uniform method's line
        return "recipe-auto"
    return spec.method if spec.value_method in (None, spec.method) else f"{spec.method}/{spec.value_method}"


def pareto_plot(results: List[Result], path: Path) -> Path:
    """Δperplexity (%) and KL against the bits per element stored, one line per
    family, every point labelled with its configured width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp = next(r for r in results if r.spec.kind == "fp16")
    groups = {}
    for r in results:
        if r.spec.kind != "fp16":
            groups.setdefault(family(r.spec), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (metric, ylabel) in zip(axes, (("dppl", "Δ perplexity vs float16 (%)"), ("kl", "KL(fp16 || cache), nats"))):
        for name, rs in sorted(groups.items()):
            rs = sorted(rs, key=lambda r: r.bits_per_element)
            xs = [r.bits_per_element for r in rs]
            ys = [100 * (r.ppl / fp.ppl - 1) if metric == "dppl" else r.kl for r in rs]
            (line,) = ax.plot(xs, ys, "o-", label=name)
            for r, x, y in zip(rs, xs, ys):
                ax.annotate(bits_label(r.spec), (x, y), textcoords="offset points", xytext=(4, 5), fontsize=8,
                            color=line.get_color())
        ax.set_yscale("symlog", linthresh=0.1 if metric == "dppl" else 1e-4)
        ax.set_xlabel("bits per element stored (labels: configured bits)")
        ax.set_ylabel(ylabel)
        ax.margins(x=0.08, y=0.12)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("quality per bit (lower left is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def bits_label(spec: CacheSpec) -> str:
    """The configured width of a compressed cache: '4b', or 'k4v3' when keys
    and values differ."""
    if spec.bits_budget is not None:
        return f"≤{spec.bits_budget:g}b"
    kb = spec.bits
    vb = spec.value_bits if spec.value_bits is not None else kb
    if kb is None:
        return "16b"
    return f"{kb}b" if kb == vb else f"k{kb}v{vb}"


def plot(results: List[Result], out: Path) -> List[Path]:
    """perplexity.png, top1.png, kl.png (each against the bits per element held,
    every point labelled with its configured width) and needle.png (found or
    not, per cache and length@depth, with a legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fp = next(r for r in results if r.spec.kind == "fp16")
    paths = []
    groups = {}
    for r in results:
        if r.spec.kind == "fp16":
            continue
        groups.setdefault(family(r.spec), []).append(r)
    for metric, ylabel, fname in (
        ("ppl", "perplexity", "perplexity.png"),
        ("top1", "top-1 agreement with fp16", "top1.png"),
        ("kl", "KL(fp16 || cache), nats", "kl.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rs in groups.items():
            rs = sorted(rs, key=lambda r: r.bits_per_element)
            xs, ys = [r.bits_per_element for r in rs], [getattr(r, metric) for r in rs]
            (line,) = ax.plot(xs, ys, "o-", label=name)
            for r, x, y in zip(rs, xs, ys):
                ax.annotate(
                    bits_label(r.spec), (x, y), textcoords="offset points", xytext=(4, 5), fontsize=8,
                    color=line.get_color(),
                )
        ax.axhline(getattr(fp, metric), color="k", ls="--", lw=1, label="fp16")
        ax.margins(x=0.08, y=0.12)  # room for the labels inside the axes
        ax.set_xlabel("bits per element stored (labels: configured bits, k/v when they differ)")
        ax.set_ylabel(ylabel)
        if metric == "kl":
            ax.set_yscale("symlog", linthresh=1e-4)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        p = out / fname
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(p)
    if fp.needle:
        keys = list(fp.needle)
        labels = [r.spec.label for r in results]
        width = 1.5 + 0.09 * max(len(x) for x in labels) + 0.7 * len(keys)
        fig, ax = plt.subplots(figsize=(max(width, 4.5), 1.4 + 0.35 * len(results)))
        grid = [[float(r.needle[k]) for k in keys] for r in results]
        cmap = matplotlib.colormaps["RdYlGn"]
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(keys)), keys, rotation=45, ha="right")
        ax.set_yticks(range(len(results)), labels)
        ax.set_xlabel("context length @ depth of the pass key")
        ax.set_title("pass-key retrieval")
        ax.legend(
            handles=[Patch(color=cmap(1.0), label="found"), Patch(color=cmap(0.0), label="not found")],
            loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False,
        )
        fig.tight_layout()
        p = out / "needle.png"
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(p)
    paths.append(pareto_plot(results, out / "pareto.png"))
    return paths


def _int_list(s: str, name: str) -> List[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name}: expected comma-separated integers, got {s!r}")


def _method_widths(method: str) -> Optional[List[int]]:
    """The bit widths a cache method takes (kivi-query: KIVI's; None: any)."""
    from .._native import CACHE_METHODS

    entry = CACHE_METHODS.get("kivi" if method == "kivi-query" else method)
    return None if entry is None else entry[0]


def _widths_supported(spec: str, kb: int, vb: int) -> bool:
    """Whether `spec` (a method, or key/value methods) takes key bits `kb`
    and value bits `vb` (a float16 side takes any)."""
    key, _, value = spec.partition("/")
    pairs = ((key, kb), (value or key, vb))
    return all((w := _method_widths(m)) is None or b in w for m, b in pairs)


def _widths_text(spec: str) -> str:
    return "/".join(f"{w}" if (w := _method_widths(m)) is not None else "any" for m in dict.fromkeys(spec.split("/")))


def _bit_pairs(s: str) -> List[tuple]:
    """'2,3,4/3' -> [(2, 2), (3, 3), (4, 3)]: key bits, or key/value bits."""
    out = []
    for part in (x.strip() for x in s.split(",")):
        if not part:
            continue
        try:
            kb, _, vb = part.partition("/")
            out.append((int(kb), int(vb or kb)))
        except ValueError:
            raise SystemExit(f"--bits: expected bits or key/value bits like 4/3, got {part!r}")
    return out


def _float_list(s: str, name: str) -> List[float]:
    try:
        v = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name}: expected comma-separated numbers, got {s!r}")
    if any(not 0 <= d <= 1 for d in v):
        raise SystemExit(f"{name}: depths must be between 0 and 1, got {s!r}")
    return v


def main(argv: Optional[Sequence[str]] = None) -> int:
    # The veloxquant methods (LayerCache's key_method/value_method); the
    # keys-only ones pair with turboquant-mse values.
    from ..cache import METHODS

    p = argparse.ArgumentParser(prog="veloxquant eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="mlx_lm model path (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--methods", default="turboquant-mse",
        help=f"veloxquant methods, comma-separated, from {', '.join(METHODS)}; KEY/VALUE for a pair "
        "(e.g. kivi/turboquant-mse: per-channel keys, rotated values); kivi-query as keys: KIVI keys with bits "
        "per channel from the first queries (KVConfig.key_channel_bits='query')"
    )
    p.add_argument(
        "--bits", default="2,3/2,3,4/3,4", help="veloxquant bits, comma-separated, key/value pairs allowed (default: 2,3/2,3,4/3,4)"
    )
    p.add_argument("--mlx-bits", default="2,3,4,8", help="mlx_lm affine bit widths, group 64 (default: 2,3,4,8; empty: none)")
    p.add_argument("--kv-window", type=int, default=16, help="float16 window of recent tokens (default: 16)")
    p.add_argument("--kv-sinks", type=int, default=0, help="float16 first tokens (default 0)")
    p.add_argument("--kv-key-group", default="32",
                   help="tokens of a KIVI key group, comma-separated: a row per group for KIVI keys (default: 32)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of text for perplexity (default: 1024)")
    p.add_argument("--prefix", type=int, default=256, help="tokens before scoring starts (default: 256)")
    p.add_argument("--chunk", type=int, default=16,
                   help="tokens per forward after the prefix, at most --kv-window (at least 1) (default: 16)")
    p.add_argument("--needle-lengths", default="4000,8000", help="needle context lengths (default: 4000,8000; empty: skip)")
    p.add_argument("--needle-depths", default="0.5", help="needle depths in [0, 1] (default: 0.5)")
    p.add_argument("--out", default="eval-results", help="output directory (default: ./eval-results)")
    p.add_argument("--out-jsonl", default=None, help="JSON lines, one per cache (default: OUT/quality.jsonl)")
    p.add_argument(
        "--auto", default="", help="more veloxquant rows: 'protect' (each --bits row with --kv-protect auto) and "
        "bit budgets (--kv-recipe auto, calibrated on the prefix's first tokens, the budget counting what the cache "
        "stores at --tokens), e.g. protect,3,3.5 (default: none)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(list(argv) if argv is not None else None)
    bits = _bit_pairs(args.bits)
    mlx_bits = _int_list(args.mlx_bits, "--mlx-bits")
    lengths = _int_list(args.needle_lengths, "--needle-lengths")
    depths = _float_list(args.needle_depths, "--needle-depths")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    known = METHODS + ("kivi-query",)
    unknown = [m for m in methods if any(x not in known for x in m.split("/", 1)) or "/kivi-query" in m]
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(known)} (kivi-query: KIVI keys "
                "with bits per channel from the first queries, keys only)")
    if not 0 < args.prefix < args.tokens:
        raise SystemExit(f"--prefix must be between 1 and --tokens - 1, got {args.prefix}")
    if args.chunk < 1:
        raise SystemExit(f"--chunk must be >= 1, got {args.chunk}")
    if args.chunk > max(args.kv_window, 1):
        # A longer chunk would attend its first tokens' successors exactly
        # beyond the window, and the figures would flatter the codes.
        raise SystemExit(f"--chunk {args.chunk} exceeds --kv-window {args.kv_window}: chunks no longer than the window")
    from ..cache import MLX_QUANTIZED_BITS

    for b in mlx_bits:
        if b not in MLX_QUANTIZED_BITS:
            raise SystemExit(f"--mlx-bits: {b} is not one of {', '.join(map(str, MLX_QUANTIZED_BITS))}")
    for kb, vb in bits:
        if not (1 <= kb <= 16 and 1 <= vb <= 16):
            raise SystemExit(f"--bits: {kb}/{vb} is out of range 1..16")
    # A sweep skips the widths a method lacks (below); a sweep left with no
    # compressed row at all is an error now, before the model loads.
    if methods and bits and not any(_widths_supported(m, kb, vb) for m in methods for kb, vb in bits):
        p.error(f"--bits: {args.bits} fits none of --methods {','.join(methods)} "
                f"({'; '.join(f'{m}: {_widths_text(m)}' for m in methods)})")

    from . import models

    from .. import blas

    path = models.resolve_model(args.model)
    w = blas.warning()
    if w:
        _say(w)
    model, tokenizer = models.load(path)
    compute = blas.maybe_float32_compute(model)
    if compute:
        _say(f"CPU: {compute}")
    from ..cache import KVConfig

    try:
        key_groups = [int(g) for g in args.kv_key_group.split(",") if g.strip()] or [32]
        for g in key_groups:
            KVConfig(key_method="kivi", key_group=g)
    except ValueError as e:
        raise SystemExit(f"--kv-key-group: {e}")
    specs = default_specs(methods, bits, args.kv_window, args.kv_sinks, mlx_bits, key_groups)
    import dataclasses

    from ..recipe import MAX_TOKENS

    auto = [a.strip() for a in args.auto.split(",") if a.strip()]
    try:
        budgets = [float(a) for a in auto if a != "protect"]
    except ValueError:
        raise SystemExit(f"--auto: expected 'protect' and bit budgets, got {args.auto!r}")
    if "protect" in auto:
        specs += [dataclasses.replace(s, label=s.label + "-protect-auto", protect="auto") for s in specs if s.kind == "veloxquant"]
    for b in budgets:
        specs.append(CacheSpec(f"recipe-auto-{b:g}", "veloxquant", bits=4, method="turboquant-mse", window=args.kv_window,
                               sinks=args.kv_sinks, bits_budget=b, context=args.tokens,
                               calibration=encode_text(tokenizer, english_text())[:min(MAX_TOKENS, args.prefix)]))
    # Validate every veloxquant configuration before the long run. A sweep
    # may pair a method with widths it lacks (pq has 1, 2, 4): those are
    # skipped, said so, and listed in the results; an unknown method is an
    # error.
    kept, skipped = [], []
    for s in specs:
        if s.kind == "veloxquant":
            try:
                s.make(model)
            except (ValueError, TypeError) as e:
                if "bits" not in str(e):
                    raise SystemExit(f"--methods/--bits: {s.label}: {e}")
                _say(f"skipping {s.label}: {e}")
                skipped.append(f"{s.label}: {e}")
                continue
        kept.append(s)
    specs = kept
    failed: List[str] = []
    from mlx_lm.models.cache import make_prompt_cache as mlx_make

    own = mlx_make(model)
    layers = replaced_layers(own)
    results = evaluate(
        model, tokenizer, specs, args.tokens, args.prefix, args.chunk, lengths, depths, failed=failed,
        progress=not args.no_progress, layers=layers,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": Path(path).name if args.model else models.DEFAULT_MODEL_NAME,
        "tokens": args.tokens,
        "prefix": args.prefix,
        "chunk": args.chunk,
        "window": args.kv_window,
        "sinks": args.kv_sinks,
        "key_groups": key_groups,
        "device": str(mx.default_device()),
        "cpu_compute": compute,
        "skipped": skipped,
        "failed": failed,
    }
    meta["layers"] = [len(layers), len(own)]
    md = to_markdown(results, meta)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "results": [
                    {**r.spec.__dict__, **{k: v for k, v in r.__dict__.items() if k != "spec"}} for r in results
                ],
                "targets": targets_met(results),
            },
            indent=2,
        )
    )
    jsonl = Path(args.out_jsonl) if args.out_jsonl else out / "quality.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in json_rows(results, meta)))
    pngs = [jsonl] + plot(results, out)
    print(md)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}, " + ", ".join(str(x) for x in pngs))
    return 0
