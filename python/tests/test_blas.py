"""The fast CPU route (veloxquant.blas): OpenBLAS in place of the mlx[cpu]
wheel's reference BLAS, active after ``import veloxquant``, equal results,
faster matmul; and float32 compute of a float16 model with float16 caches.

The BLAS is chosen when libmlx loads, so each BLAS is checked in its own
subprocess; the float32-compute checks run in this process on a tiny
random-weight model.
"""

import json
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from veloxquant import blas

LINUX_CPU_WHEEL = sys.platform.startswith("linux") and bool(blas.bundled_blas())
needs_cpu_wheel = pytest.mark.skipif(not LINUX_CPU_WHEEL, reason="only the Linux mlx[cpu] wheel bundles the reference BLAS")

PROBE = textwrap.dedent(
    """
    import json, sys
    if sys.argv[1] == "mlx-first":
        import mlx.core
    import veloxquant
    import mlx.core as mx
    import numpy as np
    from veloxquant import blas

    s = blas.status()
    a = mx.random.normal((384, 384), key=mx.random.key(1))
    b = mx.random.normal((384, 384), key=mx.random.key(2))
    with mx.stream(mx.cpu):
        np.save(sys.argv[2], np.array(a @ b))
    print(json.dumps({"fast": s.fast, "name": s.name, "library": s.library, "note": s.note,
                      "gflops": blas.matmul_gflops(), "warning": blas.warning(),
                      "float32": blas.float32_compute_wanted()}))
    """
)


def probe(tmp_path, name, how="veloxquant-first", **env):
    e = {k: v for k, v in os.environ.items() if k not in ("VELOXQUANT_BLAS", "LD_PRELOAD", "VELOXQUANT_CPU_FLOAT32")}
    e.update(env)
    out = tmp_path / f"{name}.npy"
    r = subprocess.run([sys.executable, "-c", PROBE, how, str(out)], capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), np.load(out)


@needs_cpu_wheel
def test_openblas_is_active_after_import_veloxquant(tmp_path):
    """scripts/setup.sh installs libopenblas0-pthread; importing veloxquant then routes MLX's matmul to it."""
    fast, c_fast = probe(tmp_path, "fast")
    assert blas.find_openblas() is not None, "no OpenBLAS on this machine: bash scripts/setup.sh installs libopenblas0-pthread"
    assert fast["fast"], fast
    assert "openblas" in fast["library"].lower() and fast["name"].startswith("OpenBLAS"), fast
    assert fast["warning"] is None and fast["float32"] is True
    ref, c_ref = probe(tmp_path, "ref", VELOXQUANT_BLAS="reference")
    assert not ref["fast"] and "mlx_cpu.libs" in ref["library"] and "VELOXQUANT_BLAS=reference" in ref["note"], ref
    assert ref["warning"] and not ref["float32"]
    # the same product up to float32 rounding, and much faster (about 30x here; 2x leaves room for a busy machine)
    np.testing.assert_allclose(c_fast, c_ref, rtol=1e-4, atol=1e-3)
    assert fast["gflops"] > 2 * ref["gflops"], (fast["gflops"], ref["gflops"])


@needs_cpu_wheel
def test_mlx_imported_first_is_reported_and_ld_preload_works(tmp_path):
    late, _ = probe(tmp_path, "late", how="mlx-first")
    assert not late["fast"] and "imported before veloxquant" in late["note"], late
    assert "LD_PRELOAD" in late["warning"]
    preload, _ = probe(tmp_path, "preload", how="mlx-first", LD_PRELOAD="libopenblas.so.0")
    assert preload["fast"] and "openblas" in preload["library"].lower(), preload


@needs_cpu_wheel
def test_doctor_names_the_blas():
    r = subprocess.run([sys.executable, "-m", "veloxquant", "doctor"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "CPU BLAS: OpenBLAS" in r.stdout and "GFLOP/s" in r.stdout, r.stdout
    assert "CPU compute in generate, compare and eval: float32" in r.stdout, r.stdout


def test_coretype_follows_the_user(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert blas.openblas_coretype() is None


# --- float32 compute of a float16 model ------------------------------------------


def tiny_llama(seed=0):
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "rms_norm_eps": 1e-5,
            "vocab_size": 512,
            "tie_word_embeddings": True,
        }
    )
    mx.random.seed(seed)
    model = Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


@pytest.fixture
def float32_attention_off():
    from veloxquant import attention

    yield
    attention.set_cpu_float32(False)


@pytest.mark.parametrize("kind", ["fp16", "mlx-quantized", "veloxquant"])
def test_float32_compute_keeps_float16_caches_and_results(kind, float32_attention_off):
    """Prefill (chunks of 40, past the 8-query fused limit) and decode with and
    without float32 compute: the same logits up to float16 rounding, caches of
    the same dtype and bytes."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_make

    from veloxquant import attention
    from veloxquant.cache import KVConfig, cache_nbytes, make_mlx_quantized_cache, make_prompt_cache

    def make(model):
        if kind == "veloxquant":
            return make_prompt_cache(model, KVConfig(window=16, sinks=2))
        if kind == "mlx-quantized":
            return make_mlx_quantized_cache(model, 4, 64)
        return mlx_make(model)

    ids = mx.random.randint(0, 512, (1, 123), key=mx.random.key(3))

    def run(model):
        cache = make(model)
        outs = []
        with mx.stream(mx.cpu):
            for pos in range(0, 120, 40):
                outs.append(model(ids[:, pos : pos + 40], cache=cache))
            for pos in range(120, 123):  # decode steps
                outs.append(model(ids[:, pos : pos + 1], cache=cache))
            out = mx.concatenate(outs, axis=1)
            mx.eval(out)
        return out, cache

    attention.set_cpu_float32(False)
    half = tiny_llama()
    ref, ref_cache = run(half)
    model = tiny_llama()
    with mx.stream(mx.cpu):
        assert blas.use_float32_compute(model) == 2 * 7 + 1  # 7 Linear layers per block, the embedding
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    got, cache = run(model)
    assert got.dtype == ref.dtype == mx.float16
    assert cache_nbytes(cache) == cache_nbytes(ref_cache)
    if kind == "fp16":
        assert cache[0].keys.dtype == mx.float16
    err = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    scale = mx.abs(ref.astype(mx.float32)).max().item()
    assert err <= 0.02 * scale, (err, scale)
    agree = (got.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item()
    assert agree >= 0.95, agree


def test_float32_compute_off_by_env(monkeypatch):
    monkeypatch.setenv("VELOXQUANT_CPU_FLOAT32", "0")
    assert blas.float32_compute_wanted() is False
    assert blas.maybe_float32_compute(tiny_llama()) is None
