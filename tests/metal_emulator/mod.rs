//! CPU emulator for MLX Metal kernel bodies (see docs/METAL_EMULATOR.md).
//!
//! [`MetalKernel`] mirrors `mx.fast.metal_kernel`: it detects the
//! `_shape`/`_strides`/`_ndim` names and the attributes a body uses, and
//! [`MetalKernel::generate`] writes the kernel source character for character
//! as MLX does (pinned by `tests/metal_golden.rs`). `runner.rs` compiles that
//! source as C++ with `shim.h` and runs it on real threads.
#![allow(dead_code)]

mod runner;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

#[allow(unused_imports)]
pub use runner::{Element, EmuError, HostArray, Run};

/// MLX dtypes, with the type names MLX writes into Metal sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    U8,
    U16,
    U32,
    U64,
    I8,
    I16,
    I32,
    I64,
    F16,
    BF16,
    F32,
    F64,
}

impl Dtype {
    /// MLX's `get_type_string`.
    pub fn metal_name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8_t",
            Dtype::U16 => "uint16_t",
            Dtype::U32 => "uint32_t",
            Dtype::U64 => "uint64_t",
            Dtype::I8 => "int8_t",
            Dtype::I16 => "int16_t",
            Dtype::I32 => "int32_t",
            Dtype::I64 => "int64_t",
            Dtype::F16 => "float16_t",
            Dtype::BF16 => "bfloat16_t",
            Dtype::F32 => "float",
            Dtype::F64 => "double",
        }
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// Parses MLX's Python dtype names (`float32`, `bfloat16`, ...).
    pub fn from_mlx_name(name: &str) -> Option<Dtype> {
        Some(match name {
            "bool" => Dtype::Bool,
            "uint8" => Dtype::U8,
            "uint16" => Dtype::U16,
            "uint32" => Dtype::U32,
            "uint64" => Dtype::U64,
            "int8" => Dtype::I8,
            "int16" => Dtype::I16,
            "int32" => Dtype::I32,
            "int64" => Dtype::I64,
            "float16" => Dtype::F16,
            "bfloat16" => Dtype::BF16,
            "float32" => Dtype::F32,
            "float64" => Dtype::F64,
            _ => return None,
        })
    }
}

/// A template argument, as MLX's `TemplateArg` variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateArg {
    Int(i32),
    Bool(bool),
    Dtype(Dtype),
}

/// The attributes MLX detects, in the order MLX emits them, with their types.
pub const ATTRIBUTES: [(&str, &str); 20] = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
];

/// MLX passes inputs with fewer elements than this in `constant` memory.
pub const MAX_CONSTANT_ARRAY_SIZE: usize = 8;

/// What the generator needs to know about one input array.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl InputInfo {
    pub fn size(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Which of `<name>_shape`, `<name>_strides`, `<name>_ndim` a body mentions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShapeInfo {
    pub shape: bool,
    pub strides: bool,
    pub ndim: bool,
}

/// A kernel as `mx.fast.metal_kernel(...)` returns it.
#[derive(Clone, Debug)]
pub struct MetalKernel {
    pub name: String,
    pub input_names: Vec<String>,
    pub output_names: Vec<String>,
    pub source: String,
    pub header: String,
    pub atomic_outputs: bool,
    pub shape_infos: Vec<ShapeInfo>,
    /// Indices into [`ATTRIBUTES`] of the attributes the body mentions.
    pub attributes: Vec<usize>,
}

/// One generated kernel: MLX's kernel name and full source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generated {
    pub kernel_name: String,
    /// `<float, 3>` for template args, empty without.
    pub template_def: String,
    pub source: String,
}

impl MetalKernel {
    pub fn new(name: &str, input_names: &[&str], output_names: &[&str], source: &str) -> Self {
        assert!(!output_names.is_empty(), "[metal_kernel] Must specify at least one output.");
        // Plain substring search, as MLX: comments count, and so does a name
        // that merely contains another (`max_shape` contains `x_shape`).
        let shape_infos = input_names
            .iter()
            .map(|n| ShapeInfo {
                shape: source.contains(&format!("{n}_shape")),
                strides: source.contains(&format!("{n}_strides")),
                ndim: source.contains(&format!("{n}_ndim")),
            })
            .collect();
        let attributes = (0..ATTRIBUTES.len()).filter(|&i| source.contains(ATTRIBUTES[i].0)).collect();
        MetalKernel {
            name: name.to_string(),
            input_names: input_names.iter().map(|s| s.to_string()).collect(),
            output_names: output_names.iter().map(|s| s.to_string()).collect(),
            source: source.to_string(),
            header: String::new(),
            atomic_outputs: false,
            shape_infos,
            attributes,
        }
    }

    pub fn with_header(mut self, header: &str) -> Self {
        self.header = header.to_string();
        self
    }

    pub fn with_atomic_outputs(mut self, atomic: bool) -> Self {
        self.atomic_outputs = atomic;
        self
    }

    /// The source MLX compiles for these inputs, output dtypes and template
    /// arguments (MLX's `metal_kernel` call operator and `write_signature`).
    pub fn generate(
        &self,
        inputs: &[InputInfo],
        output_dtypes: &[Dtype],
        template: &[(&str, TemplateArg)],
    ) -> Generated {
        assert_eq!(inputs.len(), self.input_names.len(), "[metal_kernel] number of inputs");
        assert_eq!(output_dtypes.len(), self.output_names.len(), "[metal_kernel] number of outputs");

        let mut template_def = String::new();
        let mut kernel_name = format!("custom_kernel_{}", self.name);
        if !template.is_empty() {
            template_def.push('<');
            for (i, (_, arg)) in template.iter().enumerate() {
                if i > 0 {
                    template_def.push_str(", ");
                }
                match arg {
                    TemplateArg::Int(v) => write!(template_def, "{v}").unwrap(),
                    // std::ostream << bool without boolalpha.
                    TemplateArg::Bool(b) => template_def.push_str(if *b { "1" } else { "0" }),
                    TemplateArg::Dtype(d) => template_def.push_str(d.metal_name()),
                }
            }
            template_def.push('>');
            // MLX replaces `<`, `>`, `, ` and the `-` of negative ints by `_`
            // and drops the last character.
            let mut hash = template_def.replace(", ", "_").replace(['<', '>', '-'], "_");
            hash.pop();
            kernel_name.push('_');
            kernel_name.push_str(&hash);
        }
        for arr in inputs {
            kernel_name.push('_');
            kernel_name.push_str(arr.dtype.metal_name());
            if arr.shape.is_empty() {
                kernel_name.push('s');
            } else if arr.size() < MAX_CONSTANT_ARRAY_SIZE {
                kernel_name.push('c');
            }
        }
        for d in output_dtypes {
            kernel_name.push('_');
            kernel_name.push_str(d.metal_name());
        }

        let mut src = String::with_capacity(self.header.len() + self.source.len() + 2048);
        src.push_str(&self.header);
        if !template.is_empty() {
            src.push_str("template <");
            for (i, (name, arg)) in template.iter().enumerate() {
                if i > 0 {
                    src.push_str(", ");
                }
                src.push_str(match arg {
                    TemplateArg::Int(_) => "int",
                    TemplateArg::Bool(_) => "bool",
                    TemplateArg::Dtype(_) => "typename",
                });
                src.push(' ');
                src.push_str(name);
            }
            src.push_str(">\n");
        }
        writeln!(src, "[[kernel]] void {kernel_name}(").unwrap();
        let mut index = 0usize;
        for ((name, arr), info) in self.input_names.iter().zip(inputs).zip(&self.shape_infos) {
            let location = if arr.size() < MAX_CONSTANT_ARRAY_SIZE { "constant" } else { "device" };
            let reference = if arr.shape.is_empty() { "&" } else { "*" };
            writeln!(src, "  const {location} {}{reference} {name} [[buffer({index})]],", arr.dtype.metal_name())
                .unwrap();
            index += 1;
            if !arr.shape.is_empty() {
                if info.shape {
                    writeln!(src, "  const constant int* {name}_shape [[buffer({index})]],").unwrap();
                    index += 1;
                }
                if info.strides {
                    writeln!(src, "  const constant int64_t* {name}_strides [[buffer({index})]],").unwrap();
                    index += 1;
                }
                if info.ndim {
                    writeln!(src, "  const constant int& {name}_ndim [[buffer({index})]],").unwrap();
                    index += 1;
                }
            }
        }
        for (name, dtype) in self.output_names.iter().zip(output_dtypes) {
            src.push_str("  device ");
            if self.atomic_outputs {
                write!(src, "atomic<{}>", dtype.metal_name()).unwrap();
            } else {
                src.push_str(dtype.metal_name());
            }
            write!(src, "* {name} [[buffer({index})]]").unwrap();
            // MLX compares the buffer index, which counts shape buffers, with
            // the number of arrays: with two or more outputs, a shape buffer
            // and no attribute, `) {` lands after the first output.
            if index + 1 < inputs.len() + self.output_names.len() || !self.attributes.is_empty() {
                src.push_str(",\n");
            } else {
                src.push_str(") {\n");
            }
            index += 1;
        }
        for (i, &a) in self.attributes.iter().enumerate() {
            let (attr, ty) = ATTRIBUTES[a];
            write!(src, "  {ty} {attr} [[{attr}]]").unwrap();
            src.push_str(if i + 1 < self.attributes.len() { ",\n" } else { ") {\n" });
        }
        src.push_str(&self.source);
        src.push_str("\n}\n");
        if !template.is_empty() {
            let def = format!("{kernel_name}{template_def}");
            write!(src, "\ntemplate [[host_name(\"{kernel_name}\")]] [[kernel]] decltype({def}) {def};\n").unwrap();
        }
        Generated { kernel_name, template_def, source: src }
    }

    /// Starts a launch of this kernel on the emulator.
    pub fn launch(&self) -> Run<'_> {
        Run::new(self)
    }
}

/// The repository root, whichever crate compiles these tests.
#[allow(clippy::join_absolute_paths)]
pub fn repo_root() -> PathBuf {
    // file!() is relative to the package root in the main crate and absolute
    // when another crate compiles this file by path.
    let this = Path::new(env!("CARGO_MANIFEST_DIR")).join(file!());
    this.ancestors().nth(3).expect("tests/metal_emulator/mod.rs has a repository root").to_path_buf()
}

/// A crate kernel as the crate hands it to MLX: its declaration's MLX name,
/// input and output names, Metal body and header (`Kernel::header`), without comments
/// (`kernels::compact_source`).
pub fn declared(kernel: veloxquant::kernels::Kernel) -> MetalKernel {
    use veloxquant::kernels::compact_source;
    let d = kernel.declaration();
    let body = d.metal.unwrap_or_else(|| panic!("{} has no Metal body", d.name));
    let header = kernel.header(veloxquant::Backend::Metal, &[]);
    MetalKernel::new(d.mlx_name, d.inputs, d.outputs, &compact_source(body)).with_header(&compact_source(&header))
}

/// The text of a kernel file `rel` (from the repository root) as the crate
/// hands it to MLX: without comments (`kernels::compact_source`).
pub fn kernel_source(rel: &str) -> String {
    let path = repo_root().join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    veloxquant::kernels::compact_source(&text)
}
