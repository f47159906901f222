"""How much each key quantizer disturbs attention, at its bits per element.

Runs the model once over the first --tokens tokens of the shipped text and
takes every layer's queries and keys as its attention sees them (after
RoPE). Each layer's keys are then encoded and decoded by each quantizer, one
KV head at a time, and the attention of the second half's queries (every
4th position, causal) is compared with the exact one: the KL divergence of
the softmax weights, averaged over heads and queries, then over layers (the
worst layer beside it). Values stay exact, so the table isolates the keys,
which cause nearly all of a compressed cache's loss.

Rows: TurboQuant-MSE with and without the keys' per-channel mean removed
first (as the cache does; the mean is taken over the tokens and counted in
the bits), centred with each channel scaled by its keys' and queries'
energies before the rotation (a candidate, not in the cache), and KIVI's
per-channel keys with groups of 32, 64 and 128 tokens; and KIVI keys whose
channels get unequal bits (a candidate, not in the cache): each KV head's
channels share the same total of bits, given greedily where a bit removes
the most score error, weighing channel c by E[q_c^2] * range(k_c)^2 over
the first --calibration tokens (the attention's own queries: weighting by
the keys alone gains nothing); and the same weights choosing only which half
of the channels takes one bit more and which one bit less (two code widths,
a layout a kernel reads without per-channel offsets).
Bits per element are what each quantizer stores (codes, norms, scales and
zeros, the mean), from its own accounting.

    .venv/bin/python scripts/key_error.py --out docs/results/key-error-smollm2.md
"""

from __future__ import annotations

import argparse
import time


def channel_bits(weight, bits: float, low: int = 1, high: int = 8):
    """Integer bits per channel, `bits` on average: each next bit goes where
    it removes the most of `weight[c] * 4^-bits[c]` (a uniform quantizer's
    error, weighed by what the channel contributes to the scores)."""
    import numpy as np

    widths = np.full(len(weight), low)
    for _ in range(int(round(bits * len(weight))) - low * len(weight)):
        gain = weight * (4.0 ** -widths - 4.0 ** -(widths + 1.0))
        gain[widths >= high] = -1.0
        widths[int(np.argmax(gain))] += 1
    return widths


def two_widths(weight, bits: int):
    """Half the channels (those of most weight) at ``bits + 1``, the other
    half at ``bits - 1``: ``bits`` on average, and two planes of one code
    width each, which a kernel reads as it reads one width."""
    import numpy as np

    widths = np.full(len(weight), bits - 1)
    widths[np.argsort(-weight)[: len(weight) // 2]] = bits + 1
    return widths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an mlx_lm model path (default: SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--bits", default="2,3,4")
    p.add_argument("--calibration", type=int, default=256, help="tokens that set the unequal bits' allocation")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args()
    if args.tokens < 16:
        p.error("--tokens: at least 16")
    bits_list = [int(b) for b in args.bits.split(",")]

    import veloxquant  # noqa: F401  (before mlx: veloxquant.blas chooses the BLAS)
    import mlx.core as mx
    import numpy as np

    from veloxquant.tools import eval as vq_eval
    from veloxquant import quant
    from veloxquant.tools import models

    model, tokenizer = models.load(args.model)
    ids = vq_eval.encode_text(tokenizer, vq_eval.english_text())[: args.tokens]
    captured = []
    attention_module = __import__(type(model).__module__, fromlist=["scaled_dot_product_attention"])
    exact = attention_module.scaled_dot_product_attention

    def capture(queries, keys, values, cache, scale, mask, **kw):
        captured.append((np.array(queries[0].astype(mx.float32)), np.array(keys[0].astype(mx.float32)), scale))
        return exact(queries, keys, values, cache, scale, mask, **kw)

    attention_module.scaled_dot_product_attention = capture
    try:
        mx.eval(model(mx.array(ids)[None]))
    finally:
        attention_module.scaled_dot_product_attention = exact
    if not captured:
        raise SystemExit(f"{type(model).__module__} does not attend through scaled_dot_product_attention")

    def kl(q, k, k_hat, scale):
        hq, n, _ = q.shape
        group = hq // k.shape[0]
        rows = np.arange(n // 2, n, 4)
        hidden = np.arange(n)[None, :] > rows[:, None]
        total = 0.0
        for h in range(hq):
            s, s_hat = (q[h, rows] @ x[h // group].T * scale for x in (k, k_hat))
            s[hidden] = s_hat[hidden] = -np.inf
            logp, logp_hat = (x - x.max(1, keepdims=True) for x in (s, s_hat))
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            logp_hat -= np.log(np.exp(logp_hat).sum(1, keepdims=True))
            p = np.exp(logp)
            with np.errstate(invalid="ignore"):  # hidden positions: -inf - -inf, weighed by p = 0
                total += np.where(p > 0, p * (logp - logp_hat), 0.0).sum(1).mean()
        return total / hq

    def turboquant(centre, query_scaled=False):
        def run(q, k, bits):
            d = k.shape[-1]
            tq = quant.TurboQuantMSE(dim=d, bits=bits, seed=0)
            mean = k.mean(1, keepdims=True) if centre else np.zeros_like(k[:, :1])
            # Channel c of a head's keys divided by s_c (its queries
            # multiplied), s_c^2 = rms(k_c) / rms(q_c): the score error
            # E[(q . e)^2] of an isotropic error e is least so; the scales
            # (float16 per head and channel) count in the bits.
            s = np.ones_like(mean)
            if query_scaled:
                rq = np.sqrt((q.reshape(k.shape[0], -1, d) ** 2).mean(1))
                rk = np.sqrt(((k - mean) ** 2).mean(1))
                s = np.sqrt(rk / np.maximum(rq, 1e-6))[:, None, :]
                s /= np.exp(np.log(s).mean(-1, keepdims=True))
            enc = tq.encode(((k - mean) / s).reshape(-1, d))
            stored = tq.bits_per_element(enc) + 16 * mean.size / k.size * (int(centre) + int(query_scaled))
            return tq.decode(enc).reshape(k.shape) * s + mean, stored
        return run

    def kivi(group):
        def run(q, k, bits):
            kv = quant.KIVIKeys(dim=k.shape[-1], bits=bits, group=group)
            encs = [kv.encode(k[h]) for h in range(k.shape[0])]
            stored = float(np.mean([kv.bits_per_element(e) for e in encs]))
            return np.stack([kv.decode(e) for e in encs]), stored
        return run

    def kivi_channel_bits(group, allot=channel_bits):
        def run(q, k, bits):
            heads, n, d = k.shape
            calib = max(1, min(args.calibration, n))
            q_heads = q.reshape(heads, -1, n, d)[:, :, :calib].reshape(heads, -1, d)
            widths = np.stack([allot((q_heads[h] ** 2).mean(0) * np.ptp(k[h, :calib], 0) ** 2, bits)
                               for h in range(heads)])
            full = n // group * group
            x = k[:, :full].reshape(heads, -1, group, d)
            lo = x.min(2, keepdims=True).astype(np.float16).astype(np.float32)
            hi = x.max(2, keepdims=True).astype(np.float16).astype(np.float32)
            step = np.maximum(hi - lo, 1e-6) / (2.0 ** widths[:, None, None, :] - 1)
            k_hat = k.copy()
            k_hat[:, :full] = (lo + np.round((x - lo) / step) * step).reshape(heads, full, d)
            # Codes, a float16 (scale, zero) per channel and group (a partial
            # last group is left exact here, as in KIVIKeys' residual), and a
            # 4-bit width per channel and head.
            stored = bits + 32 / group + 4 / n
            return k_hat, stored
        return run

    methods = [("TurboQuant-MSE", turboquant(False)), ("TurboQuant-MSE, centred", turboquant(True)),
               ("TurboQuant-MSE, centred, channels scaled by query energy", turboquant(True, True))]
    methods += [(f"KIVI keys, group {g}", kivi(g)) for g in (32, 64, 128)]
    methods += [(f"KIVI keys, group {g}, bits per channel by query energy", kivi_channel_bits(g)) for g in (64, 128)]
    methods += [(f"KIVI keys, group {g}, half the channels at bits + 1 and half at bits - 1 by query energy",
                 kivi_channel_bits(g, two_widths)) for g in (64, 128)]
    t0 = time.perf_counter()
    lines = [
        f"# Attention error of key quantizers ({args.model or 'SmolLM2-135M'}, {len(ids)} tokens, "
        f"{len(captured)} layers)",
        "",
        "`python scripts/key_error.py" + (f" --model {args.model}" if args.model else "")
        + f" --tokens {args.tokens} --bits {args.bits}`. KL of the attention weights with quantized keys "
        "against exact ones (values exact), mean over layers and the worst layer; bits per element stored "
        "by the keys' quantizer.",
        "",
        "| keys | bits | bits/element | mean KL | worst layer KL |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for bits in bits_list:
        for name, run in methods:
            kls, stored = [], 0.0
            for q, k, scale in captured:
                k_hat, stored = run(q, k, bits)
                kls.append(kl(q, k, k_hat, scale))
            line = f"| {name} | {bits} | {stored:.2f} | {np.mean(kls):.4f} | {np.max(kls):.4f} |"
            lines.append(line)
            print(line, flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
