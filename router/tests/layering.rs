//! The router's imports only point down. `LAYERS` lists the top-level modules of `src/`, lowest first;
//! a module may use (`crate::…`) only modules listed before it, so the module graph has no cycle. The test
//! reads every source file of each module and fails naming the offending edge, or a module missing from
//! the list. `docs/architecture.md` shows the same order.
//!
//! Run: `cargo test --release --test layering`.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

/// Lowest first. A new module takes its place here (and in docs/architecture.md).
const LAYERS: &[&str] = &[
    "text",
    "telemetry",
    "metrics",
    "kv",
    "kv_events",
    "lora",
    "speculative",
    "grammar",
    "scheduler",
    "config",
    "validation",
    "shard",
    "engine",
    "api",
    "chat_template",
    "http",
];

/// The binary and the library root wire everything together; they sit above every layer.
const ROOTS: &[&str] = &["main", "lib"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(path: &Path, files: &mut Vec<PathBuf>) {
    if path.is_dir() {
        for entry in fs::read_dir(path).expect("readable source folder") {
            rust_files(&entry.expect("readable entry").path(), files);
        }
    } else if path.is_file() && path.extension().is_some_and(|e| e == "rs") {
        files.push(path.to_path_buf());
    }
}

/// The top-level modules a source text names through `crate::`: `crate::a::…` and every item of
/// `crate::{a::…, b, …}`. Comment lines are skipped.
fn crate_references(text: &str) -> BTreeSet<String> {
    let code: String = text
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if !rest.starts_with('{') {
            found.insert(ident(rest));
            continue;
        }
        // A group: split at the commas of its own level, take each item's first segment.
        let mut depth = 0;
        let mut item_start = 1;
        for (i, c) in rest.char_indices() {
            match c {
                '{' => depth += 1,
                '}' | ',' if depth == 1 => {
                    found.insert(ident(&rest[item_start..i]));
                    item_start = i + 1;
                    if c == '}' {
                        break;
                    }
                }
                '}' => depth -= 1,
                _ => {}
            }
        }
    }
    found.retain(|name| !name.is_empty() && name != "self");
    found
}

fn top_level_modules() -> BTreeSet<String> {
    fs::read_dir(src())
        .expect("readable src")
        .map(|entry| {
            let path = entry.expect("readable entry").path();
            let stem = path.file_stem().expect("a name").to_string_lossy().into_owned();
            stem
        })
        .filter(|name| !ROOTS.contains(&name.as_str()))
        .collect()
}

/// Every `crate::` edge out of a module, as (from, to, file).
fn edges(module: &str) -> Vec<(String, String, PathBuf)> {
    let mut files = Vec::new();
    rust_files(&src().join(module), &mut files);
    rust_files(&src().join(format!("{module}.rs")), &mut files);
    let mut edges = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file).expect("readable source");
        for to in crate_references(&text) {
            if to != module {
                edges.push((module.to_string(), to, file.clone()));
            }
        }
    }
    edges
}

#[test]
fn every_module_has_a_layer() {
    let listed: BTreeSet<String> = LAYERS.iter().map(|s| s.to_string()).collect();
    let actual = top_level_modules();
    let missing: Vec<_> = actual.difference(&listed).collect();
    let gone: Vec<_> = listed.difference(&actual).collect();
    assert!(missing.is_empty(), "modules not in LAYERS (place them): {missing:?}");
    assert!(gone.is_empty(), "LAYERS names modules that no longer exist: {gone:?}");
}

#[test]
fn imports_only_point_down() {
    let layer = |name: &str| LAYERS.iter().position(|l| *l == name);
    let mut upward = Vec::new();
    for (i, module) in LAYERS.iter().enumerate() {
        for (from, to, file) in edges(module) {
            match layer(&to) {
                Some(j) if j < i => {}
                _ => upward.push(format!(
                    "{from} -> {to} ({})",
                    file.strip_prefix(src()).unwrap_or(&file).display()
                )),
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports that do not point down (lowest first: {LAYERS:?}):\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_parser_sees_groups_and_paths() {
    let text =
        "use crate::{\n    kv::{A, B},\n    scheduler::X,\n};\n// crate::http in a comment\nlet x = crate::text::f();";
    let found: Vec<_> = crate_references(text).into_iter().collect();
    assert_eq!(found, ["kv", "scheduler", "text"]);
}
