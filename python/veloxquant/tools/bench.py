"""End-to-end generation speed with each KV cache: prefill time, decode
tokens/s, KV bytes and peak memory of an mlx_lm model.

    veloxquant bench [--shape tiny|llama-1b|llama-8b | --model PATH|default]
        [--contexts 4096,32768] [--batch 1,8] [--caches fp16,mlx-q4,mlx-q8,veloxquant]
        [--recipe k4v3] [--repeat N] [--memory-budget GiB] [--out-jsonl F] [--out-md F] [--plot F.png]

Named shapes are Llama models with random float16 weights (the speed does not
depend on the values). Every configuration (model, context, batch, cache)
runs in a fresh subprocess, so that one running out of memory, crashing or
passing ``--timeout`` becomes a row with an error instead of ending the run.

Caches: ``fp16`` (mlx_lm's own), ``mlx-qB`` (mlx_lm's affine
QuantizedKVCache, B = 2, 3, 4, 5, 6, 8 bits, group 64), ``veloxquant`` (the
``--recipe``) and ``veloxquant:RECIPE`` (``--recipe`` with RECIPE's parts
replacing its own). A recipe is parts joined by ``:``: a method for keys and
values (``mse``, ``kivi``, ``pq``, ``qjl``, ``prod``, ``rvq``, ``fp16``, or
``KEYS/VALUES``), ``kKvV`` bits (``k4`` alone: values as keys), ``wN`` float16
window, ``sN`` sinks, and ``auto``/``require``/``off`` (the kernel policy).
Example: ``veloxquant:kivi:k4v4:w32``.

A worker warms up (a prefill of two chunks and ``--warmup`` decode steps
with a throwaway cache, so that every kernel is compiled), then times the prompt as mlx_lm's ``generate_step``
processes it (chunks of ``--prefill-step-size`` tokens, each evaluated; the
last token through the whole model) and ``--decode-tokens`` greedy steps, the
next step's graph built while the current one runs, as mlx_lm does.

``--repeat N`` runs every configuration N times, round by round, and reports
each one's median prefill time and decode speed (the runs in the JSON lines):
the host of a GPU machine can drift by tens of percent between processes.

``--prefill-batch K`` prefills a batch K sequences at a time, each group in
its own cache, and joins the groups into the batch that decodes: a batch of
the size a memory budget allows, without one prefill's transient memory for
all of it (the prefill time includes the joins).

``--memory-budget GiB`` adds a capacity table: for each shape, context and
cache, the most sequences that fit the budget as a server holds them (many
decoding, one being prefilled), estimated from the largest batch measured:
the weights, one sequence's share of the prefill's transient memory, and
each sequence's share of the decode peak.

Under ``mlx.launch -n N`` every rank runs the same plan; each configuration's
workers (one per rank, in the ranks' own subprocesses) form the group and
split the model (``--parallel tensor``: heads, or ``pipeline``: layers, as
``generate``). Rank 0 alone reports; KV MiB and peak GiB are rank 0's, and
``kv_bytes_total`` sums the KV bytes over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

from .. import distributed
from .._native import CACHE_METHOD_ALIASES, CACHE_METHODS

_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                "rope_type": "llama3"}
SHAPES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=1024),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, max_position_embeddings=131072,
                     rope_scaling={"factor": 32.0, **_LLAMA3_ROPE}),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                     rope_theta=500000.0, max_position_embeddings=131072,
                     rope_scaling={"factor": 8.0, **_LLAMA3_ROPE}),
}
DEFAULT_CACHES = "fp16,mlx-q4,mlx-q8,veloxquant"
MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZE = 64
# Every name a recipe's method may take (the crate's names and aliases) -> the method's name.
METHODS = {**{m: m for m in CACHE_METHODS}, **CACHE_METHOD_ALIASES}
POLICIES = ("auto", "require", "off")
RECIPE_HELP = (f"parts joined by ':' from a method ({', '.join(CACHE_METHODS)}, or another name: "
               f"{', '.join(CACHE_METHOD_ALIASES)}; KEYS/VALUES for a pair), "
               "kKvV bits, wN window, "
               f"sN sinks, gN KIVI key group, {'/'.join(POLICIES)}, query (KIVI keys' bits per channel from the "
               "queries)")
CACHE_HELP = f"fp16, mlx-q{{{','.join(map(str, MLX_BITS))}}}, veloxquant, veloxquant:RECIPE (RECIPE: {RECIPE_HELP})"
SEED = 0
RESULT_MARK = "VELOXQUANT_BENCH_ROW "  # prefixes the worker's result line on stdout
# How Python, MLX's allocators (CPU, Metal, CUDA) and C++ report exhausted memory.
OUT_OF_MEMORY = re.compile(r"out ?of ?memory|insufficient memory|MemoryError|cudaErrorMemoryAllocation|bad_alloc",
                           re.IGNORECASE)


# --- cache names and recipes ---------------------------------------------------


def parse_recipe(text: str) -> Dict[str, Any]:
    """``'kivi:k4v4:w32'`` -> KVConfig keyword arguments (only those the text sets); ``query`` (or
    ``uniform``) sets KIVI keys' bits per channel (``key_channel_bits``)."""
    from ..cache import KEY_CHANNEL_BITS

    out: Dict[str, Any] = {}
    for part in filter(None, text.split(":")):
        bits = re.fullmatch(r"k(\d+)(?:v(\d+))?", part)
        count = re.fullmatch(r"([wsg])(\d+)", part)
        if bits:
            out["key_bits"] = int(bits[1])
            out["value_bits"] = int(bits[2]) if bits[2] else None
        elif count:
            out[{"w": "window", "s": "sinks", "g": "key_group"}[count[1]]] = int(count[2])
        elif part in POLICIES:
            out["policy"] = part
        elif part in KEY_CHANNEL_BITS:
            out["key_channel_bits"] = part
        elif all(m in METHODS for m in part.split("/")) and part.count("/") <= 1:
            keys, _, values = part.partition("/")
            out["key_method"] = METHODS[keys]
            out["value_method"] = METHODS[values] if values else None
        else:
            raise ValueError(f"unknown recipe part {part!r}")
    return out


def recipe_config(base: str, variant: str):
    """The KVConfig of ``--recipe`` with ``variant``'s parts replacing its own, checked."""
    from ..cache import KVConfig

    settings = parse_recipe(base)
    settings.update(parse_recipe(variant))
    return KVConfig(**settings).check()


def parse_cache(name: str, recipe: str) -> Dict[str, Any]:
    """One ``--caches`` entry -> what a worker needs to build that cache."""
    if name == "fp16":
        return {"name": name, "kind": "fp16", "recipe": None}
    mlx_q = re.fullmatch(r"mlx-q(\d+)", name)
    if mlx_q and int(mlx_q[1]) in MLX_BITS:
        return {"name": name, "kind": "mlx-quantized",
                "recipe": {"bits": int(mlx_q[1]), "group_size": MLX_GROUP_SIZE}}
    if name == "veloxquant" or name.startswith("veloxquant:"):
        cfg = recipe_config(recipe, name[len("veloxquant"):])
        return {"name": name, "kind": "veloxquant", "recipe": cfg.settings(), "config": cfg.to_json()}
    raise ValueError(f"unknown cache {name!r}")


# --- the worker: one configuration ---------------------------------------------


def build_model(job: Dict[str, Any]):
    """The named shape with random float16 weights (norms one), or the model at job['model']."""
    import mlx.core as mx

    if job.get("model"):
        from . import models

        model, _ = models.load(job["model"])
        return model
    from mlx.utils import tree_map_with_path
    from mlx_lm.models.llama import Model, ModelArgs

    model = Model(ModelArgs(model_type="llama", rms_norm_eps=1e-5, **SHAPES[job["shape"]]))
    mx.random.seed(SEED)

    # The constructor's float32 initialisation is lazy and replaced here before
    # anything is evaluated, so an 8B model never materialises in float32.
    def init(path, p):
        if path.endswith("norm.weight"):
            return mx.ones(p.shape, dtype=mx.float16)
        return mx.random.normal(p.shape, dtype=mx.float16) * 0.02

    model.update(tree_map_with_path(init, model.parameters()))
    mx.eval(model.parameters())
    return model


def make_cache(model, spec: Dict[str, Any]) -> List[Any]:
    from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

    from ..cache import KVConfig, make_mlx_quantized_cache, make_prompt_cache

    if spec["kind"] == "fp16":
        return mlx_prompt_cache(model)
    if spec["kind"] == "mlx-quantized":
        return make_mlx_quantized_cache(model, spec["recipe"]["bits"], spec["recipe"]["group_size"])
    return make_prompt_cache(model, KVConfig.from_json(spec["config"]))


def prefill(model, cache, tokens, step: int):
    """Run the prompt as mlx_lm's generate_step does; returns the first generated token, evaluated.

    Every chunk but the last token goes through the model, and only every
    cache's state is evaluated after each chunk, as mlx_lm's generate_step
    does: what the states need is computed (not the last layer's output),
    in the order they need it.
    """
    import mlx.core as mx

    n, done = tokens.shape[1], 0
    while n - done > 1:
        k = min(step, n - 1 - done)
        model(tokens[:, done:done + k], cache=cache)
        mx.eval([c.state for c in cache])
        done += k
        mx.clear_cache()
    y = mx.argmax(model(tokens[:, done:], cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    return y


def decode(model, cache, y, steps: int):
    """``steps`` greedy tokens; each step's graph is built while the previous one runs."""
    import mlx.core as mx

    for _ in range(steps):
        next_y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.async_eval(next_y)
        y.tolist()  # a generation loop reads every token
        y = next_y
    mx.eval(y)
    return y


def prefill_groups(model, spec: Dict[str, Any], tokens, step: int, group: Optional[int]):
    """A cache of the prompts ``tokens`` ``[B, T]`` and their first tokens:
    prefilled ``group`` rows at a time, each group with its own cache, then
    joined layer by layer into one batch (as a server admits sequences a few
    at a time); with ``group`` None or at least B, all rows at once."""
    import mlx.core as mx

    batch = tokens.shape[0]
    if group is None or group >= batch:
        cache = make_cache(model, spec)
        return cache, prefill(model, cache, tokens, step)
    if spec["kind"] not in ("fp16", "veloxquant"):
        raise ValueError(f"--prefill-batch joins fp16 and veloxquant caches, not {spec['name']}")
    parts, ys = [], []
    for lo in range(0, batch, group):
        cache = make_cache(model, spec)
        ys.append(prefill(model, cache, tokens[lo:lo + group], step))
        parts.append(cache)
    return join_caches(parts), mx.concatenate(ys)


def join_caches(parts: List[List[Any]]) -> List[Any]:
    """Each layer's caches of ``parts`` (one list of layers a group of
    sequences of one length) as one cache of all their rows; a layer's parts
    are freed once its joined cache is evaluated, so that the join holds one
    layer twice at most."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from ..cache import VeloxQuantCache

    joined = []
    for i in range(len(parts[0])):
        layer = [p[i] for p in parts]
        if all(isinstance(c, VeloxQuantCache) for c in layer):
            c = VeloxQuantCache.concat(layer)
            mx.eval(c.state)
        elif all(type(c) is KVCache for c in layer):
            held = [x.keys_and_values() for x in layer]
            k, v = (mx.concatenate([h[j] for h in held], axis=0) for j in range(2))
            c = KVCache()
            c.state = (k, v, k.shape[2])
            mx.eval(k, v)
        else:
            raise ValueError(f"layer {i}: cannot join caches of types {sorted({type(c).__name__ for c in layer})}")
        for p in parts:
            p[i] = None
        joined.append(c)
    return joined


def device_fields() -> Dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    from .. import __version__

    dev = mx.default_device()
    try:
        name = mx.device_info(dev).get("device_name")
    except Exception:  # a back-end without device information
        name = None
    return {"device": "gpu" if dev.type == mx.gpu else "cpu", "device_name": name, "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__, "veloxquant": __version__}


def run_worker(job: Dict[str, Any]) -> Dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..cache import VeloxQuantCache, cache_nbytes

    if job.get("device"):
        mx.set_default_device(mx.gpu if job["device"] == "gpu" else mx.cpu)
    row = device_fields()
    try:
        # Under mlx.launch this worker joins the group its parent left alone.
        group = distributed.group() if distributed.launched_rank() is not None else None
        row["ranks"] = 1 if group is None else group.size()
        model = build_model(job)
        if group is not None:
            distributed.shard_model(model, group, job.get("parallel", "tensor"))
        # As generate, compare and eval: float32 compute where the CPU has a fast BLAS.
        from .. import blas

        row["compute"] = blas.maybe_float32_compute(model) or "the model's dtype"
        vocab = model.args.vocab_size
        tokens = mx.random.randint(0, vocab, (job["batch"], job["context"]), key=mx.random.key(SEED))
        step = job["prefill_step_size"]
        if job["warmup"] > 0:  # compile kernels and fill MLX's buffer cache before timing
            # Two chunks and the last token: the second chunk attends over a
            # history, as every later one does, and a compressed cache flushes.
            warm, y = prefill_groups(model, job["cache"], tokens[:, : min(job["context"], 2 * step + 1)], step,
                                     job.get("prefill_batch"))
            decode(model, warm, y, job["warmup"])
            del warm, y
        mx.clear_cache()
        mx.reset_peak_memory()
        mx.synchronize()
        t0 = time.perf_counter()
        cache, y = prefill_groups(model, job["cache"], tokens, step, job.get("prefill_batch"))
        mx.synchronize()
        t1 = time.perf_counter()
        prefill_peak, prefill_kv = mx.get_peak_memory(), cache_nbytes(cache)
        mx.reset_peak_memory()
        decode(model, cache, y, job["decode_tokens"])
        mx.synchronize()
        t2 = time.perf_counter()
        decode_peak = mx.get_peak_memory()
    except Exception as e:
        return {**row, "error": describe_failure(f"{type(e).__name__}: {e}")}
    compressed = [c.layer.compressed_tokens for c in cache if isinstance(c, VeloxQuantCache) and c.layer]
    tokens_done = job["batch"] * job["decode_tokens"]
    kv = cache_nbytes(cache)
    kv_total = kv if group is None else distributed.total_nbytes(kv, group)
    return {
        **row,
        "prefill_s": t1 - t0,
        "prefill_tok_s": job["batch"] * job["context"] / (t1 - t0),
        "decode_s": t2 - t1,
        "decode_tok_s": tokens_done / (t2 - t1),
        "decode_tok_s_per_seq": job["decode_tokens"] / (t2 - t1),
        "kv_bytes": kv,
        "kv_bytes_total": kv_total,
        "compressed_tokens": compressed[0] if compressed else None,
        "peak_bytes": max(prefill_peak, decode_peak),
        "prefill_peak_bytes": prefill_peak,
        "prefill_kv_bytes": prefill_kv,
        "decode_peak_bytes": decode_peak,
        "model_bytes": sum(p.nbytes for _, p in tree_flatten(model.parameters())),
        "error": None,
    }


def describe_failure(text: str) -> str:
    """An error's first line, or "out of memory" when that is what the text says."""
    if OUT_OF_MEMORY.search(text):
        return "out of memory"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else "failed without a message"


# --- the parent: plan, run, report -----------------------------------------------


def run_job(job: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "veloxquant.tools.bench", "--worker", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    if proc.returncode < 0:
        sig = -proc.returncode
        return {"error": f"killed by signal {sig}" + (" (out of memory?)" if sig == 9 else "")}
    if OUT_OF_MEMORY.search(proc.stderr):
        return {"error": "out of memory"}
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return {"error": f"exit code {proc.returncode}: {tail[-1].strip() if tail else 'no message'}"}


def combine_runs(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One configuration's repeated runs as one row: the median prefill time
    and decode speed (each run's in ``*_runs``), the largest peaks; the first
    failure if any run failed."""
    failed = [r for r in results if r.get("error")]
    if failed:
        return {**failed[0], "repeats": len(results)}
    row = dict(results[-1])
    if len(results) == 1:
        return row
    for key in ("prefill_s", "prefill_tok_s", "decode_s", "decode_tok_s", "decode_tok_s_per_seq"):
        if all(r.get(key) is not None for r in results):
            row[key] = statistics.median(r[key] for r in results)
    for key in ("peak_bytes", "prefill_peak_bytes", "decode_peak_bytes"):
        if all(r.get(key) is not None for r in results):
            row[key] = max(r[key] for r in results)
    row["repeats"] = len(results)
    row["prefill_s_runs"] = [r["prefill_s"] for r in results]
    row["decode_tok_s_runs"] = [r["decode_tok_s"] for r in results]
    return row


def _int_list(parser, option: str, text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{option}: expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{option}: expected positive integers, got {text!r}")
    return values


def plan(args, parser) -> List[Dict[str, Any]]:
    """The configurations to run, in order; bad arguments exit with status 2."""
    contexts = _int_list(parser, "--contexts", args.contexts)
    batches = _int_list(parser, "--batch", args.batch)
    for option, value, least in (("--decode-tokens", args.decode_tokens, 1), ("--prefill-step-size",
                                 args.prefill_step_size, 1), ("--warmup", args.warmup, 0),
                                 ("--prefill-batch", 1 if args.prefill_batch is None else args.prefill_batch, 1)):
        if value < least:
            parser.error(f"{option} must be >= {least}, got {value}")
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    try:
        recipe_config(args.recipe, "")
    except ValueError as e:
        parser.error(f"--recipe {args.recipe!r}: {e}; a recipe is {RECIPE_HELP}")
    caches = []
    for name in [c.strip() for c in args.caches.split(",") if c.strip()] or [""]:
        try:
            caches.append(parse_cache(name, args.recipe))
        except ValueError as e:
            parser.error(f"--caches: {e}; allowed: {CACHE_HELP}")
    if args.device == "gpu":
        import mlx.core as mx

        if not mx.is_available(mx.gpu):
            parser.error("--device gpu: this MLX build has no GPU back-end")
    model = None
    if args.model is not None:
        from . import models

        try:
            model = models.resolve_model(args.model)  # converts the default model once, not per worker
        except ValueError as e:
            parser.error(f"--model: {e}")
        if os.path.isabs(model) or os.path.exists(model):
            model = os.path.abspath(model)
    if model is None:
        shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
        unknown = [s for s in shapes if s not in SHAPES]
        if unknown or not shapes:
            parser.error(f"--shape: unknown {unknown or 'empty list'}; allowed: {', '.join(sorted(SHAPES))}")
    else:
        shapes = [os.path.basename(model.rstrip("/"))]
    common = {"model": model, "decode_tokens": args.decode_tokens, "warmup": args.warmup,
              "prefill_step_size": args.prefill_step_size, "device": args.device, "parallel": args.parallel,
              "prefill_batch": args.prefill_batch}
    return [{**common, "shape": shape, "context": ctx, "batch": b, "cache": c}
            for shape in shapes for ctx in contexts for b in batches for c in caches]


def _ratio(value, base) -> str:
    return f"{value / base:.2f}x" if value and base else "—"


def markdown_table(rows: List[Dict[str, Any]]) -> str:
    """One line per configuration; speed ratios to the fp16 row of the same shape, context and batch."""
    fp16 = {(r["shape"], r["context"], r["batch"]): r for r in rows if r["cache"] == "fp16" and not r["error"]}
    ranks = max((r.get("ranks") or 1 for r in rows), default=1)
    kv_head = ["KV MiB"] if ranks == 1 else ["KV MiB rank 0", f"KV MiB, {ranks} ranks"]
    head = ["shape", "context", "batch", "cache", "prefill s", "prefill speed vs fp16", "decode tok/s",
            "decode speed vs fp16", *kv_head, "peak GiB", "error"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = fp16.get((r["shape"], r["context"], r["batch"]), {})
        if r["error"]:
            cells = ["—"] * (5 + len(kv_head)) + [r["error"]]
        else:
            kv = [f"{r['kv_bytes'] / 2**20:.2f}"]
            if ranks > 1:
                kv.append(f"{(r.get('kv_bytes_total') or r['kv_bytes']) / 2**20:.2f}")
            cells = [f"{r['prefill_s']:.3f}", _ratio(base.get("prefill_s"), r["prefill_s"]),
                     f"{r['decode_tok_s']:.1f}", _ratio(r["decode_tok_s"], base.get("decode_tok_s")),
                     *kv, f"{r['peak_bytes'] / 2**30:.3f}", ""]
        out.append("| " + " | ".join([r["shape"], str(r["context"]), str(r["batch"]), r["cache"]] + cells) + " |")
    return "\n".join(out)


def capacity_table(rows: List[Dict[str, Any]], budget_gib: float) -> str:
    """The most sequences that fit ``budget_gib`` per (shape, context, cache),
    as a server holds them: the weights once, one sequence being prefilled
    (its share of the prefill's transient memory: the largest batch's
    prefill peak less the weights and the KV cache, per sequence) and every
    sequence's share of the decode peak (KV cache and decode activations).
    Rows from before the decode peak was recorded take the whole peak per
    sequence (prefill transients included)."""
    budget = budget_gib * 2**30
    largest: Dict[Any, Dict[str, Any]] = {}
    for r in rows:
        if r["error"] or not r.get("peak_bytes") or r.get("model_bytes") is None:
            continue
        key = (r["shape"], r["context"], r["cache"])
        if key not in largest or r["batch"] > largest[key]["batch"]:
            largest[key] = r
    fits = {}
    for key, r in largest.items():
        model, batch = r["model_bytes"], r["batch"]
        if r.get("decode_peak_bytes") is not None:
            per_sequence = max(r["decode_peak_bytes"] - model, 1) / batch
            # A batch prefilled a group at a time holds one group's transients.
            group = min(r.get("prefill_batch") or batch, batch)
            prefill = max(r["prefill_peak_bytes"] - model - r["prefill_kv_bytes"], 0) / group
        else:
            per_sequence, prefill = max(r["peak_bytes"] - model, 1) / batch, 0.0
        fits[key] = (max(0, int((budget - model - prefill) // per_sequence)), per_sequence, prefill, batch)
    head = ["shape", "context", "cache", f"sequences in {budget_gib:g} GiB", "vs fp16", "GiB per sequence",
            "GiB to prefill one", "measured at batch"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (shape, context, cache), (n, per_sequence, prefill, batch) in fits.items():
        base = fits.get((shape, context, "fp16"), (None,))[0]
        cells = [shape, str(context), cache, str(n), _ratio(n, base), f"{per_sequence / 2**30:.3f}",
                 f"{prefill / 2**30:.3f}", str(batch)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    """Decode tok/s and peak memory against context, one line per cache, a row of panels per shape and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["shape"], r["batch"]) for r in rows))
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4.2 * len(groups)), squeeze=False)
    device = next((f"{r['device_name']} ({r['device']})" for r in rows if r.get("device_name")), "unknown device")
    for (shape, batch), (ax_speed, ax_mem) in zip(groups, axes):
        for cache in dict.fromkeys(r["cache"] for r in rows):
            ok = sorted((r["context"], r) for r in rows if (r["shape"], r["batch"], r["cache"]) == (shape, batch, cache)
                        and not r["error"])
            if ok:
                ctx = [c for c, _ in ok]
                ax_speed.plot(ctx, [r["decode_tok_s"] for _, r in ok], marker="o", label=cache)
                ax_mem.plot(ctx, [r["peak_bytes"] / 2**30 for _, r in ok], marker="o", label=cache)
        contexts = sorted({r["context"] for r in rows})
        for ax, what, unit in ((ax_speed, "decode", "decode tokens/s (all sequences)"),
                               (ax_mem, "peak memory", "peak memory (GiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
            ax.minorticks_off()
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(unit)
            ax.set_title(f"{shape}, batch {batch}: {what}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.suptitle(f"veloxquant bench on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _progress_bar(total: int):
    """A tqdm bar on stderr when tqdm is installed, else None (a plain line per configuration)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="config", file=sys.stderr, dynamic_ncols=True)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="veloxquant bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--shape", default="llama-8b",
                       help=f"Llama shapes with random float16 weights, comma-separated, from {', '.join(sorted(SHAPES))} "
                       "(default: llama-8b)")
    which.add_argument("--model", default=None, help="an mlx_lm model path instead, or 'default' (SmolLM2-135M)")
    p.add_argument("--contexts", default="4096,32768", help="prompt lengths, comma-separated (default: 4096,32768)")
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (default: 1,8)")
    p.add_argument("--caches", default=DEFAULT_CACHES, help=f"comma-separated, from {CACHE_HELP} (default: {DEFAULT_CACHES})")
    p.add_argument("--recipe", default="k4v3", help="the veloxquant recipe (default: k4v3, TurboQuant-MSE keys 4 bits, "
                   "values 3 bits, window 128, sinks 4)")
    p.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens timed after the prompt (default: 64)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt chunk (default: 2048, as mlx_lm)")
    p.add_argument("--prefill-batch", type=int, default=None, metavar="K",
                   help="prefill K sequences at a time, each group in its own cache, then join them into the batch "
                   "that decodes (fp16 and veloxquant caches; default: the whole batch at once)")
    p.add_argument("--warmup", type=int, default=4, help="decode steps of the warm-up, 0 for none (default: 4)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per configuration run (default: 1800)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each configuration, round by round; the table "
                   "takes each one's median prefill time and decode speed (default: 1)")
    p.add_argument("--device", choices=("cpu", "gpu"), default=None, help="MLX device (default: MLX's default)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GiB",
                   help="also report the most sequences that fit this memory (weights included), per cache")
    p.add_argument("--out-jsonl", default=None, help="write one JSON object per configuration")
    p.add_argument("--out-md", default=None, help="write the markdown table")
    p.add_argument("--plot", default=None, help="write a PNG: decode tok/s and peak memory against context")
    p.add_argument("--from-jsonl", default=None, metavar="PATH",
                   help="run nothing: print, --out-md and --plot the rows of an earlier --out-jsonl")
    p.add_argument("--parallel", choices=distributed.PARALLEL, default="tensor",
                   help="under mlx.launch -n N: split heads (tensor) or layers (pipeline) across the ranks "
                   "(default: tensor)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.memory_budget is not None and not args.memory_budget > 0:
        parser.error(f"--memory-budget must be > 0 GiB, got {args.memory_budget}")
    if args.worker is not None:
        print(RESULT_MARK + json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return 0
    if args.from_jsonl is not None:
        try:
            with open(args.from_jsonl) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError) as e:
            parser.error(f"--from-jsonl {args.from_jsonl}: {e}")
        if not rows:
            parser.error(f"--from-jsonl {args.from_jsonl}: no rows")
        report(rows, args, rows[0].get("command", "veloxquant bench"))
        return 0
    jobs = plan(args, parser)
    command = "veloxquant bench " + shlex.join(argv)
    rows: List[Dict[str, Any]] = []
    # Under mlx.launch the other ranks run the same workers and stay silent.
    main_rank = (distributed.launched_rank() or 0) == 0
    jsonl = open(args.out_jsonl, "w") if args.out_jsonl and main_rank else None
    # Repeats run round by round (every configuration once, then again), so
    # that a drift of the machine between processes falls on every cache alike.
    order = [(rep, i) for rep in range(args.repeat) for i in range(len(jobs))]
    runs: List[List[Dict[str, Any]]] = [[] for _ in jobs]
    bar = _progress_bar(len(order)) if main_rank else None
    try:
        for n, (rep, i) in enumerate(order):
            job = jobs[i]
            label = f"{job['shape']} ctx {job['context']} batch {job['batch']} {job['cache']['name']}"
            if args.repeat > 1:
                label += f" (run {rep + 1}/{args.repeat})"
            if bar is not None:
                bar.set_description(label)
            elif main_rank:
                print(f"[bench {n + 1}/{len(order)}] {label}", file=sys.stderr, flush=True)
            result = run_job(job, args.timeout)
            runs[i].append(result)
            summary = f"{label}: " + (f"error: {result['error']}" if result.get("error") else
                                      f"prefill {result['prefill_s']:.2f} s, decode {result['decode_tok_s']:.1f} tok/s")
            if bar is not None:
                bar.write(summary, file=sys.stderr)
                bar.update(1)
            elif main_rank:
                print(f"[bench] {summary}", file=sys.stderr, flush=True)
            if rep + 1 < args.repeat:
                continue
            last = rows[-1] if rows else {}  # device fields for a worker that died before reporting them
            row = {"device": last.get("device", args.device), "device_name": last.get("device_name"),
                   "mlx": last.get("mlx"), "shape": job["shape"], "model": job["model"], "context": job["context"],
                   "batch": job["batch"], "cache": job["cache"]["name"], "recipe": job["cache"]["recipe"],
                   "decode_tokens": job["decode_tokens"], "prefill_step_size": job["prefill_step_size"],
                   "prefill_batch": job.get("prefill_batch"),
                   "prefill_s": None, "decode_tok_s": None, "kv_bytes": None, "peak_bytes": None}
            row.update(combine_runs(runs[i]), command=command)
            rows.append(row)
            if jsonl:
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
    finally:
        if bar is not None:
            bar.close()
        if jsonl:
            jsonl.close()
    if main_rank:
        report(rows, args, command)
    return 0


def report(rows: List[Dict[str, Any]], args, command: str) -> None:
    """Prints the table; writes it (`--out-md`) and the plot (`--plot`)."""
    table = markdown_table(rows)
    print(table)
    capacity = ""
    if args.memory_budget is not None:
        capacity = capacity_table(rows, args.memory_budget)
        print("\n" + capacity)
    if args.out_md:
        device = next((f"{r['device_name']} ({r['device']})" for r in rows if r.get("device_name")), "unknown")
        mlx_version = next((r["mlx"] for r in rows if r.get("mlx")), "unknown")
        tokens = next((r["decode_tokens"] for r in rows if r.get("decode_tokens")), args.decode_tokens)
        with open(args.out_md, "w") as f:
            f.write(f"# End-to-end generation speed\n\n`{command}`\n\nDevice: {device}; MLX {mlx_version}. "
                    f"Prompt of random token ids, then {tokens} greedy tokens; speed ratios are "
                    "against fp16 (above 1: faster). KV MiB: bytes the caches hold after decoding; peak: MLX's "
                    "peak memory over prefill and decode, weights included.\n\n" + table + "\n")
            if capacity:
                f.write(f"\n## Sequences in {args.memory_budget:g} GiB\n\nEstimated from the largest batch "
                        "measured, for sequences decoding together while one more is prefilled (as a server "
                        "admits them): the weights once, one sequence's share of the prefill's transient memory "
                        "(that batch's prefill peak less the weights and the KV cache), then each sequence's "
                        "share of the decode peak (KV cache and decode activations).\n\n" + capacity + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    sys.exit(main())
