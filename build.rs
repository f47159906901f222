//! Builds the project's C ABI over MLX (`mlx-c/`) and its Rust bindings.
//!
//! MLX comes from the PyPI package `mlx` of exactly `MLX_VERSION`: its wheel
//! ships libmlx and the C++ headers. The copy used is, in order:
//! `MLX_DIR` (a directory holding `include/mlx` and `lib/libmlx.so`, e.g. an
//! unpacked `mlx-cuda-13` wheel's `mlx/`), else the `mlx` package of the
//! Python named by `VELOXQUANT_PYTHON`, `PYO3_PYTHON` or `python3`.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_VERSION: &str = "0.32.4";
const NANOBIND_VERSION: &str = "3.1.0";

fn main() {
    for var in ["MLX_DIR", "VELOXQUANT_PYTHON", "PYO3_PYTHON"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=mlx-c");
    println!("cargo:rerun-if-changed=build.rs");

    let python_feature = env::var_os("CARGO_FEATURE_PYTHON").is_some();
    let mlx = find_mlx();
    check_mlx_version(&mlx);
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include("mlx-c/include")
        .include(mlx.join("include"))
        .define("VQ_MLX_VERSION", Some(format!("\"{MLX_VERSION}\"").as_str()))
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .warnings(false);
    for src in ["core", "ops", "fast", "cuda_disk_cache", "cpu_primitive", "graph"] {
        build.file(format!("mlx-c/src/{src}.cpp"));
    }
    if python_feature {
        let py = PythonBuildInfo::find();
        // nanobind's own sources, built as mlx builds them, in mlx's domain.
        let mut nb = cc::Build::new();
        nb.cpp(true)
            .std("c++20")
            .include(py.nanobind.join("include"))
            .include(py.nanobind.join("ext/robin_map/include"))
            .include(&py.include)
            .define("NB_BUILD", None)
            .define("NDEBUG", None)
            .define("NB_COMPACT_ASSERTIONS", None)
            .define("NB_DOMAIN", Some("mlx"))
            .flag("-fno-strict-aliasing")
            .flag("-fvisibility=hidden")
            .warnings(false)
            .file(py.nanobind.join("src/nb_combined.cpp"))
            .compile("vq_nanobind");
        build
            .include(py.nanobind.join("include"))
            .include(py.nanobind.join("ext/robin_map/include"))
            .include(&py.include)
            .define("NB_DOMAIN", Some("mlx"))
            .define("NDEBUG", None)
            .flag("-fvisibility=hidden")
            .file("mlx-c/src/python_bridge.cpp");
    }
    build.compile("mlxc");

    generate_bindings(&mlx, &out);
    link_mlx(&mlx, &out);
}

fn fail(msg: &str) -> ! {
    eprintln!("\nveloxquant build error: {msg}\n");
    panic!("veloxquant build error: {msg}");
}

fn python() -> String {
    env::var("VELOXQUANT_PYTHON")
        .or_else(|_| env::var("PYO3_PYTHON"))
        .unwrap_or_else(|_| "python3".into())
}

fn python_output(code: &str) -> Option<String> {
    let out = Command::new(python()).args(["-c", code]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn find_mlx() -> PathBuf {
    if let Some(dir) = env::var_os("MLX_DIR") {
        let dir = PathBuf::from(dir);
        if !dir.join("include/mlx/mlx.h").exists() || !dir.join("lib/libmlx.so").exists() {
            fail(&format!(
                "MLX_DIR={} does not hold include/mlx/mlx.h and lib/libmlx.so",
                dir.display()
            ));
        }
        return dir;
    }
    let code = "import importlib.util as u; s = u.find_spec('mlx'); \
                print(s.submodule_search_locations[0] if s else '')";
    match python_output(code) {
        Some(dir) if !dir.is_empty() && Path::new(&dir).join("include/mlx/mlx.h").exists() => PathBuf::from(dir),
        _ => fail(&format!(
            "MLX not found. Install it for `{}`: pip install 'mlx[cpu]=={MLX_VERSION}' \
             (macOS: pip install mlx=={MLX_VERSION}), or set MLX_DIR to a directory \
             with include/mlx and lib/libmlx.so",
            python()
        )),
    }
}

fn check_mlx_version(mlx: &Path) {
    let header = fs::read_to_string(mlx.join("include/mlx/version.h")).unwrap_or_default();
    let part = |name: &str| {
        header
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define MLX_VERSION_{name} ")))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| "?".into())
    };
    let found = format!("{}.{}.{}", part("MAJOR"), part("MINOR"), part("PATCH"));
    if found != MLX_VERSION {
        fail(&format!(
            "MLX {found} found at {}, but veloxquant is built against MLX {MLX_VERSION}: \
             pip install 'mlx[cpu]=={MLX_VERSION}'",
            mlx.display()
        ));
    }
}

struct PythonBuildInfo {
    include: PathBuf,
    nanobind: PathBuf,
}

impl PythonBuildInfo {
    fn find() -> Self {
        let include = python_output("import sysconfig; print(sysconfig.get_paths()['include'])")
            .map(PathBuf::from)
            .filter(|p| p.join("Python.h").exists())
            .unwrap_or_else(|| fail(&format!("Python headers not found for `{}` (Debian: apt-get install python3-dev)", python())));
        let nb = python_output("import nanobind, os; print(nanobind.__version__, os.path.dirname(nanobind.__file__))")
            .unwrap_or_else(|| fail(&format!("nanobind not found: {} -m pip install nanobind=={NANOBIND_VERSION}", python())));
        let (version, dir) = nb.split_once(' ').unwrap_or(("", ""));
        if version != NANOBIND_VERSION {
            fail(&format!(
                "nanobind {version} found; mlx {MLX_VERSION} needs nanobind {NANOBIND_VERSION}: \
                 pip install nanobind=={NANOBIND_VERSION}"
            ));
        }
        Self { include, nanobind: PathBuf::from(dir) }
    }
}

fn generate_bindings(mlx: &Path, out: &Path) {
    println!("cargo:rerun-if-changed=mlx-c/include/mlxc/veloxquant_ext.h");
    let result = std::panic::catch_unwind(|| {
        bindgen::Builder::default()
            .header("mlx-c/include/mlxc/veloxquant_ext.h")
            .clang_arg("-Imlx-c/include")
            .clang_arg(format!("-I{}", mlx.join("include").display()))
            .allowlist_function("mlx_.*|vq_.*")
            .allowlist_type("mlx_.*|vq_.*")
            .rustified_enum("mlx_dtype_|mlx_device_type_")
            .layout_tests(false)
            .generate()
    });
    match result {
        Ok(Ok(b)) => b
            .write_to_file(out.join("mlxc_bindings.rs"))
            .unwrap_or_else(|e| fail(&format!("writing bindings: {e}"))),
        Ok(Err(e)) => fail(&format!("bindgen failed on mlx-c/include/mlxc/veloxquant_ext.h: {e}")),
        Err(_) => fail(
            "bindgen could not load libclang. Install it (Debian/Ubuntu: apt-get install libclang-dev) \
             or point LIBCLANG_PATH at the directory holding libclang.so",
        ),
    }
}

fn link_mlx(mlx: &Path, out: &Path) {
    let lib = mlx.join("lib");
    // A link to MLX's lib directory inside OUT_DIR: cargo puts search paths
    // under the target directory on the loader path of `cargo test` / `run`,
    // so test binaries find libmlx without an absolute run path.
    let local = out.join("mlx-lib");
    let _ = fs::remove_file(&local);
    #[cfg(unix)]
    std::os::unix::fs::symlink(&lib, &local).unwrap_or_else(|e| fail(&format!("linking {}: {e}", lib.display())));
    println!("cargo:rustc-link-search=native={}", local.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    // The Python extension lives in site-packages/veloxquant/, next to mlx/.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN/../mlx/lib");
    println!("cargo:root={}", mlx.display());
}
