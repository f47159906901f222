//! The GPU kernel cache, in a process of its own so that no other test has
//! created kernels before it, and the kernels' machine code kept on disk for
//! later processes. Ignored where MLX has no GPU back-end.

mod common;

use common::{f32s, normal, rel_err};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use veloxquant::cache::{CacheConfig, LayerCache};
use veloxquant::kernels::{bit_pack, cached_kernel_count};
use veloxquant::{Array, Dtype, Options, Policy, Stream};

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_kernels_are_created_once_per_template_arguments() {
    let o = Options::on(Stream::gpu().expect("a GPU back-end"), Policy::Require);
    assert_eq!(cached_kernel_count(), 0);
    let a = Array::from_slice(&[1u8; 64], &[4, 16]).unwrap();
    bit_pack(&a, 3, &o).unwrap().eval().unwrap();
    assert_eq!(cached_kernel_count(), 1);
    for _ in 0..10 {
        bit_pack(&a, 3, &o).unwrap().eval().unwrap();
    }
    assert_eq!(cached_kernel_count(), 1, "the same template arguments reuse the kernel");
    bit_pack(&a, 2, &o).unwrap().eval().unwrap();
    assert_eq!(cached_kernel_count(), 2, "new template arguments, new kernel");
}

/// MLX compiles custom kernels in every process; veloxquant writes each one's
/// source beside MLX's kernel cache (MLX is handed #include lines) and its
/// machine code where that cache looks, so later processes load it.
/// A child process fills an empty cache directory, a second child gives the
/// same attention from it without adding a module, and a third, after the
/// modules' kernel names were altered, fails to find its kernels: MLX reads the
/// modules written here instead of compiling.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_kernels_are_kept_on_disk_for_later_processes() {
    const CHILD: &str = "VQ_DISK_CACHE_CHILD_OUT";
    if let Some(out) = std::env::var_os(CHILD) {
        std::fs::write(out, f32_bytes(&cache_attention())).unwrap();
        return;
    }
    let root = std::env::temp_dir().join(format!("vq-disk-cache-{}", std::process::id()));
    let dir = root.join("ptx");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let child = |cache: &std::path::Path, out: &str| {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "gpu_kernels_are_kept_on_disk_for_later_processes", "--test-threads=1"])
            .env("MLX_PTX_CACHE_DIR", cache)
            .env(CHILD, root.join(out))
            .output()
            .unwrap()
    };

    let first = child(&dir, "first");
    assert!(first.status.success(), "first process: {}", String::from_utf8_lossy(&first.stderr));
    let modules = veloxquant_modules(&dir);
    assert!(modules.len() >= 3, "modules kept: {modules:?}");
    for (ptx, _) in &modules {
        let code = std::fs::read(ptx).unwrap();
        assert!(code.starts_with(b"\x7fELF") || code.starts_with(b"//"), "{ptx:?} is neither a cubin nor PTX");
        let names = std::fs::read_to_string(ptx.with_extension("txt")).unwrap();
        let (name, mangled) = names.trim_end().split_once('\t').expect("name, tab, mangled name");
        assert!(name.starts_with("mlx::core::cu::custom_kernel_veloxquant_") && !mangled.is_empty(), "{names:?}");
    }

    // The sources MLX was handed as #include lines; a process that finds them
    // gone writes them again, at the same paths, so its modules' names match.
    let sources = dir.join("veloxquant-sources");
    let written = |ext: &str| {
        std::fs::read_dir(&sources).map_or(0, |d| d.filter(|e| e.as_ref().unwrap().path().to_string_lossy().ends_with(ext)).count())
    };
    assert!(written(".header.cuh") >= 3 && written(".body.cuh") == written(".header.cuh"), "sources in {sources:?}");
    let kept = written(".body.cuh");
    std::fs::remove_dir_all(&sources).unwrap();

    let second = child(&dir, "second");
    assert!(second.status.success(), "second process: {}", String::from_utf8_lossy(&second.stderr));
    assert_eq!(veloxquant_modules(&dir), modules, "the second process found every module kept");
    assert_eq!(written(".body.cuh"), kept, "the second process wrote the sources again");
    let (a, b) = (std::fs::read(root.join("first")).unwrap(), std::fs::read(root.join("second")).unwrap());
    let e = rel_err(&from_bytes(&a), &from_bytes(&b));
    assert!(e <= 1e-3, "attention from kept modules differs by {e}");

    // Altered in place: the sources' include lines name their absolute
    // paths, so the modules of a copy of the directory would have other names.
    for (ptx, _) in &modules {
        let names = ptx.with_extension("txt");
        std::fs::write(&names, format!("altered_{}", std::fs::read_to_string(&names).unwrap())).unwrap();
    }
    let third = child(&dir, "third");
    // The test harness reports a failed test on its standard output.
    let said = format!("{}{}", String::from_utf8_lossy(&third.stdout), String::from_utf8_lossy(&third.stderr));
    assert!(!third.status.success() && said.contains("no kernel named"), "altered modules: {said}");
    let _ = std::fs::remove_dir_all(&root);
}

/// Every veloxquant module in an MLX kernel cache directory, with its time.
fn veloxquant_modules(dir: &std::path::Path) -> Vec<(std::path::PathBuf, std::time::SystemTime)> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ptx") && p.to_string_lossy().contains("veloxquant"))
        .map(|p| {
            let t = std::fs::metadata(&p).unwrap().modified().unwrap();
            (p, t)
        })
        .collect();
    found.sort();
    found
}

/// One layer's compressed cache on the GPU, filled in two chunks, attended by
/// one query (the decode kernel) and by seven (prefill).
fn cache_attention() -> Vec<f32> {
    let gpu = Stream::gpu().expect("a GPU back-end");
    let mut cfg = CacheConfig::new(128, 8);
    cfg.key_bits = 4;
    cfg.value_bits = 3;
    cfg.policy = Policy::Require;
    let mut cache = LayerCache::new(cfg, Some(gpu.clone())).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for t in [700, 300] {
        let k = normal(&mut rng, &[1, 8, t, 128], Dtype::F16);
        let v = normal(&mut rng, &[1, 8, t, 128], Dtype::F16);
        cache.append(&k, &v).unwrap();
    }
    let mut out = Vec::new();
    for l in [1, 7] {
        let q = normal(&mut rng, &[1, 32, l, 128], Dtype::F16);
        out.extend(f32s(&cache.attention(&q, 1.0 / 128f32.sqrt(), l > 1).unwrap()));
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}
