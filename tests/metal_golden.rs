//! The emulator's wrapper generator against the sources MLX itself generated
//! (`tests/golden/metal/`, captured by `scripts/capture_metal_golden.py`).

mod metal_emulator;

use metal_emulator::{repo_root, Dtype, InputInfo, MetalKernel, TemplateArg};

struct Case {
    name: String,
    kernel: String,
    inputs: Vec<(String, InputInfo)>,
    outputs: Vec<(String, Dtype)>,
    template: Vec<(String, TemplateArg)>,
    atomic_outputs: bool,
    header: String,
    body: String,
}

fn dtype(name: &str) -> Dtype {
    Dtype::from_mlx_name(name).unwrap_or_else(|| panic!("unknown dtype {name}"))
}

fn parse_case(path: &std::path::Path) -> Case {
    let root = repo_root();
    let text = std::fs::read_to_string(path).unwrap();
    let mut case = Case {
        name: path.file_stem().unwrap().to_string_lossy().into_owned(),
        kernel: String::new(),
        inputs: vec![],
        outputs: vec![],
        template: vec![],
        atomic_outputs: false,
        header: String::new(),
        body: String::new(),
    };
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["kernel", k] => case.kernel = k.to_string(),
            ["input", n, t, dims] => {
                let shape = if *dims == "scalar" { vec![] } else { dims.split(',').map(|d| d.parse().unwrap()).collect() };
                case.inputs.push((n.to_string(), InputInfo { dtype: dtype(t), shape }));
            }
            ["output", n, t] => case.outputs.push((n.to_string(), dtype(t))),
            ["template", n, "int", v] => case.template.push((n.to_string(), TemplateArg::Int(v.parse().unwrap()))),
            ["template", n, "bool", v] => case.template.push((n.to_string(), TemplateArg::Bool(*v == "true"))),
            ["template", n, "dtype", v] => case.template.push((n.to_string(), TemplateArg::Dtype(dtype(v)))),
            ["atomic_outputs", v] => case.atomic_outputs = *v == "true",
            ["header_file", p] => case.header = std::fs::read_to_string(root.join(p)).unwrap(),
            ["body_file", p] => case.body = std::fs::read_to_string(root.join(p)).unwrap(),
            _ => panic!("{}: cannot parse `{line}`", path.display()),
        }
    }
    case
}

fn cases() -> Vec<std::path::PathBuf> {
    let dir = repo_root().join("tests/golden/metal");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "case"))
        .collect();
    paths.sort();
    paths
}

#[test]
fn generated_source_matches_mlx() {
    let paths = cases();
    // The three kernels, their template args and the wrapper features the
    // capture script covers; a missing file would silently shrink the test.
    assert!(paths.len() >= 25, "only {} golden cases", paths.len());
    let mut failures = Vec::new();
    for path in &paths {
        let case = parse_case(path);
        let names: Vec<&str> = case.inputs.iter().map(|(n, _)| n.as_str()).collect();
        let outs: Vec<&str> = case.outputs.iter().map(|(n, _)| n.as_str()).collect();
        let kernel = MetalKernel::new(&case.kernel, &names, &outs, &case.body)
            .with_header(&case.header)
            .with_atomic_outputs(case.atomic_outputs);
        let infos: Vec<InputInfo> = case.inputs.iter().map(|(_, i)| i.clone()).collect();
        let dtypes: Vec<Dtype> = case.outputs.iter().map(|(_, d)| *d).collect();
        let template: Vec<(&str, TemplateArg)> = case.template.iter().map(|(n, a)| (n.as_str(), *a)).collect();
        let generated = kernel.generate(&infos, &dtypes, &template);
        let golden_path = path.with_extension("metal");
        let golden = std::fs::read_to_string(&golden_path).unwrap();
        if generated.source != golden {
            let line = golden
                .lines()
                .zip(generated.source.lines())
                .position(|(a, b)| a != b)
                .map_or("(length differs)".to_string(), |i| format!("first difference at line {}", i + 1));
            failures.push(format!(
                "{}: {line}\n--- MLX\n{golden}\n--- emulator\n{}",
                case.name, generated.source
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "generated sources differ from MLX's (after editing a kernel body, re-run \
         scripts/capture_metal_golden.py):\n{}",
        failures.join("\n")
    );
}

#[test]
fn detection_is_by_substring() {
    // A comment and a longer identifier both count, as in MLX.
    let k = MetalKernel::new(
        "k",
        &["x", "y"],
        &["out"],
        "int max_shape = 0; // thread_index_in_simdgroup\nout[0] = y_strides[0];",
    );
    assert!(k.shape_infos[0].shape);
    assert!(!k.shape_infos[0].strides);
    assert!(k.shape_infos[1].strides);
    let attrs: Vec<&str> = k.attributes.iter().map(|&a| metal_emulator::ATTRIBUTES[a].0).collect();
    assert_eq!(attrs, ["thread_index_in_simdgroup"]);
}
