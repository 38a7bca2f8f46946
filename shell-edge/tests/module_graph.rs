//! The Edge's modules form no import circle ("if two files import each
//! other, the shared name belongs in a third"), and `api/` is a leaf: the
//! API shapes, parsers and encoders depend on nothing of the pipeline. No
//! crate of the workspace has an import circle either, read two module
//! levels deep (`core`'s `edge::durable` and `edge::request` are two).
//!
//! The graph is read from the sources: every `crate::x` path in code (not
//! comments) is an edge from the file's top-level module to `x`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            source_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Top-level module -> the top-level modules its code names.
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    source_files(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let first = file
            .strip_prefix(&src)
            .unwrap()
            .components()
            .next()
            .unwrap();
        let module = first.as_os_str().to_str().unwrap().trim_end_matches(".rs");
        if module == "lib" || module == "main" {
            continue;
        }
        let edges = graph.entry(module.to_owned()).or_default();
        for line in std::fs::read_to_string(&file).unwrap().lines() {
            let code = line.split("//").next().unwrap_or("");
            let mut rest = code;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    edges.insert(name);
                }
            }
        }
    }
    graph
}

/// A path from `from` back to itself, if there is one.
fn circle_through(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    let mut stack = vec![(from.to_owned(), vec![from.to_owned()])];
    let mut seen = BTreeSet::new();
    while let Some((at, path)) = stack.pop() {
        for next in graph.get(&at).into_iter().flatten() {
            if next == from {
                let mut circle = path.clone();
                circle.push(next.clone());
                return Some(circle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push((next.clone(), longer));
            }
        }
    }
    None
}

#[test]
fn no_two_modules_import_each_other_even_through_others() {
    let graph = module_graph();
    assert!(graph.contains_key("http") && graph.contains_key("stored"));
    let circles: Vec<String> = graph
        .keys()
        .filter_map(|m| circle_through(&graph, m))
        .map(|c| c.join(" -> "))
        .collect();
    assert!(circles.is_empty(), "import circles: {circles:#?}");
}

#[test]
fn api_depends_on_nothing_of_the_pipeline() {
    let graph = module_graph();
    let api = graph.get("api").expect("the api module");
    assert!(api.is_empty(), "api/ names {api:?}");
}

/// The module a file is, two levels deep (`edge::durable` for
/// `src/edge/durable.rs` and `src/edge/durable/tests.rs`); `None` for the
/// crate root.
fn file_module(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?.with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts.is_empty() || parts == ["lib"] || parts == ["main"] {
        return None;
    }
    parts.truncate(2);
    Some(parts.join("::"))
}

/// The module `crate::a::b` names, two levels deep where `a` is a
/// directory module.
fn named_module(src: &Path, a: &str, b: &str) -> String {
    if !b.is_empty()
        && (src.join(a).join(format!("{b}.rs")).exists() || src.join(a).join(b).is_dir())
    {
        format!("{a}::{b}")
    } else {
        a.to_owned()
    }
}

/// Module -> the modules its non-test code names, for the crate at `dir`.
fn crate_graph(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let src = dir.join("src");
    let mut files = Vec::new();
    source_files(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        if file.file_stem().is_some_and(|s| s == "tests") {
            continue;
        }
        let Some(module) = file_module(&src, &file) else {
            continue;
        };
        let text = std::fs::read_to_string(&file).unwrap();
        // A file's own test module is not part of the graph.
        let code = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or("");
        let edges = graph.entry(module.clone()).or_default();
        for line in code.lines() {
            let code = line.split("//").next().unwrap_or("");
            let mut rest = code;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let word = |s: &str| -> String {
                    s.chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect()
                };
                let a = word(rest);
                let b = rest
                    .strip_prefix(a.as_str())
                    .and_then(|r| r.strip_prefix("::"))
                    .map(word)
                    .unwrap_or_default();
                if a.is_empty() {
                    continue;
                }
                let target = named_module(&src, &a, &b);
                let nested = |x: &str, y: &str| x.starts_with(&format!("{y}::"));
                if target != module && !nested(&module, &target) && !nested(&target, &module) {
                    edges.insert(target);
                }
            }
        }
    }
    graph
}

#[test]
fn no_crate_of_the_workspace_has_an_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members: Vec<&str> = manifest
        .lines()
        .find(|l| l.starts_with("members"))
        .unwrap()
        .split('"')
        .skip(1)
        .step_by(2)
        .collect();
    assert!(members.contains(&"core") && members.contains(&"shell-node"));
    let mut circles = Vec::new();
    for member in members {
        let graph = crate_graph(&root.join(member));
        for m in graph.keys() {
            if let Some(c) = circle_through(&graph, m) {
                circles.push(format!("{member}: {}", c.join(" -> ")));
            }
        }
    }
    assert!(circles.is_empty(), "import circles: {circles:#?}");
}
