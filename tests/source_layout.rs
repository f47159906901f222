//! The crate's files import one another without loops across modules: each
//! file's `crate::`, `super::` and child-module paths are followed to the
//! file that defines them, and every strongly connected set of files must
//! lie within one module (a `mod.rs` and its own files). A loop across
//! modules (for instance the codecs' definitions calling the kernels that
//! read the codecs' registry) fails with the files on it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Source files by module path (`codec::layout` → `src/codec/layout.rs`).
fn source_files(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let p = entry.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).expect("under src").with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                parts.pop();
            }
            out.insert(parts, p);
        }
    }
    out
}

/// The text without comments (doc links name paths that are no imports).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut block = 0usize;
    for line in text.lines() {
        let mut rest = line;
        let mut kept = String::new();
        loop {
            if block > 0 {
                match rest.find("*/") {
                    Some(i) => {
                        block -= 1;
                        rest = &rest[i + 2..];
                    }
                    None => break,
                }
            } else {
                let (line_c, block_c) = (rest.find("//"), rest.find("/*"));
                match (line_c, block_c) {
                    (Some(l), b) if b.is_none_or(|b| l < b) => {
                        kept.push_str(&rest[..l]);
                        break;
                    }
                    (_, Some(b)) => {
                        kept.push_str(&rest[..b]);
                        block += 1;
                        rest = &rest[b + 2..];
                    }
                    _ => {
                        kept.push_str(rest);
                        break;
                    }
                }
            }
        }
        out.push_str(&kept);
        out.push('\n');
    }
    out
}

/// Every path of identifiers joined by `::` in `code` (a `use` list or glob
/// gives its prefix).
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < bytes.len() {
        if !ident(bytes[i]) || (i > 0 && (ident(bytes[i - 1]) || bytes[i - 1] == b':')) {
            i += 1;
            continue;
        }
        let mut parts = Vec::new();
        let mut j = i;
        loop {
            let start = j;
            while j < bytes.len() && ident(bytes[j]) {
                j += 1;
            }
            parts.push(code[start..j].to_string());
            if code[j..].starts_with("::") && j + 2 < bytes.len() && ident(bytes[j + 2]) {
                j += 2;
            } else {
                break;
            }
        }
        // `a::{...}` and `a::*` name `a`.
        if parts.len() > 1 || code[j..].starts_with("::") {
            out.push(parts);
        }
        i = j.max(i + 1);
    }
    out
}

/// The file defining the longest prefix of `path` that names a module.
fn resolve(files: &BTreeMap<Vec<String>, PathBuf>, mut path: Vec<String>) -> Option<Vec<String>> {
    while !path.is_empty() {
        if files.contains_key(&path) {
            return Some(path);
        }
        path.pop();
    }
    None
}

fn imports(files: &BTreeMap<Vec<String>, PathBuf>) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut graph = BTreeMap::new();
    for (module, file) in files {
        let code = code_of(&std::fs::read_to_string(file).expect("read source"));
        // `super::` is the module above this one: a `mod.rs` is its folder's
        // module, any other file a module of its own.
        let above: Vec<String> = module[..module.len().saturating_sub(1)].to_vec();
        let mut deps = BTreeSet::new();
        for p in paths(&code) {
            let target = match p[0].as_str() {
                "crate" => p[1..].to_vec(),
                "super" => {
                    let mut base = above.clone();
                    let mut rest = &p[1..];
                    while rest.first().is_some_and(|s| s == "super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                    base.extend(rest.iter().cloned());
                    base
                }
                "self" => [module.clone(), p[1..].to_vec()].concat(),
                child => {
                    let candidate = [module.clone(), vec![child.to_string()]].concat();
                    if !files.contains_key(&candidate) {
                        continue;
                    }
                    [candidate, p[1..].to_vec()].concat()
                }
            };
            if let Some(t) = resolve(files, target) {
                if &t != module {
                    deps.insert(t);
                }
            }
        }
        graph.insert(module.clone(), deps);
    }
    graph
}

/// Strongly connected sets of more than one file (Tarjan).
fn loops(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    struct State<'a> {
        graph: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on: BTreeSet<&'a Vec<String>>,
        out: Vec<Vec<Vec<String>>>,
    }
    fn visit<'a>(st: &mut State<'a>, v: &'a Vec<String>) {
        let n = st.index.len();
        st.index.insert(v, n);
        st.low.insert(v, n);
        st.stack.push(v);
        st.on.insert(v);
        for w in &st.graph[v] {
            if !st.index.contains_key(w) {
                visit(st, w);
                let lw = st.low[w];
                let lv = st.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if st.on.contains(w) {
                let iw = st.index[w];
                let lv = st.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if st.low[v] == st.index[v] {
            let mut set = Vec::new();
            while let Some(w) = st.stack.pop() {
                st.on.remove(w);
                set.push(w.clone());
                if w == v {
                    break;
                }
            }
            if set.len() > 1 {
                st.out.push(set);
            }
        }
    }
    let mut st = State { graph, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    for v in graph.keys() {
        if !st.index.contains_key(v) {
            visit(&mut st, v);
        }
    }
    st.out
}

#[test]
fn no_import_loop_across_modules() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = source_files(&src);
    let graph = imports(&files);
    // A loop within one module (its mod.rs and its own files) is how Rust
    // modules share their items; one that leaves the module is a layering loop.
    let crossing: Vec<String> = loops(&graph)
        .into_iter()
        .filter(|set| {
            let module_of = |m: &Vec<String>| -> Vec<String> {
                let is_dir = files[m].file_stem().is_some_and(|s| s == "mod");
                // A top-level file is a module of its own.
                if is_dir || m.len() <= 1 { m.clone() } else { m[..m.len() - 1].to_vec() }
            };
            let first = module_of(&set[0]);
            !set.iter().all(|m| module_of(m) == first)
        })
        .map(|set| set.iter().map(|m| m.join("::")).collect::<Vec<_>>().join(" ↔ "))
        .collect();
    assert!(crossing.is_empty(), "import loops across modules:\n{}", crossing.join("\n"));
    // The kernels read the codecs' layout only, never their definitions.
    for (m, deps) in &graph {
        if m.first().is_some_and(|s| s == "kernels" || s == "cpu") {
            for d in deps {
                assert!(
                    !(d.first().is_some_and(|s| s == "codec") && !matches!(d.get(1).map(String::as_str), Some("layout" | "tables"))),
                    "{} imports {}: the kernels may read only codec::layout and codec::tables",
                    m.join("::"),
                    d.join("::")
                );
            }
        }
    }
}
