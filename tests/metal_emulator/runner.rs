//! Compiles a generated kernel with the Metal shim and runs it in a child
//! process.
//!
//! Each distinct source compiles once: the binary is cached under
//! `target/tmp/metal-emulator/<hash>/` (hash of shim, driver source, compiler
//! and flags), so later runs and later test invocations only execute it.
//! Buffers travel through files; the child is killed after a timeout, and
//! the shim's barriers fail on their own after `barrier_timeout`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Entries of a Metal kernel's buffer argument table.
pub const METAL_MAX_BUFFERS: usize = 31;

use half::{bf16, f16};

use super::{Dtype, InputInfo, MetalKernel, TemplateArg, ATTRIBUTES};

const SHIM: &str = include_str!("shim.h");
const CXX_FLAGS: &[&str] = &[
    "-std=c++20",
    "-O1",
    // Metal compiles these kernels with fast math off, and the CPU kernels never
    // fuse a multiply and an add; neither may the emulator.
    "-ffp-contract=off",
    "-fno-fast-math",
    "-pthread",
    // [[buffer(0)]], [[kernel]], #pragma clang ...: meaningful to Metal only.
    "-Wno-attributes",
    "-Wno-unknown-pragmas",
];

/// Element types that can fill a [`HostArray`].
pub trait Element: Copy {
    const DTYPE: Dtype;
    fn put(self, out: &mut Vec<u8>);
    fn get(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: Dtype = $d;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().unwrap())
            }
        }
    };
}
element!(u8, Dtype::U8);
element!(u16, Dtype::U16);
element!(u32, Dtype::U32);
element!(u64, Dtype::U64);
element!(i8, Dtype::I8);
element!(i16, Dtype::I16);
element!(i32, Dtype::I32);
element!(i64, Dtype::I64);
element!(f16, Dtype::F16);
element!(bf16, Dtype::BF16);
element!(f32, Dtype::F32);
element!(f64, Dtype::F64);

/// An array in host memory: row-contiguous, or a strided view of `data`
/// (what MLX hands a kernel made without `ensure_row_contiguous`).
#[derive(Clone, Debug, PartialEq)]
pub struct HostArray {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
    /// Element strides of a view; `None` for row-contiguous.
    pub strides: Option<Vec<i64>>,
}

impl HostArray {
    pub fn new<T: Element>(shape: &[usize], values: &[T]) -> Self {
        assert_eq!(shape.iter().product::<usize>(), values.len(), "values do not fill shape {shape:?}");
        let mut data = Vec::with_capacity(values.len() * T::DTYPE.size());
        for &v in values {
            v.put(&mut data);
        }
        HostArray { dtype: T::DTYPE, shape: shape.to_vec(), data, strides: None }
    }

    /// The row-major `[B, H, L, D]` `values` held as `[B, L, H, D]` and seen
    /// through strides as `[B, H, L, D]`: the transposed view in which
    /// mlx_lm hands queries, keys and values over.
    pub fn heads_transposed<T: Element>(shape: [usize; 4], values: &[T]) -> Self {
        let [b, h, l, d] = shape;
        let mut held = Vec::with_capacity(values.len());
        for bi in 0..b {
            for li in 0..l {
                for hi in 0..h {
                    let o = ((bi * h + hi) * l + li) * d;
                    held.extend_from_slice(&values[o..o + d]);
                }
            }
        }
        let strides = vec![(l * h * d) as i64, d as i64, (h * d) as i64, 1];
        HostArray { strides: Some(strides), ..HostArray::new(&shape, &held) }
    }

    /// A view of `base`'s buffer (from its first element) with `shape` and
    /// the row-contiguous strides of `base`: a leading slice along each axis,
    /// as `ops::slice` from the origin gives.
    pub fn leading_slice(base: &HostArray, shape: &[usize]) -> Self {
        assert_eq!(shape.len(), base.shape.len(), "a view keeps the rank");
        assert!(shape.iter().zip(&base.shape).all(|(v, b)| v <= b), "view {shape:?} exceeds {:?}", base.shape);
        HostArray { shape: shape.to_vec(), strides: Some(contiguous_strides(&base.shape)), ..base.clone() }
    }

    /// A 0-d array.
    pub fn scalar<T: Element>(value: T) -> Self {
        Self::new(&[], &[value])
    }

    pub fn to_vec<T: Element>(&self) -> Vec<T> {
        assert_eq!(self.dtype, T::DTYPE, "reading a {:?} array as {:?}", self.dtype, T::DTYPE);
        self.data.chunks_exact(T::DTYPE.size()).map(T::get).collect()
    }

    fn info(&self) -> InputInfo {
        InputInfo { dtype: self.dtype, shape: self.shape.clone() }
    }
}

fn contiguous_strides(shape: &[usize]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1] as i64;
    }
    strides
}

#[derive(Debug)]
pub enum EmuError {
    /// The launch is one MLX would refuse.
    Invalid(String),
    /// g++ rejected the generated source; carries its diagnostics.
    Compile(String),
    /// The kernel process failed (a deadlock found by the shim, an
    /// out-of-bounds write, a crash); carries its stderr.
    Run(String),
    /// The kernel process ran past the timeout and was killed.
    Timeout(Duration),
    Io(String),
}

impl std::fmt::Display for EmuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EmuError::Invalid(m) => write!(f, "invalid launch: {m}"),
            EmuError::Compile(m) => write!(f, "the kernel does not compile:\n{m}"),
            EmuError::Run(m) => write!(f, "the kernel failed:\n{m}"),
            EmuError::Timeout(d) => write!(f, "the kernel ran longer than {d:?} and was killed"),
            EmuError::Io(m) => write!(f, "emulator i/o: {m}"),
        }
    }
}

impl std::error::Error for EmuError {}

fn io(e: std::io::Error, what: &Path) -> EmuError {
    EmuError::Io(format!("{}: {e}", what.display()))
}

/// One launch: `kernel.launch().input(..).output(..).grid(..).threadgroup(..).run()`.
pub struct Run<'k> {
    kernel: &'k MetalKernel,
    inputs: Vec<HostArray>,
    outputs: Vec<(Vec<usize>, Dtype)>,
    template: Vec<(String, TemplateArg)>,
    grid: (u32, u32, u32),
    threadgroup: (u32, u32, u32),
    init_value: Option<f64>,
    barrier_timeout: Duration,
    timeout: Duration,
}

impl<'k> Run<'k> {
    pub(super) fn new(kernel: &'k MetalKernel) -> Self {
        Run {
            kernel,
            inputs: Vec::new(),
            outputs: Vec::new(),
            template: Vec::new(),
            grid: (1, 1, 1),
            threadgroup: (1, 1, 1),
            init_value: None,
            barrier_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(60),
        }
    }
    pub fn input(mut self, a: HostArray) -> Self {
        self.inputs.push(a);
        self
    }
    pub fn output(mut self, shape: &[usize], dtype: Dtype) -> Self {
        self.outputs.push((shape.to_vec(), dtype));
        self
    }
    pub fn template(mut self, name: &str, arg: TemplateArg) -> Self {
        self.template.push((name.to_string(), arg));
        self
    }
    /// Threads in each dimension (MLX dispatches `dispatchThreads`).
    pub fn grid(mut self, x: u32, y: u32, z: u32) -> Self {
        self.grid = (x, y, z);
        self
    }
    pub fn threadgroup(mut self, x: u32, y: u32, z: u32) -> Self {
        self.threadgroup = (x, y, z);
        self
    }
    /// Fills the outputs before the launch; without it they hold a poison
    /// pattern (0xCD bytes), so elements a kernel forgets to write show up.
    pub fn init_value(mut self, v: f64) -> Self {
        self.init_value = Some(v);
        self
    }
    /// How long a thread may wait at a barrier or simd function.
    pub fn barrier_timeout(mut self, d: Duration) -> Self {
        self.barrier_timeout = d;
        self
    }
    /// How long the whole kernel process may run.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// Generates, compiles (once per source) and runs the kernel; returns the outputs.
    pub fn run(self) -> Result<Vec<HostArray>, EmuError> {
        let k = self.kernel;
        if self.inputs.len() != k.input_names.len() {
            return Err(EmuError::Invalid(format!(
                "{} inputs for {} input names",
                self.inputs.len(),
                k.input_names.len()
            )));
        }
        if self.outputs.len() != k.output_names.len() {
            return Err(EmuError::Invalid(format!(
                "{} outputs for {} output names",
                self.outputs.len(),
                k.output_names.len()
            )));
        }
        let (tx, ty, tz) = self.threadgroup;
        if u64::from(tx) * u64::from(ty) * u64::from(tz) > 1024 {
            return Err(EmuError::Invalid(format!("threadgroup {tx}x{ty}x{tz} exceeds 1024 threads")));
        }
        for (a, name) in self.inputs.iter().zip(&k.input_names) {
            let expect = match &a.strides {
                None => a.shape.iter().product::<usize>() * a.dtype.size(),
                Some(_) if a.shape.contains(&0) => 0,
                Some(st) => {
                    let last: i64 = a.shape.iter().zip(st).map(|(&d, &s)| (d as i64 - 1) * s).sum();
                    (last as usize + 1) * a.dtype.size()
                }
            };
            if a.data.len() < expect || (a.strides.is_none() && a.data.len() != expect) {
                return Err(EmuError::Invalid(format!("input `{name}` holds {} bytes, not {expect}", a.data.len())));
            }
        }
        let infos: Vec<InputInfo> = self.inputs.iter().map(HostArray::info).collect();
        let out_dtypes: Vec<Dtype> = self.outputs.iter().map(|o| o.1).collect();
        let template: Vec<(&str, TemplateArg)> = self.template.iter().map(|(n, a)| (n.as_str(), *a)).collect();
        let generated = k.generate(&infos, &out_dtypes, &template);

        // Buffers in MLX's order: each input, then its shape/strides/ndim when
        // the body names them, then the outputs.
        let mut buffers: Vec<(String, Vec<u8>)> = Vec::new();
        let mut args: Vec<String> = Vec::new();
        for ((a, name), info) in self.inputs.iter().zip(&k.input_names).zip(&k.shape_infos) {
            let i = buffers.len();
            buffers.push((name.clone(), a.data.clone()));
            let ty = a.dtype.metal_name();
            args.push(if a.shape.is_empty() { format!("*(const {ty}*)b[{i}]") } else { format!("(const {ty}*)b[{i}]") });
            if a.shape.is_empty() {
                continue;
            }
            if info.shape {
                let bytes = a.shape.iter().flat_map(|&d| (d as i32).to_le_bytes()).collect();
                args.push(format!("(const int*)b[{}]", buffers.len()));
                buffers.push((format!("{name}_shape"), bytes));
            }
            if info.strides {
                let strides = a.strides.clone().unwrap_or_else(|| contiguous_strides(&a.shape));
                let bytes = strides.iter().flat_map(|s| s.to_le_bytes()).collect();
                args.push(format!("(const int64_t*)b[{}]", buffers.len()));
                buffers.push((format!("{name}_strides"), bytes));
            }
            if info.ndim {
                args.push(format!("*(const int*)b[{}]", buffers.len()));
                buffers.push((format!("{name}_ndim"), (a.shape.len() as i32).to_le_bytes().to_vec()));
            }
        }
        let mut output_buffers = Vec::new();
        for ((shape, dtype), name) in self.outputs.iter().zip(&k.output_names) {
            let n: usize = shape.iter().product();
            let bytes = match self.init_value {
                None => vec![0xCD; n * dtype.size()],
                Some(v) => fill(*dtype, n, v),
            };
            let ty = dtype.metal_name();
            args.push(if k.atomic_outputs {
                format!("(metal::atomic<{ty}>*)b[{}]", buffers.len())
            } else {
                format!("({ty}*)b[{}]", buffers.len())
            });
            output_buffers.push(buffers.len());
            buffers.push((name.clone(), bytes));
        }
        // A Metal kernel's buffer argument table has 31 entries; MLX binds
        // each array, shape, strides and rank to its own, so a kernel past
        // that does not build on a Mac.
        if buffers.len() > METAL_MAX_BUFFERS {
            return Err(EmuError::Invalid(format!(
                "{} buffers (inputs with their shapes, strides and ranks, then outputs) exceed Metal's {METAL_MAX_BUFFERS}",
                buffers.len()
            )));
        }
        for &a in &k.attributes {
            args.push(format!("a.{}()", ATTRIBUTES[a].0));
        }

        let mut cpp = String::with_capacity(generated.source.len() + 2048);
        writeln!(cpp, "#include \"shim.h\"\n#line 1 \"{}.metal\"", generated.kernel_name).unwrap();
        cpp.push_str(&threadgroup_to_static(&generated.source));
        writeln!(
            cpp,
            "\nstatic void metal_emu_launch(void* const* b, const metal_emu::Thread& t, uint3 local, uint3 global) {{\n  \
             const metal_emu::Attrs a{{t, local, global}};\n  (void)a;\n  {}{}(\n      {});\n}}\n\
             int main(int argc, char** argv) {{ return metal_emu::run_main(argc, argv, {}, metal_emu_launch); }}",
            generated.kernel_name,
            generated.template_def,
            args.join(",\n      "),
            buffers.len()
        )
        .unwrap();

        let binary = compile(&cpp)?;
        let outputs = execute(&binary, &buffers, &output_buffers, &self)?;
        Ok(outputs
            .into_iter()
            .zip(&self.outputs)
            .map(|(data, (shape, dtype))| HostArray { dtype: *dtype, shape: shape.clone(), data, strides: None })
            .collect())
    }
}

fn fill(dtype: Dtype, n: usize, v: f64) -> Vec<u8> {
    let one: Vec<u8> = match dtype {
        Dtype::Bool => vec![u8::from(v != 0.0)],
        Dtype::U8 => (v as u8).to_le_bytes().to_vec(),
        Dtype::U16 => (v as u16).to_le_bytes().to_vec(),
        Dtype::U32 => (v as u32).to_le_bytes().to_vec(),
        Dtype::U64 => (v as u64).to_le_bytes().to_vec(),
        Dtype::I8 => (v as i8).to_le_bytes().to_vec(),
        Dtype::I16 => (v as i16).to_le_bytes().to_vec(),
        Dtype::I32 => (v as i32).to_le_bytes().to_vec(),
        Dtype::I64 => (v as i64).to_le_bytes().to_vec(),
        Dtype::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
        Dtype::BF16 => bf16::from_f64(v).to_le_bytes().to_vec(),
        Dtype::F32 => (v as f32).to_le_bytes().to_vec(),
        Dtype::F64 => v.to_le_bytes().to_vec(),
    };
    one.repeat(n)
}

/// Rewrites declarations of threadgroup memory (`threadgroup T name[N];`) to
/// `static`, shared by the threads of a threadgroup. Pointer and reference
/// qualifiers (`threadgroup T* p`) are left for the shim's empty macro. Array
/// sizes may be any expression (`[QN * D]`, `[max(A, B)]`): only the part
/// before the first `[` decides whether the declaration is a pointer. Line
/// numbers are kept so compiler messages point into the generated source.
pub fn threadgroup_to_static(src: &str) -> String {
    const WORD: &str = "threadgroup";
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let bytes = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut last = 0;
    let mut from = 0;
    while let Some(off) = src[from..].find(WORD) {
        let at = from + off;
        let end = at + WORD.len();
        from = end;
        if (at > 0 && is_ident(bytes[at - 1])) || (end < bytes.len() && is_ident(bytes[end])) {
            continue;
        }
        let rest = &src[end..];
        // The declarator ends at one of these outside the array brackets.
        let mut depth = 0usize;
        let stop = rest
            .bytes()
            .position(|c| match c {
                b'[' => {
                    depth += 1;
                    false
                }
                b']' => {
                    depth = depth.saturating_sub(1);
                    false
                }
                b';' | b',' | b')' | b'{' | b'=' => depth == 0,
                _ => false,
            })
            .unwrap_or(rest.len());
        let decl = &rest[..stop];
        let head = &decl[..decl.find('[').unwrap_or(decl.len())];
        let terminated = matches!(rest.as_bytes().get(stop), Some(b';') | Some(b','));
        if terminated && !head.contains(['*', '&', '(']) && !head.trim().is_empty() {
            out.push_str(&src[last..at]);
            out.push_str("static");
            last = end;
        }
    }
    out.push_str(&src[last..]);
    out
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn cache_root() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("metal-emulator")
}

fn compiler() -> String {
    std::env::var("VELOXQUANT_EMU_CXX").unwrap_or_else(|_| "g++".to_string())
}

/// Compiles `cpp` unless a binary for it is cached; returns the binary's path.
fn compile(cpp: &str) -> Result<PathBuf, EmuError> {
    let cxx = compiler();
    let flags = CXX_FLAGS.join(" ");
    let hash = fnv1a(&[SHIM.as_bytes(), cpp.as_bytes(), cxx.as_bytes(), flags.as_bytes()]);
    let dir = cache_root().join(format!("{hash:016x}"));
    let binary = dir.join("kernel");

    // One compile per source in this process; other processes racing on the
    // same source each write a private file and rename it into place.
    static LOCKS: OnceLock<Mutex<HashMap<u64, Arc<Mutex<()>>>>> = OnceLock::new();
    let lock = LOCKS.get_or_init(Default::default).lock().unwrap().entry(hash).or_default().clone();
    let _guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    if binary.exists() {
        return Ok(binary);
    }
    let include = shim_dir(&cxx)?;
    std::fs::create_dir_all(&dir).map_err(|e| io(e, &dir))?;
    let source = dir.join("kernel.cpp");
    std::fs::write(&source, cpp).map_err(|e| io(e, &source))?;
    let tmp = dir.join(format!("kernel.{}.tmp", std::process::id()));
    let out = Command::new(&cxx)
        .args(CXX_FLAGS)
        .arg("-I")
        .arg(&include)
        .arg(&source)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| EmuError::Io(format!("cannot run {cxx}: {e}")))?;
    if !out.status.success() {
        return Err(EmuError::Compile(format!(
            "{} (source: {})\n{}",
            out.status,
            source.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    std::fs::rename(&tmp, &binary).map_err(|e| io(e, &binary))?;
    Ok(binary)
}

/// A directory holding shim.h and, when g++ can make one, its precompiled
/// header: parsing the shim and the standard headers it includes is most of
/// the time of a kernel compile. g++ ignores a .gch that does not fit.
fn shim_dir(cxx: &str) -> Result<PathBuf, EmuError> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let flags = CXX_FLAGS.join(" ");
        let hash = fnv1a(&[SHIM.as_bytes(), cxx.as_bytes(), flags.as_bytes()]);
        let dir = cache_root().join(format!("shim-{hash:016x}"));
        let gch = dir.join("shim.h.gch");
        if gch.exists() {
            return Ok(dir);
        }
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let header = dir.join("shim.h");
        std::fs::write(&header, SHIM).map_err(|e| format!("{}: {e}", header.display()))?;
        let tmp = dir.join(format!("shim.h.gch.{}.tmp", std::process::id()));
        let ok = Command::new(cxx)
            .args(CXX_FLAGS)
            .args(["-x", "c++-header"])
            .arg(&header)
            .arg("-o")
            .arg(&tmp)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            let _ = std::fs::rename(&tmp, &gch);
        }
        Ok(dir)
    })
    .clone()
    .map_err(EmuError::Io)
}

fn execute(
    binary: &Path,
    buffers: &[(String, Vec<u8>)],
    outputs: &[usize],
    run: &Run<'_>,
) -> Result<Vec<Vec<u8>>, EmuError> {
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let dir = binary
        .parent()
        .unwrap()
        .join(format!("run-{}-{}", std::process::id(), RUNS.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir_all(&dir).map_err(|e| io(e, &dir))?;
    let result = execute_in(binary, buffers, outputs, run, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn execute_in(
    binary: &Path,
    buffers: &[(String, Vec<u8>)],
    outputs: &[usize],
    run: &Run<'_>,
    dir: &Path,
) -> Result<Vec<Vec<u8>>, EmuError> {
    let (gx, gy, gz) = run.grid;
    let (tx, ty, tz) = run.threadgroup;
    let mut spec = format!(
        "grid {gx} {gy} {gz}\nthreadgroup {tx} {ty} {tz}\ntimeout_ms {}\n",
        run.barrier_timeout.as_millis().max(1)
    );
    for (i, (name, bytes)) in buffers.iter().enumerate() {
        let path = dir.join(format!("b{i}.bin"));
        std::fs::write(&path, bytes).map_err(|e| io(e, &path))?;
        writeln!(spec, "buffer {i} {name} {} {}", bytes.len(), path.display()).unwrap();
    }
    for &i in outputs {
        writeln!(spec, "output {i} {}", dir.join(format!("o{i}.bin")).display()).unwrap();
    }
    let spec_path = dir.join("spec.txt");
    std::fs::write(&spec_path, spec).map_err(|e| io(e, &spec_path))?;
    // stderr goes to a file: a pipe nobody reads could fill and stall the child.
    let err_path = dir.join("stderr.txt");
    let err_file = std::fs::File::create(&err_path).map_err(|e| io(e, &err_path))?;
    let mut child = Command::new(binary)
        .arg(&spec_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err_file)
        .spawn()
        .map_err(|e| io(e, binary))?;
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| io(e, binary))? {
            break status;
        }
        if start.elapsed() > run.timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(EmuError::Timeout(run.timeout));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    if !status.success() {
        let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
        return Err(EmuError::Run(format!("{status}\n{stderr}")));
    }
    outputs
        .iter()
        .map(|&i| {
            let path = dir.join(format!("o{i}.bin"));
            std::fs::read(&path).map_err(|e| io(e, &path))
        })
        .collect()
}
