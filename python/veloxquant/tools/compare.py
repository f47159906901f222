"""``veloxquant compare``, the main job: one long prompt through the default
model with mlx_lm's float16 cache, mlx_lm's 4-bit cache and veloxquant's,
side by side.

The prompt defaults to the first ~2,600 tokens of *Alice's Adventures in
Wonderland* (shipped in ``veloxquant/data``) and a question. For every cache
it reports the text, the KV bytes MLX holds (the arrays' bytes, capacity
included, measured at every prefill chunk and decoded token), the perplexity
of the prompt predicted through the cache and how often its top token is
float16's, peak memory and prefill/decode tokens/s; then what veloxquant's
float16 windows hold, a PNG of KV memory against tokens and of tokens/s, and
a summary paragraph.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, List, Optional

DEFAULT_TOKENS = 2600
DEFAULT_QUESTION = "In two sentences, what happens to Alice in the story above?"
TEXT_NAME = "Alice's Adventures in Wonderland (Lewis Carroll, 1865; shipped in veloxquant/data/alice.txt)"
LABELS = {"fp16": "float16 (mlx_lm)", "mlx-quantized": "mlx_lm 4-bit", "veloxquant": "veloxquant"}


def prompt_ids(tokenizer, prompt: str, chat: bool) -> List[int]:
    if chat and tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def default_prompt(tokenizer, tokens: int, chat: bool) -> str:
    """The shipped text's first paragraphs and :data:`DEFAULT_QUESTION`, at most ``tokens`` prompt tokens."""
    from .texts import alice, leading_tokens

    overhead = len(prompt_ids(tokenizer, "\n\n" + DEFAULT_QUESTION, chat)) + 2
    text = leading_tokens(alice(), tokenizer.encode, max(tokens - overhead, 1))
    return text + "\n\n" + DEFAULT_QUESTION


class Progress:
    """One bar per cache over prompt and generated tokens: tqdm when installed, else a counter on stderr."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.done, self.bar = label, total, 0, None
        self.enabled = enabled
        self.t0 = time.perf_counter()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            self.bar = tqdm(total=total, desc=f"[veloxquant] {label}", unit="tok", file=sys.stderr, leave=True,
                            dynamic_ncols=True, mininterval=1.0)

    def to(self, done: int, phase: str) -> None:
        done = min(done, self.total)
        if not self.enabled or done <= self.done:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(phase, refresh=False)
            self.bar.update(done - self.done)
        else:
            end = "\n" if done >= self.total else ""
            print(f"\r[veloxquant] {self.label}: {phase} {done}/{self.total} tokens, "
                  f"{time.perf_counter() - self.t0:.0f} s", end=end, file=sys.stderr, flush=True)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and 0 < self.done < self.total:
            print(file=sys.stderr, flush=True)


def held_tokens(cache) -> int:
    return max((int(getattr(c, "offset", 0) or 0) for c in cache), default=0)


def warm_up(model, make_cache, ids: List[int]) -> None:
    """Two prefill chunks and a decode step through a throwaway cache, so that
    nothing starts up (threads, buffers, kernels) inside the timed run."""
    import mlx.core as mx

    x = mx.array(ids[:80])[None]
    cache = make_cache()
    for a, b in ((0, 64), (64, 79), (79, 80)):
        model(x[:, a:b], cache=cache)
        mx.eval([c.state for c in cache])


def run_one(model, tokenizer, ids: List[int], make_cache: Callable, kind: str, max_tokens: int,
            prefill_step_size: int, progress: bool, nbytes: Callable, reference_top1=None):
    """Prefill in chunks as mlx_lm's ``generate_step`` does, scoring the prompt's
    tokens after the first chunk (teacher forcing: each prediction attends to
    the cache's history), then greedy decoding through ``stream_generate``.

    Prefill time counts the chunks' forward passes and cache updates (what
    mlx_lm's prefill evaluates), not the scoring. ``reference_top1`` (the
    float16 run's predictions) gives the top-1 agreement. Returns the row and
    the cache.
    """
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    if len(ids) > 80:
        warm_up(model, make_cache, ids)
    cache = make_cache()

    bar = Progress(kind, len(ids) + max_tokens, progress)
    curve = []  # (tokens the cache holds, bytes): after every prefill chunk and decoded token

    def record():
        n = held_tokens(cache)
        if n and (not curve or curve[-1][0] != n):
            curve.append((n, nbytes(cache)))

    mx.clear_cache()
    mx.reset_peak_memory()
    x = mx.array(ids)
    pos, prefill_s, nll, top1 = 0, 0.0, 0.0, []
    text, last = "", None
    try:
        while len(ids) - pos > 1:
            n = min(prefill_step_size, len(ids) - 1 - pos)
            t0 = time.perf_counter()
            logits = model(x[None, pos : pos + n], cache=cache)
            mx.eval([c.state for c in cache])
            prefill_s += time.perf_counter() - t0
            if pos > 0:
                lg = logits[0].astype(mx.float32)
                lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
                chunk_nll = -mx.take_along_axis(lp, x[pos + 1 : pos + n + 1, None], axis=-1).sum()
                chunk_top1 = mx.argmax(lg, axis=-1)
                mx.eval(chunk_nll, chunk_top1)
                nll += chunk_nll.item()
                top1.append(chunk_top1)
            del logits
            pos += n
            record()
            bar.to(pos, "prefill")
            mx.clear_cache()
        for r in stream_generate(model, tokenizer, x[pos:], max_tokens=max_tokens, prompt_cache=cache):
            if last is None:  # the last prompt token and the first new one
                prefill_s += r.prompt_tokens / r.prompt_tps
            text += r.text
            last = r
            record()
            bar.to(len(ids) + r.generation_tokens, "decode")
    finally:
        bar.close()
    top1 = mx.concatenate(top1) if top1 else mx.array([], dtype=mx.uint32)
    scored = int(top1.size)
    agree = None
    if reference_top1 is not None and scored and reference_top1.size == scored:
        agree = (top1 == reference_top1).astype(mx.float32).mean().item()
    return {
        "cache": kind,
        "text": text,
        "prompt_tokens": len(ids),
        "generated_tokens": last.generation_tokens,
        "prefill_tps": len(ids) / prefill_s,
        "decode_tps": last.generation_tps,
        "kv_bytes": nbytes(cache),
        "tokens_held": held_tokens(cache),
        "peak_memory_bytes": mx.get_peak_memory(),
        "scored_tokens": scored,
        "perplexity": float(math.exp(nll / scored)) if scored else float("nan"),
        "top1_vs_fp16": agree,
        "top1": top1,
        "curve": curve,
    }, cache


def windows_line(cache, config) -> Optional[str]:
    """What the float16 windows of veloxquant's layers hold, from the first compressed layer."""
    from ..cache import VeloxQuantCache

    layer = next((c for c in cache if isinstance(c, VeloxQuantCache) and c.layer is not None), None)
    if layer is None:
        return None
    total, compressed = layer.offset, int(layer.layer.compressed_tokens)
    sinks = min(config.sinks, total)
    recent = total - compressed - sinks
    return (
        f"veloxquant's float16 windows hold the first {sinks} tokens (sinks) and the last {recent} "
        f"(window {config.window}: the newest tokens, compressed in blocks once past it): "
        f"{sinks + recent:,} of {total:,} tokens; the other {compressed:,} are held as "
        f"{config.key_bits}-bit {config.key_method} keys and {config.value_bits}-bit {config.value_method} values."
    )


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def format_table(rows: List[dict]) -> str:
    base_row = next((r for r in rows if r["cache"] == "fp16"), rows[0])
    base = base_row["kv_bytes"] or 1
    head = ["cache", "KV bytes held", f"vs {base_row['cache']}", "perplexity", "top-1 = fp16", "peak memory",
            "prefill tok/s", "decode tok/s", "tokens"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = "1x" if r is base_row else f"{base / r['kv_bytes']:.2f}x smaller" if r["kv_bytes"] else "-"
        agree = "-" if r.get("top1_vs_fp16") is None else f"{100 * r['top1_vs_fp16']:.1f}%"
        out.append(
            f"| {r['cache']} | {r['kv_bytes']:,} ({_mb(r['kv_bytes'])}) | {ratio} | "
            f"{r['perplexity']:.3f} | {agree} | {r['peak_memory_bytes'] / 1e9:.3f} GB | {r['prefill_tps']:.1f} | "
            f"{r['decode_tps']:.1f} | {r['prompt_tokens']}+{r['generated_tokens']} |"
        )
    scored = rows[0].get("scored_tokens", 0)
    out.append("")
    out.append(
        f"Perplexity: of the prompt's last {scored:,} tokens, each predicted with the cache holding the text "
        f"before it (teacher forcing, the first chunk left out); top-1 = fp16: how often the most likely next "
        f"token is float16's. KV bytes: the arrays each cache holds, capacity included (cache_nbytes)."
    )
    return "\n".join(out)


def summary(rows: List[dict], compute: str, plot: Optional[str]) -> str:
    by = {r["cache"]: r for r in rows}
    base = by.get("fp16", rows[0])
    tokens = base["tokens_held"]
    others = [r for r in rows if r is not base]
    name = lambda r: LABELS.get(r["cache"], r["cache"])  # noqa: E731
    parts = [f"Summary. After {tokens:,} tokens ({base['prompt_tokens']:,} of prompt, the rest generated) "
             f"the {name(base)} cache held {_mb(base['kv_bytes'])}"]
    if others:
        parts[0] += "; " + ", ".join(
            f"{name(r)} {_mb(r['kv_bytes'])} ({base['kv_bytes'] / r['kv_bytes']:.2f}x smaller)"
            for r in others if r["kv_bytes"]
        )
    parts[0] += "."
    if others and base.get("scored_tokens"):
        parts.append(
            f"Predicting the prompt's tokens from those caches, perplexity went from {base['perplexity']:.2f} "
            "(float16) to " + ", ".join(
                f"{r['perplexity']:.2f} ({100 * (r['perplexity'] / base['perplexity'] - 1):+.1f}%, {name(r)}"
                + (f", top-1 as float16's {100 * r['top1_vs_fp16']:.0f}% of the time" if r.get("top1_vs_fp16") is not None else "")
                + ")"
                for r in others
            ) + "."
        )
    parts.append(
        "Prefill ran at " + ", ".join(f"{r['prefill_tps']:.0f}" for r in rows)
        + " tokens/s and decoding at " + ", ".join(f"{r['decode_tps']:.1f}" for r in rows)
        + f" tokens/s ({', '.join(r['cache'] for r in rows)}) on {compute}."
    )
    if "veloxquant" in by:
        parts.append(
            "veloxquant's float16 windows are a fixed cost of a few hundred tokens, so its ratio to float16 "
            "grows with the context (in steps, as its stores grow); over a few hundred tokens it saves little."
        )
    if others:
        same = all(r["text"] == base["text"] for r in others)
        parts.append("The generated texts are identical." if same
                     else "The generated texts differ (greedy decoding follows any change in the top token).")
    if plot:
        parts.append(f"{plot} plots each cache's measured KV bytes against tokens, and the speeds.")
    return " ".join(parts)


def plot(rows: List[dict], path: str, title: str) -> None:
    """KV bytes against tokens (the measured curve of every cache), prefill and decode tokens/s."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r for r in rows if r["cache"] == "fp16"), rows[0])
    fig = plt.figure(figsize=(12, 5.4))
    grid = fig.add_gridspec(2, 2, width_ratios=[3, 2], hspace=0.55, wspace=0.25)
    ax = fig.add_subplot(grid[:, 0])
    colors = {}
    for r in rows:
        label = LABELS.get(r["cache"], r["cache"])
        if r is not base and r["kv_bytes"]:
            label += f": {base['kv_bytes'] / r['kv_bytes']:.2f}x smaller"
            if base.get("perplexity") and r.get("perplexity") == r.get("perplexity"):
                label += f", perplexity {100 * (r['perplexity'] / base['perplexity'] - 1):+.1f}%"
        xs = [0] + [n for n, _ in r["curve"]]
        ys = [0] + [b / 1e6 for _, b in r["curve"]]
        (line,) = ax.plot(xs, ys, marker=".", markersize=3, linewidth=1.5, label=label)
        colors[r["cache"]] = line.get_color()
    ax.set_xlabel("tokens in the cache")
    ax.set_ylabel("KV cache: bytes of the arrays MLX holds (MB)")
    ax.set_title("KV memory, measured after every prefill chunk and decoded token", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="upper left")
    names = [LABELS.get(r["cache"], r["cache"]) for r in rows]
    for i, (key, what) in enumerate((("prefill_tps", "prefill"), ("decode_tps", "decode"))):
        bx = fig.add_subplot(grid[i, 1])
        vals = [r[key] for r in rows]
        bars = bx.bar(range(len(rows)), vals, color=[colors[r["cache"]] for r in rows])
        bx.bar_label(bars, labels=[f"{v:.1f}" for v in vals], fontsize=8)
        bx.set_xticks(range(len(rows)))
        bx.set_xticklabels(names, fontsize=8)
        bx.set_ylabel("tokens/s", fontsize=9)
        bx.set_ylim(0, max(vals) * 1.2 if vals and max(vals) > 0 else 1)
        bx.set_title(f"{what} speed", fontsize=10)
    fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
