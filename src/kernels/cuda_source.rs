//! CUDA kernel sources as MLX's `cuda_kernel` receives them.
//!
//! MLX copies a kernel's whole source into the code it generates, and hashes
//! that code, at every launch: about 0.25 µs of host time per KB
//! (docs/results/profiles/decode-host-h200.txt), 14 µs a launch for
//! `tq_encode`'s 57 KB. Written once into a directory beside MLX's kernel
//! cache, under names made from their text, a kernel's header and body reach
//! MLX as one `#include` line each (NVRTC reads the files where it compiles;
//! later processes load the machine code from MLX's cache), so that a
//! launch's host cost no longer grows with the kernel.

use std::path::{Path, PathBuf};
use std::sync::Once;

/// What MLX's `cuda_kernel` is handed for one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaSource {
    pub header: String,
    pub body: String,
}

/// The directory of the source files: `veloxquant-sources` in MLX's kernel
/// cache, the directory mlx-c keeps the machine code in
/// (`vq_kernel_cache_dir`: `MLX_PTX_CACHE_DIR`, else
/// `<temp>/mlx/<version>/ptx`, absolute, as NVRTC resolves a relative
/// #include against no fixed directory); `None` where
/// `VELOXQUANT_KERNEL_DISK_CACHE=0` keeps everything in memory.
pub(crate) fn source_dir() -> Option<PathBuf> {
    if std::env::var_os("VELOXQUANT_KERNEL_DISK_CACHE").is_some_and(|v| v == "0") {
        return None;
    }
    Some(PathBuf::from(crate::array::kernel_cache_dir().ok()?).join("veloxquant-sources"))
}

/// `header` and `body` of kernel `name` as `#include` lines of files in
/// `dir`, written unless they hold the text already; the texts themselves
/// where `dir` is `None` or the files cannot be written (with one warning a
/// process). `inputs` are the kernel's input names: MLX passes an input's
/// shape, strides or ndim where the body it is handed names them, so the
/// names the real body uses follow in a comment.
pub fn by_include(dir: Option<&Path>, name: &str, header: &str, body: &str, inputs: &[String]) -> CudaSource {
    let inline = CudaSource { header: header.to_owned(), body: body.to_owned() };
    let Some(dir) = dir else { return inline };
    let file = |part: &str, text: &str| dir.join(format!("{name}_{}_{:08x}.{part}.cuh", text.len(), crc32fast::hash(text.as_bytes())));
    let (header_file, body_file) = (file("header", header), file("body", body));
    let include = |path: &Path| -> Option<String> {
        // An #include line holds no quote, backslash or line break.
        let p = path.to_str().filter(|p| !p.contains(['"', '\\', '\n']))?;
        Some(format!("#include \"{p}\"\n"))
    };
    let (Some(header_line), Some(body_line)) = (include(&header_file), include(&body_file)) else { return inline };
    if let Err(e) = write_unless_there(&header_file, header).and_then(|()| write_unless_there(&body_file, body)) {
        static WARNED: Once = Once::new();
        WARNED.call_once(|| eprintln!("veloxquant: CUDA kernel sources stay inline, MLX copies them at every launch ({}: {e})", dir.display()));
        return inline;
    }
    let mut body = body_line;
    let named: Vec<String> = inputs
        .iter()
        .flat_map(|i| ["_shape", "_strides", "_ndim"].map(|s| format!("{i}{s}")))
        .filter(|n| inline.body.contains(n.as_str()))
        .collect();
    if !named.is_empty() {
        body.push_str(&format!("// {}\n", named.join(" ")));
    }
    CudaSource { header: header_line, body }
}

/// Writes `text` to `path` (through a file of its own renamed into place,
/// so that a reader never sees part of it) unless the file holds it.
fn write_unless_there(path: &Path, text: &str) -> std::io::Result<()> {
    if std::fs::read(path).is_ok_and(|held| held == text.as_bytes()) {
        return Ok(());
    }
    let dir = path.parent().expect("a file in a directory");
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vq-cuda-source-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn sources_become_include_lines_of_files_holding_them() {
        let dir = scratch("files");
        let inputs = vec!["x".to_string(), "params".to_string()];
        let body = "const uint32_t n = vq_size(params_shape, 0);\nout[0] = x[0] * n;\n";
        let s = by_include(Some(&dir), "veloxquant_probe", "#define TWICE(a) ((a) + (a))\n", body, &inputs);
        let path = |line: &str| PathBuf::from(line.lines().next().unwrap().strip_prefix("#include \"").unwrap().strip_suffix('"').unwrap());
        assert_eq!(std::fs::read_to_string(path(&s.header)).unwrap(), "#define TWICE(a) ((a) + (a))\n");
        assert_eq!(std::fs::read_to_string(path(&s.body)).unwrap(), body);
        assert!(s.body.ends_with("// params_shape\n"), "the names MLX looks for: {:?}", s.body);
        assert!(!s.body.contains("x_shape"));
        // The same texts, the same lines; another text, another file.
        assert_eq!(by_include(Some(&dir), "veloxquant_probe", "#define TWICE(a) ((a) + (a))\n", body, &inputs), s);
        let other = by_include(Some(&dir), "veloxquant_probe", "#define TWICE(a) (2 * (a))\n", body, &inputs);
        assert_ne!(other.header, s.header);
        assert_eq!(other.body, s.body);
        // A file that no longer holds its text is written again.
        std::fs::write(path(&s.body), "garbage").unwrap();
        by_include(Some(&dir), "veloxquant_probe", "#define TWICE(a) ((a) + (a))\n", body, &inputs);
        assert_eq!(std::fs::read_to_string(path(&s.body)).unwrap(), body);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sources_live_in_mlx_kernel_cache() {
        if std::env::var_os("VELOXQUANT_KERNEL_DISK_CACHE").is_some_and(|v| v == "0") {
            return;
        }
        let dir = source_dir().expect("a kernel cache directory");
        assert!(dir.is_absolute() && dir.ends_with("veloxquant-sources"), "{dir:?}");
        if std::env::var_os("MLX_PTX_CACHE_DIR").is_none() {
            let version = crate::array::mlx_runtime_version().unwrap();
            assert!(dir.parent().unwrap().ends_with(PathBuf::from("mlx").join(version).join("ptx")), "{dir:?}");
        }
    }

    #[test]
    fn sources_stay_inline_where_files_cannot_hold_them() {
        let (header, body) = ("// h\n", "out[0] = 1;\n");
        let inline = CudaSource { header: header.into(), body: body.into() };
        assert_eq!(by_include(None, "veloxquant_probe", header, body, &[]), inline);
        // A path an #include line cannot quote.
        let quoted = scratch("quo\"te");
        assert_eq!(by_include(Some(&quoted), "veloxquant_probe", header, body, &[]), inline);
        assert!(!quoted.exists());
        // A directory that cannot be made: a file stands where it would be.
        let blocked = scratch("blocked");
        std::fs::write(&blocked, "a file").unwrap();
        assert_eq!(by_include(Some(&blocked.join("sub")), "veloxquant_probe", header, body, &[]), inline);
        std::fs::remove_file(&blocked).unwrap();
    }
}
